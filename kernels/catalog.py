"""Which kernels the artifact holds, by name. The name encodes every compile-time parameter.

Decode attention is built for each (nest, shape, dtype, window) the tests, the benchmark and the
models use: f16 for adapters with shader-f16, f32 for the others (e.g. Chromium's SwiftShader).
Every model kernel comes from a role of model_glue.contract.LLAMA_ROLES, whose buffer names the
build checks against the kernel it makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels import llama
from kernels.decode_attention import decode_attention_sharded, decode_attention_tiled
from kernels.decode_attention_split import decode_attention_split_merge, decode_attention_split_partial
from kernels.probe import row_sum_probe, stream_read_probe
from model_glue.contract import (BENCH_SHAPES, DTYPES, LAYER_MATMULS, LLAMA_ROLES, MAX_TOP_K, MODEL_CONFIGS, MODEL_SHAPES, PAGE_SIZE,
                                 PREFILL_TOKENS_PER_GROUP, SPLIT_VARIANTS, TEST_SHAPES,
                                 TILED_WORKGROUP_STORAGE_BYTES, WINDOW_SHAPES, WORKGROUP_STORAGE_BYTES, LlamaConfig,
                                 attention_kernel_name, model_kernel_name, split_merge_kernel_name)

NEST_BUILDERS = {"tiled": decode_attention_tiled, "sharded": decode_attention_sharded}
BUILDERS = {
    "row_sum_probe": row_sum_probe, "stream_read_probe": stream_read_probe, **NEST_BUILDERS,
    "split_partial": decode_attention_split_partial, "split_merge": decode_attention_split_merge,
    "embedding_q8": llama.embedding_q8, "rms_norm": llama.rms_norm, "quantized_matmul": llama.quantized_matmul,
    "rope_and_append": llama.rope_and_append, "swiglu": llama.swiglu, "argmax": llama.argmax,
    "sample_top_k_top_p": llama.sample_top_k_top_p,
}


@dataclass(frozen=True)
class KernelRecipe:
    """A kernel to build: BUILDERS[builder](*args) gives its PrimFunc (picklable for a process pool).

    `buffers`, when given, are the names the runtime will bind: the build fails unless the kernel
    declares exactly these.
    """

    name: str
    builder: str
    args: tuple = ()
    meta: dict = field(default_factory=dict, hash=False)
    max_workgroup_storage: int = WORKGROUP_STORAGE_BYTES
    buffers: tuple[str, ...] | None = None

    def make(self):
        return BUILDERS[self.builder](*self.args)


def _attention_recipes(shapes, dtypes, windows) -> list[KernelRecipe]:
    recipes = []
    for shape in shapes:
        for dtype in dtypes:
            for window in windows:
                for nest in NEST_BUILDERS:
                    args = (shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, dtype, window)
                    meta = {"kind": "decode_attention", "nest": nest, "num_kv_heads": shape.num_kv_heads,
                            "num_qo_heads": shape.num_qo_heads, "head_dim": shape.head_dim,
                            "dtype": dtype, "sliding_window": window}
                    # TVM's tiled kernel may exceed the 16 KiB default (f32, group 1); ours may not.
                    limit = TILED_WORKGROUP_STORAGE_BYTES if nest == "tiled" else WORKGROUP_STORAGE_BYTES
                    recipes.append(KernelRecipe(attention_kernel_name(nest, shape, dtype, window), nest, args,
                                                meta, limit))
    return recipes


def _split_recipes(shapes, dtypes) -> list[KernelRecipe]:
    """Both split variants' partial kernels and their shared merge, for the shapes the model and the
    benchmark run (tests build their own grid: tests/test_decode_attention_split.py)."""
    recipes = []
    for shape in shapes:
        for dtype in dtypes:
            common = {"kind": "decode_attention", "num_kv_heads": shape.num_kv_heads,
                      "num_qo_heads": shape.num_qo_heads, "head_dim": shape.head_dim, "dtype": dtype,
                      "sliding_window": False}
            for variant in SPLIT_VARIANTS:
                args = (shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, dtype, False, PAGE_SIZE,
                        variant == "split_group")
                recipes.append(KernelRecipe(attention_kernel_name(variant, shape, dtype, False), "split_partial",
                                            args, {**common, "nest": variant}))
            recipes.append(KernelRecipe(split_merge_kernel_name(shape, dtype), "split_merge",
                                        (shape.num_qo_heads, shape.head_dim, dtype),
                                        {**common, "kind": "decode_attention_merge"}))
    return recipes


def _role_args(role: str, c: LlamaConfig, dtype: str) -> tuple:
    """The builder arguments of one role (its builder is LLAMA_ROLES[role].builder)."""
    if role == "embed":
        return (c.vocab_size, c.dim, dtype)
    if role == "rms_norm":
        return (c.dim, c.rms_eps, dtype)
    if role == "rope_append":
        return (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta, dtype)
    if role == "swiglu":
        return (c.ffn_dim, dtype)
    if role in ("norm_lm_head", "lm_head"):  # f32 logits for the argmax
        return (c.vocab_size, c.dim, dtype, "q8", 1, False, "float32", c.rms_eps if role == "norm_lm_head" else None)
    if role == "argmax":
        return (c.vocab_size,)
    if role == "sample":
        return (c.vocab_size, MAX_TOP_K)
    matmul, phase = role.rsplit("_", 1)
    tokens = 1 if phase == "decode" else PREFILL_TOKENS_PER_GROUP
    out_in = {"qkv": (c.qkv_dim, c.dim), "o": (c.dim, c.n_heads * c.head_dim),
              "gate_up": (2 * c.ffn_dim, c.dim), "down": (c.dim, c.ffn_dim)}[LAYER_MATMULS[matmul]]
    residual = matmul.endswith("_residual")
    norm_eps = c.rms_eps if matmul.startswith("norm_") else None
    return (*out_in, dtype, "q4", tokens, residual, None, norm_eps, matmul.endswith("_swiglu"))


def llama_recipes(config_name: str, c: LlamaConfig, dtype: str) -> list[KernelRecipe]:
    """Every non-attention kernel of one model config; the runtime finds them by name."""
    return [KernelRecipe(model_kernel_name(config_name, role, dtype), spec.builder, _role_args(role, c, dtype),
                         {"kind": "llama", "model": config_name, "role": role, "dtype": dtype},
                         buffers=spec.buffers)
            for role, spec in LLAMA_ROLES.items()]


def all_recipes() -> list[KernelRecipe]:
    recipes = [KernelRecipe("row_sum_probe", "row_sum_probe", (), {"kind": "probe"}),
               KernelRecipe("stream_read", "stream_read_probe", (), {"kind": "probe"})]
    recipes += _attention_recipes(TEST_SHAPES + BENCH_SHAPES + MODEL_SHAPES, DTYPES, (False,))
    recipes += _attention_recipes(WINDOW_SHAPES, DTYPES, (True,))
    recipes += _split_recipes(BENCH_SHAPES + MODEL_SHAPES, DTYPES)
    for name, config in MODEL_CONFIGS.items():
        for dtype in DTYPES:
            recipes += llama_recipes(name, config, dtype)
    unique = {r.name: r for r in recipes}  # shapes may repeat across lists
    return list(unique.values())
