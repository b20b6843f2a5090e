"""Dtypes and the Llama-shaped model configs the artifact has kernels for."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
    """What a model's kernels are compiled for. Run values (how many tokens a context may hold)
    are not part of it: they are model_glue.options.RunOptions."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_kv_heads, self.n_heads, self.head_dim)


MODEL_CONFIGS = {
    # SmolLM2-135M-Instruct, the model the page serves (converted from its GGUF).
    "smollm2_135m": LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                                vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
    # Random weights behind SmolLM2's tokenizer (its vocab): lets the browser tests drive the whole
    # chat page on SwiftShader, where SmolLM2 itself takes minutes per reply.
    "tiny_chat": LlamaConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=256,
                             vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
}
# A tiny random-weight model for fast native tests, built by the same code paths. Its kernels are
# in the tests' artifact only (kernels.catalog.test_recipes), never served.
TEST_MODEL_CONFIGS = {
    "tiny_llama": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                              vocab_size=512, rope_theta=10000.0, rms_eps=1e-5),
}
ALL_MODEL_CONFIGS = {**MODEL_CONFIGS, **TEST_MODEL_CONFIGS}

# Decode attention shapes the served artifact holds kernels for, besides the models' own.
# Benchmarks: D=64 8/32, D=128 8/32 (Llama-3.1-8B), D=256 4/8.
BENCH_SHAPES = [AttentionShape(8, 32, 64), AttentionShape(8, 32, 128), AttentionShape(4, 8, 256)]
MODEL_SHAPES = [config.attention_shape for config in MODEL_CONFIGS.values()]
