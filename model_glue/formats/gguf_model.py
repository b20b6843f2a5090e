"""The Llama family as a GGUF file describes it: the one room that maps llama.cpp's names onto the
runtime's model (contract.model).

- `llama_config(header)`: the config from the metadata (dims, heads, RoPE base, Llama 3's RoPE
  scaling from the rope_freqs tensor, a tied or separate output head);
- `with_rope_scaling(config, divisors)`: Llama 3's RoPE scaling read from the file's rope_freqs tensor;
- `with_matrix_formats(config, header)`: the layer matrices that keep more than 4 bits (Q8A);
  `shape_name(config)`: the contract shape it runs as (the loader checks that its kernels exist:
  model_glue.loading.model_kernel_specs);
- `tensor_plan(header, config)`: for every runtime tensor (contract.model.model_tensors), the GGUF
  tensors it is made of and how (repacked to Q4, Q8 or Q8A, or copied as f32), checked before any upload.

Pure Python (the page runs it in Pyodide, without numpy).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from contract.gguf import (GGML_TYPES, GGML_TYPES_BY_ID, EXACT_REPACKS, config_from_metadata,
                           type_name, wide_matrices)
from contract.family import GGUF_LAYER_NORMS
from contract.model import (ALL_MODEL_CONFIGS, DEFAULT_CONTEXT_LENGTH, LlamaConfig, layer_matrices, model_tensors,
                            rope_frequency_divisors)
from model_glue.errors import ModelError
from model_glue.formats.gguf_file import GGUFHeader, GGUFTensor

ROPE_FREQS = "rope_freqs.weight"
ROPE_FREQS_RTOL = 1e-4  # the file's f32 divisors against the contract's formula


def llama_config(header: GGUFHeader) -> LlamaConfig:
    """The file's model config (contract.gguf.config_from_metadata), without RoPE scaling: a
    file's rope_freqs tensor is matched against the known scalings in `with_rope_scaling`."""
    embedding = header.tensors.get("token_embd.weight")
    try:
        return config_from_metadata(header.metadata, has_output_head="output.weight" in header.tensors,
                                          embedding_rows=embedding.shape[1] if embedding else None)
    except ValueError as err:
        raise ModelError(str(err)) from err


# Llama 3's RoPE scaling comes as a rope_freqs tensor (the divisors, not the parameters): a file's is
# matched against the scalings of the contract's configs, applied to the file's head_dim and base.
KNOWN_ROPE_SCALINGS = sorted({c.rope_scaling for c in ALL_MODEL_CONFIGS.values() if c.rope_scaling is not None})


def _same_divisors(config: LlamaConfig, divisors: list[float]) -> bool:
    want = rope_frequency_divisors(config)
    return len(want) == len(divisors) and all(abs(a - b) <= ROPE_FREQS_RTOL * abs(a) for a, b in zip(want, divisors))


def with_rope_scaling(config: LlamaConfig, rope_divisors: list[float] | None) -> LlamaConfig:
    """The file's config with the RoPE scaling its rope_freqs values (`rope_divisors`, None without
    the tensor) hold, or a ModelError if they are no known scaling (contract.model.rope_frequency_divisors)."""
    if rope_divisors is None:
        return config
    for scaling in KNOWN_ROPE_SCALINGS:
        scaled = replace(config, rope_scaling=scaling)
        if _same_divisors(scaled, rope_divisors):
            return scaled
    known = "; ".join(f"factor {f:g}, low {lo:g}, high {hi:g}, original context {o}" for f, lo, hi, o in KNOWN_ROPE_SCALINGS)
    raise ModelError(f"the file's {ROPE_FREQS} tensor is not Llama 3's RoPE scaling with known parameters ({known})")


def with_matrix_formats(config: LlamaConfig, header: GGUFHeader) -> LlamaConfig:
    """The config with the matrices whose types their usual format would requantize (a layer matrix
    wider than 4 bits in any layer; an embedding or head not Q8_0) as `wide_matrices`
    (contract.gguf.wide_matrices): they run as Q8A, with the file's own values."""
    types = {m: {type_name(header.tensors[t].type_id) for layer in range(config.n_layers)
                 for t in _gguf_names(layer)[m] if t in header.tensors} for m in layer_matrices(config)}
    types["embed"] = {type_name(header.tensors[t].type_id) for t in ("token_embd.weight", "output.weight")
                      if t in header.tensors}
    return replace(config, wide_matrices=wide_matrices(types))


def shape_name(config: LlamaConfig) -> str:
    """The contract shape a config runs as (display only: the kernels are found by their own names):
    the config of the same widths, heads and head_dim, else a description of the shape."""
    fields = ("dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim")
    for name, contract in ALL_MODEL_CONFIGS.items():
        if all(getattr(contract, f) == getattr(config, f) for f in fields):
            return name
    return f"llama_d{config.dim}_f{config.ffn_dim}_h{config.n_heads}x{config.head_dim}_kv{config.n_kv_heads}"


