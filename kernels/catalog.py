"""Which kernels the artifact holds, by name. The name encodes every compile-time parameter.

Decode attention is built for each (nest, shape, dtype, window) the tests, the benchmark and the
model use: f16 for adapters with shader-f16, f32 for the others (e.g. Chromium's SwiftShader).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.decode_attention import decode_attention_sharded, decode_attention_tiled
from kernels.probe import row_sum_probe

NESTS = {"tiled": decode_attention_tiled, "sharded": decode_attention_sharded}
DTYPE_TAGS = {"float16": "f16", "float32": "f32"}


@dataclass(frozen=True)
class AttentionShape:
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int


# The benchmark's shapes (issue 3): D=64 8/32, D=128 8/32 (Llama-3.1-8B), D=256 4/8; SmolLM2: 3/9.
BENCH_SHAPES = [AttentionShape(8, 32, 64), AttentionShape(8, 32, 128), AttentionShape(4, 8, 256)]
MODEL_SHAPES = [AttentionShape(3, 9, 64)]
# The test grid: every head_dim with GQA groups 1, 3, 4, 8 (small head counts keep lavapipe fast).
TEST_SHAPES = [AttentionShape(kv, kv * group, d) for d in (64, 128, 256) for kv, group in ((2, 1), (1, 3), (1, 4), (1, 8))]


def attention_kernel_name(nest: str, shape: AttentionShape, dtype: str, sliding_window: bool) -> str:
    window = "_sw" if sliding_window else ""
    return (f"decode_{nest}_d{shape.head_dim}_kv{shape.num_kv_heads}_qo{shape.num_qo_heads}"
            f"_{DTYPE_TAGS[dtype]}{window}")


BUILDERS = {"row_sum_probe": row_sum_probe, **NESTS}


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


def all_recipes() -> list[KernelRecipe]:
    recipes = [KernelRecipe("row_sum_probe", "row_sum_probe", (), {"kind": "probe"})]
    recipes += _attention_recipes(TEST_SHAPES + BENCH_SHAPES + MODEL_SHAPES, ("float16", "float32"), (False,))
    recipes += _attention_recipes([AttentionShape(1, 4, d) for d in (64, 128, 256)], ("float16", "float32"), (True,))
    unique = {r.name: r for r in recipes}  # shapes may repeat across lists
    return list(unique.values())
