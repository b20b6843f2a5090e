"""Attention shapes and kernel names. Imports nothing from TVM: the benchmark reads this on a
GPU machine that only has the built artifact."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_TAGS = {"float16": "f16", "float32": "f32"}


@dataclass(frozen=True)
class AttentionShape:
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int


# The benchmark's shapes: D=64 8/32, D=128 8/32 (Llama-3.1-8B), D=256 4/8; SmolLM2: 3/9.
BENCH_SHAPES = [AttentionShape(8, 32, 64), AttentionShape(8, 32, 128), AttentionShape(4, 8, 256)]
MODEL_SHAPES = [AttentionShape(3, 9, 64), AttentionShape(2, 4, 64), AttentionShape(1, 2, 64)]  # SmolLM2, tiny_*
# The test grid: every head_dim with every GQA group 1-8 (one KV head keeps lavapipe fast; group 1
# with two). TVM's tiled kernel is wrong at head_dim 256 with groups 5 and 7 (see
# kernels.decode_attention.tiled_query_heads_computed); the tests check that the build marks it.
TEST_SHAPES = [AttentionShape(2 if group == 1 else 1, (2 if group == 1 else 1) * group, d)
               for d in (64, 128, 256) for group in range(1, 9)]
# Sliding-window variants (tests): GQA group 4 for each head_dim.
WINDOW_SHAPES = [AttentionShape(1, 4, d) for d in (64, 128, 256)]


def attention_kernel_name(nest: str, shape: AttentionShape, dtype: str, sliding_window: bool) -> str:
    """The name encodes every compile-time parameter of a decode attention kernel."""
    window = "_sw" if sliding_window else ""
    return (f"decode_{nest}_d{shape.head_dim}_kv{shape.num_kv_heads}_qo{shape.num_qo_heads}"
            f"_{DTYPE_TAGS[dtype]}{window}")


# Llama-shaped configs the artifact has kernels for (weights come from model_glue.convert).
LLAMA_CONFIGS = {
    "smollm2_135m": {"dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                     "ffn_dim": 1536, "vocab_size": 49152, "rope_theta": 100000.0, "rms_eps": 1e-5},
    # Tiny random-weight model for fast tests, built by the same code paths.
    "tiny_llama": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
                   "ffn_dim": 512, "vocab_size": 512, "rope_theta": 10000.0, "rms_eps": 1e-5},
    # Random weights behind SmolLM2's tokenizer (its vocab): lets the browser tests drive the
    # whole chat page on SwiftShader, where SmolLM2 itself takes minutes per reply.
    "tiny_chat": {"dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 64,
                  "ffn_dim": 256, "vocab_size": 49152, "rope_theta": 100000.0, "rms_eps": 1e-5},
}
PREFILL_TOKENS_PER_GROUP = 8  # tokens one matmul workgroup serves in prefill (weights reused)
