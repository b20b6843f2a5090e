"""Which kernels the artifact holds, by name. The name encodes every compile-time parameter.

Decode attention is built for each (nest, shape, dtype, window) the tests, the benchmark and the
model use: f16 for adapters with shader-f16, f32 for the others (e.g. Chromium's SwiftShader).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.decode_attention import decode_attention_sharded, decode_attention_tiled
from kernels import llama
from kernels.probe import row_sum_probe, stream_read_probe
from kernels.shapes import (DTYPE_TAGS, BENCH_SHAPES, LLAMA_CONFIGS, MODEL_SHAPES, PREFILL_TOKENS_PER_GROUP, TEST_SHAPES,
                            WINDOW_SHAPES, attention_kernel_name)

NESTS = {"tiled": decode_attention_tiled, "sharded": decode_attention_sharded}
BUILDERS = {
    "row_sum_probe": row_sum_probe, "stream_read_probe": stream_read_probe, **NESTS,
    "embedding_q8": llama.embedding_q8, "rms_norm": llama.rms_norm, "quantized_matmul": llama.quantized_matmul,
    "rope_and_append": llama.rope_and_append, "swiglu": llama.swiglu, "argmax": llama.argmax,
}


@dataclass(frozen=True)
class KernelRecipe:
    """A kernel to build: BUILDERS[builder](*args) gives its PrimFunc (picklable for a process pool)."""

    name: str
    builder: str
    args: tuple = ()
    meta: dict = field(default_factory=dict, hash=False)
    max_workgroup_storage: int = 16384

    def make(self):
        return BUILDERS[self.builder](*self.args)


def _attention_recipes(shapes, dtypes, windows) -> list[KernelRecipe]:
    recipes = []
    for shape in shapes:
        for dtype in dtypes:
            for window in windows:
                for nest in NESTS:
                    args = (shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, dtype, window)
                    meta = {"kind": "decode_attention", "nest": nest, "num_kv_heads": shape.num_kv_heads,
                            "num_qo_heads": shape.num_qo_heads, "head_dim": shape.head_dim,
                            "dtype": dtype, "sliding_window": window}
                    # TVM's tiled kernel may exceed the 16 KiB default (f32, group 1); ours may not.
                    limit = 32768 if nest == "tiled" else 16384
                    recipes.append(KernelRecipe(attention_kernel_name(nest, shape, dtype, window), nest, args, meta, limit))
    return recipes


def llama_recipes(tag: str, c: dict, dtype: str) -> list[KernelRecipe]:
    """Every non-attention kernel of one model config; the runtime finds them by meta 'role'."""
    qkv = (c["n_heads"] + 2 * c["n_kv_heads"]) * c["head_dim"]
    attn = c["n_heads"] * c["head_dim"]
    T8 = PREFILL_TOKENS_PER_GROUP
    roles = {
        "embed": ("embedding_q8", (c["vocab_size"], c["dim"], dtype)),
        "rms_norm": ("rms_norm", (c["dim"], c["rms_eps"], dtype)),
        "rope_append": ("rope_and_append", (c["n_heads"], c["n_kv_heads"], c["head_dim"], c["rope_theta"], dtype)),
        "swiglu": ("swiglu", (c["ffn_dim"], dtype)),
        "lm_head": ("quantized_matmul", (c["vocab_size"], c["dim"], dtype, "q8", 1, False, "float32")),
        "argmax": ("argmax", (c["vocab_size"],)),
    }
    for tokens, suffix in ((1, "decode"), (T8, "prefill")):
        roles[f"qkv_{suffix}"] = ("quantized_matmul", (qkv, c["dim"], dtype, "q4", tokens, False))
        roles[f"o_{suffix}"] = ("quantized_matmul", (c["dim"], attn, dtype, "q4", tokens, True))
        roles[f"gate_up_{suffix}"] = ("quantized_matmul", (2 * c["ffn_dim"], c["dim"], dtype, "q4", tokens, False))
        roles[f"down_{suffix}"] = ("quantized_matmul", (c["dim"], c["ffn_dim"], dtype, "q4", tokens, True))
    recipes = []
    for role, (builder, args) in roles.items():
        meta = {"kind": "llama", "model": tag, "role": role, "dtype": dtype, "config": c}
        recipes.append(KernelRecipe(f"{tag}_{role}_{DTYPE_TAGS[dtype]}", builder, args, meta))
    return recipes


def all_recipes() -> list[KernelRecipe]:
    recipes = [KernelRecipe("row_sum_probe", "row_sum_probe", (), {"kind": "probe"}),
               KernelRecipe("stream_read", "stream_read_probe", (), {"kind": "probe"})]
    recipes += _attention_recipes(TEST_SHAPES + BENCH_SHAPES + MODEL_SHAPES, ("float16", "float32"), (False,))
    recipes += _attention_recipes(WINDOW_SHAPES, ("float16", "float32"), (True,))
    for tag, config in LLAMA_CONFIGS.items():
        for dtype in ("float16", "float32"):
            recipes += llama_recipes(tag, config, dtype)
    unique = {r.name: r for r in recipes}  # shapes may repeat across lists
    return list(unique.values())
