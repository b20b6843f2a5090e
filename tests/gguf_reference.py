"""The tests' independent reading of a GGUF: dense float32 weights through the `gguf` package's own
dequantizers, never the runtime's repack or the artifact's packing."""

from __future__ import annotations

from typing import Iterable

import numpy as np
from gguf.quants import dequantize

from contract.gguf import llama_config_from_metadata
from convert.gguf_fields import gguf_field, open_gguf


def _layer_names(i: int) -> dict[str, list[str]]:
    """The GGUF tensors each fused artifact matrix stacks, in row order."""
    b = f"blk.{i}"
    return {"qkv": [f"{b}.attn_q.weight", f"{b}.attn_k.weight", f"{b}.attn_v.weight"],
            "o": [f"{b}.attn_output.weight"],
            "gate_up": [f"{b}.ffn_gate.weight", f"{b}.ffn_up.weight"],
            "down": [f"{b}.ffn_down.weight"]}


def load_gguf_weights(gguf_path, layers: Iterable[int] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict, dense weights) with the names of convert.weights.load_artifact_weights."""
    reader = open_gguf(gguf_path)
    metadata = {key: gguf_field(reader, key) for key in reader.fields
                if key == "general.architecture" or key.startswith("llama.")}
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config = llama_config_from_metadata(metadata, has_output_head="output.weight" in tensors,
                                        embedding_rows=len(tokens.data) if tokens is not None else None).to_dict()

    def dense(name):
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    wanted = range(config["n_layers"]) if layers is None else list(layers)
    out = {"embed": dense("token_embd.weight"), "final_norm": dense("output_norm.weight")}
    for i in wanted:
        p = f"layers.{i}"
        out[f"{p}.attn_norm"] = dense(f"blk.{i}.attn_norm.weight")
        out[f"{p}.ffn_norm"] = dense(f"blk.{i}.ffn_norm.weight")
        for mat, names in _layer_names(i).items():
            out[f"{p}.{mat}"] = np.concatenate([dense(n) for n in names], axis=0)
    return config, out
