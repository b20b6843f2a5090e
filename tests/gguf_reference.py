"""The tests' independent reading of a GGUF: dense float32 weights through the `gguf` package's own
dequantizers, never the runtime's repack or the artifact's packing. Any family of contract.family:
the tensors a layer holds are the ones its description names."""

from __future__ import annotations

from typing import Iterable

import numpy as np
from gguf.quants import dequantize

from contract.family import GGUF_LAYER_NORMS
from contract.gguf import config_from_metadata
from convert.gguf_fields import gguf_field, open_gguf


def _layer_names(i: int) -> dict[str, list[str]]:
    """The GGUF tensors each fused artifact matrix stacks, in row order."""
    b = f"blk.{i}"
    return {"qkv": [f"{b}.attn_q.weight", f"{b}.attn_k.weight", f"{b}.attn_v.weight"],
            "o": [f"{b}.attn_output.weight"],
            "gate_up": [f"{b}.ffn_gate.weight", f"{b}.ffn_up.weight"],
            "down": [f"{b}.ffn_down.weight"]}


def load_gguf_weights(gguf_path, layers: Iterable[int] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict (LlamaConfig.to_dict(): family and sliding_window included), dense weights) with the
    names of convert.weights.load_artifact_weights: `embed`, `final_norm`, `head` (untied only) and per
    layer the fused matrices, the family's norms (`Family.layer_norms`, from `blk.{i}.<GGUF_LAYER_NORMS
    name>.weight`) and, with qkv_bias, `qkv_bias` (attn_q|attn_k|attn_v biases)."""
    reader = open_gguf(gguf_path)
    arch = gguf_field(reader, "general.architecture")
    metadata = {key: gguf_field(reader, key) for key in reader.fields
                if key == "general.architecture" or key.startswith(f"{arch}.")}
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config = config_from_metadata(metadata, has_output_head="output.weight" in tensors,
                                  embedding_rows=len(tokens.data) if tokens is not None else None)
    family = config.arch

    def dense(name):
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    wanted = range(config.n_layers) if layers is None else list(layers)
    out = {"embed": dense("token_embd.weight"), "final_norm": dense("output_norm.weight")}
    if not config.tied_embeddings:
        out["head"] = dense("output.weight")
    for i in wanted:
        p = f"layers.{i}"
        for norm in family.layer_norms:
            out[f"{p}.{norm}"] = dense(f"blk.{i}.{GGUF_LAYER_NORMS[norm]}.weight")
        if family.qkv_bias:
            out[f"{p}.qkv_bias"] = np.concatenate([dense(f"blk.{i}.attn_{x}.bias") for x in "qkv"])
        for mat, names in _layer_names(i).items():
            out[f"{p}.{mat}"] = np.concatenate([dense(n) for n in names], axis=0)
    return config.to_dict(), out
