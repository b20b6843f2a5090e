"""What the runtime knows of GGUF (llama.cpp's model file): the tensor types it reads and how each
reaches the runtime's weight formats (contract.model: Q4, 4-bit codes with an f32 scale and min per
32 weights; Q8, signed bytes with an f32 scale per 32; Q8A, signed bytes with an f32 scale and min per
16).

A GGUF tensor's raw blocks are uploaded as they are and repacked on the GPU (kernels.gguf_repack).
Every quantized type maps to Q8A exactly (its codes are kept, as bytes, and a block's scale and min
are the file's, multiplied out in f32: exact, as a 6- or 8-bit scale times an f16 fits an f32), the
4-bit ones to Q4 exactly too, Q8_0 to Q8. A layer matrix is Q4 where every layer's tensor of it is a
4-bit type, the embedding (with the head) Q8 where it is Q8_0 or a float type, else each is Q8A
(`wide_matrices`). Every other pair is a requantization (min/max per block for Q4 and Q8A, absolute
max for Q8): only the float types take one.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.family import family
from contract.model import LlamaConfig


@dataclass(frozen=True)
class GGMLType:
    name: str
    type_id: int  # ggml_type in ggml.h
    block_elements: int  # weights per block (32, or 256 for K-quants)
    block_bytes: int

    @property
    def sub_blocks(self) -> int:
        """32-weight sub-blocks per block: one runtime block each."""
        return self.block_elements // 32

    def nbytes(self, elements: int) -> int:
        return elements // self.block_elements * self.block_bytes


GGML_TYPES = {t.name: t for t in (
    GGMLType("F32", 0, 32, 128), GGMLType("F16", 1, 32, 64), GGMLType("BF16", 30, 32, 64),
    GGMLType("Q4_0", 2, 32, 18), GGMLType("Q4_1", 3, 32, 20), GGMLType("Q5_0", 6, 32, 22),
    GGMLType("Q5_1", 7, 32, 24), GGMLType("Q8_0", 8, 32, 34),
    GGMLType("Q4_K", 12, 256, 144), GGMLType("Q5_K", 13, 256, 176), GGMLType("Q6_K", 14, 256, 210),
)}
GGML_TYPES_BY_ID = {t.type_id: t for t in GGML_TYPES.values()}
# Unsupported ids with their names, so a refusal can say what the file holds.
GGML_TYPE_NAMES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
                   19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
                   26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0"}

FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
QUANTIZED_TYPES = FOUR_BIT_TYPES + ("Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K")
# (source type, runtime format) pairs whose repack keeps the file's values bit for bit.
EXACT_REPACKS = ({(t, "q4") for t in FOUR_BIT_TYPES} | {("Q8_0", "q8")} | {(t, "q8a") for t in QUANTIZED_TYPES})
REPACK_TARGETS = ("q4", "q8", "q8a")
REPACK_BUFFERS = {"q4": ("raw", "q4", "scale", "wmin"), "q8": ("raw", "q8", "scale"),
                  "q8a": ("raw", "q8a", "scale", "wmin")}


# The types a matrix keeps its own format for: a layer matrix Q4, the embedding (and head) Q8. The
# float types are quantized at load either way; Q8A is the more faithful home for them in a layer.
NARROW_TYPES = {"layer": set(FOUR_BIT_TYPES), "embed": {"Q8_0", "F32", "F16", "BF16"}}


def wide_matrices(types_by_matrix: dict[str, set[str]]) -> tuple[str, ...]:
    """The matrices stored as Q8A (contract.model.LlamaConfig.wide_matrices), from the GGUF types each
    matrix's tensors have (over all layers; "embed": the embedding's and the head's): those with any
    type outside NARROW_TYPES."""
    return tuple(m for m, types in types_by_matrix.items()
                 if not types <= NARROW_TYPES["embed" if m == "embed" else "layer"])


def repack_kernel_name(source: str, target: str) -> str:
    return f"gguf_repack_{source.lower()}_to_{target}"


def type_name(type_id: int) -> str:
    known = GGML_TYPES_BY_ID.get(type_id)
    return known.name if known else GGML_TYPE_NAMES.get(type_id, f"type {type_id}")


def config_from_metadata(metadata: dict, *, has_output_head: bool, embedding_rows: int | None = None) -> LlamaConfig:
    """The model config a GGUF's metadata gives (values as Python; the runtime's pure-Python reader and
    the converter's `gguf` package both produce them), for any family of contract.family.FAMILIES,
    without RoPE scaling: that is the rope_freqs tensor, matched against the contract's configs by the
    runtime. ValueError names what is missing or which architectures run."""
    arch = metadata.get("general.architecture")
    fam = family(str(arch))

    def field(key, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF lacks {arch}.{key}")
        return value

    dim, n_heads = int(field("embedding_length")), int(field("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ()) \
        or embedding_rows
    if not vocab:
        raise ValueError(f"the GGUF gives no vocabulary size ({arch}.vocab_size, tokenizer.ggml.tokens)")
    window = metadata.get(f"{arch}.attention.sliding_window") if fam.global_every else None
    return LlamaConfig(
        dim=dim, n_layers=int(field("block_count")), n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=int(field("attention.key_length", 0) or field("rope.dimension_count", 0) or dim // n_heads),
        ffn_dim=int(field("feed_forward_length")), vocab_size=int(vocab),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rms_eps=round(float(field("attention.layer_norm_rms_epsilon")), 12),  # f32: 9.99999974738e-06 means 1e-05
        tied_embeddings=not has_output_head, family=fam.name, sliding_window=int(window) if window else None)
