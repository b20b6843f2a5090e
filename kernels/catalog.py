"""Which kernels the artifact holds, by name. The name encodes every compile-time parameter.

Decode attention is built for each (nest, shape, dtype, window) the tests, the benchmark and the
model use: f16 for adapters with shader-f16, f32 for the others (e.g. Chromium's SwiftShader).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.decode_attention import decode_attention_sharded, decode_attention_tiled
from kernels.probe import row_sum_probe, stream_read_probe
from kernels.shapes import BENCH_SHAPES, MODEL_SHAPES, TEST_SHAPES, WINDOW_SHAPES, attention_kernel_name

NESTS = {"tiled": decode_attention_tiled, "sharded": decode_attention_sharded}
BUILDERS = {"row_sum_probe": row_sum_probe, "stream_read_probe": stream_read_probe, **NESTS}


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
    recipes = [KernelRecipe("row_sum_probe", "row_sum_probe", (), {"kind": "probe"}),
               KernelRecipe("stream_read", "stream_read_probe", (), {"kind": "probe"})]
    recipes += _attention_recipes(TEST_SHAPES + BENCH_SHAPES + MODEL_SHAPES, ("float16", "float32"), (False,))
    recipes += _attention_recipes(WINDOW_SHAPES, ("float16", "float32"), (True,))
    unique = {r.name: r for r in recipes}  # shapes may repeat across lists
    return list(unique.values())