@dataclass(frozen=True)
class TensorPart:
    """One GGUF tensor's share of a runtime tensor: `first_block` is where its 32-weight blocks start
    (an f32 tensor's part: the element it starts at)."""

    tensor: GGUFTensor
    first_block: int


@dataclass(frozen=True)
class PlannedTensor:
    """How one runtime tensor (or a Q4/Q8 matrix's group: codes, scales, mins) is made from the file."""

    names: tuple[str, ...]  # runtime tensors written (e.g. layers.0.qkv.q4, .scale, .min)
    nbytes: tuple[int, ...]
    target: str  # "q4", "q8", "q8a" (repacked on the GPU) or "f32" (copied)
    parts: tuple[TensorPart, ...]
    exact: bool


def _gguf_names(layer: int) -> dict[str, tuple[str, ...]]:
    """Each runtime tensor group of a layer -> the GGUF tensors (in row order) it is made of."""
    b = f"blk.{layer}"
    names = {norm: (f"{b}.{gguf}.weight",) for norm, gguf in GGUF_LAYER_NORMS.items()}
    return {**names, "qkv": (f"{b}.attn_q.weight", f"{b}.attn_k.weight", f"{b}.attn_v.weight"),
            "qkv_bias": (f"{b}.attn_q.bias", f"{b}.attn_k.bias", f"{b}.attn_v.bias"),
            "o": (f"{b}.attn_output.weight",), "gate_up": (f"{b}.ffn_gate.weight", f"{b}.ffn_up.weight"),
            "down": (f"{b}.ffn_down.weight",)}


def _source_names(runtime: str) -> tuple[str, ...]:
    """The GGUF tensors (in row order) a runtime tensor's group is made of."""
    if runtime in ("embed", "head", "final_norm"):
        return {"embed": ("token_embd.weight",), "head": ("output.weight",), "final_norm": ("output_norm.weight",)}[runtime]
    _, layer, part = runtime.split(".")
    return _gguf_names(int(layer))[part]


def tensor_plan(header: GGUFHeader, config: LlamaConfig) -> list[PlannedTensor]:
    """Every runtime tensor's sources, checked (present, a readable type, the expected shape)."""
    groups: dict[str, list] = {}
    for spec in model_tensors(config):
        group = spec.name.rsplit(".", 1)[0] if spec.role.startswith(("q4", "q8")) else spec.name
        groups.setdefault(group, []).append(spec)
    plan = []
    for group, specs in groups.items():
        role = specs[0].role
        target = {"q4": "q4", "q8": "q8", "q8a": "q8a", "norm": "f32", "bias": "f32"}[role]
        rows = specs[0].shape[0] if target != "f32" else 1
        cols = specs[0].shape[-1] * {"q4": 8, "q8": 4, "q8a": 4, "f32": 1}[target]
        parts, row, exact = [], 0, True
        for source in _source_names(group):
            tensor = header.tensors.get(source)
            if tensor is None:
                raise ModelError(f"the GGUF lacks tensor {source}")
            ggml = GGML_TYPES_BY_ID.get(tensor.type_id)
            if ggml is None:
                raise ModelError(f"tensor {source} is {tensor.type_name}, which this runtime does not read "
                                 f"(it reads {', '.join(GGML_TYPES)})")
            if target == "f32" and ggml.name not in ("F32", "F16"):
                raise ModelError(f"{role} {source} is {ggml.name}; expected F32 or F16")
            if target == "f32":  # a vector (norm, bias), or the concatenation of a few (q, k, v biases)
                if len(tensor.shape) != 1:
                    raise ModelError(f"tensor {source} has shape {list(tensor.shape)}, expected a vector")
                parts.append(TensorPart(tensor, row))  # f32: the element it starts at
                row += tensor.shape[0]
                continue
            if tensor.shape[0] != cols or len(tensor.shape) != 2:
                raise ModelError(f"tensor {source} has shape {list(tensor.shape)}, expected {cols} columns "
                                 "(ne0 first)")
            parts.append(TensorPart(tensor, row * cols // 32))
            row += tensor.shape[1]
            exact = exact and (target == "f32" or (ggml.name, target) in EXACT_REPACKS)
        if target == "f32":
            row, rows = row, cols
        if row != rows:
            raise ModelError(f"{' + '.join(_source_names(group))} give {row} rows; {group} needs {rows}")
        plan.append(PlannedTensor(tuple(s.name for s in specs), tuple(s.nbytes for s in specs), target, tuple(parts),
                                  exact))
    return plan


def f32_values(tensor: GGUFTensor, raw: bytes) -> bytes:
    """A norm's bytes as little-endian f32 (F16 norms are widened)."""
    if tensor.type_name == "F32":
        return raw
    return struct.pack(f"<{tensor.elements}f", *struct.unpack(f"<{tensor.elements}e", raw))


def context_length(header: GGUFHeader) -> int:
    return int(header.get(f"{header.get('general.architecture')}.context_length", DEFAULT_CONTEXT_LENGTH))


def parse_f32(raw: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
