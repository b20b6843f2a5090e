"""Which kernels the artifacts hold. Every kernel comes from a typed spec of contract.kernels
(`AttentionSpec`, `MatmulSpec`, `KernelRole`): its name and the buffers the runtime binds are the
spec's, and the build fails unless the kernel declares exactly those buffers.

The served artifact (`all_recipes`): decode attention for each shape the benchmark and the served
models use, f16 for adapters with shader-f16 and f32 for the others (e.g. Chromium's SwiftShader):
TVM's tiled nest and every layout of the sharded family (contract.attention.LAYOUTS), each over the whole context and split,
plus the merge and the prefill kernel; and every served model's kernels, named by what they are
compiled for (row widths, head_dim: contract.kernels.llama_kernels), so shapes that share a width
share a kernel and the runtime gives the rest as values. The tests' artifact
(`test_recipes`, `python -m app build --set tests`) holds what only the tests run: a grid of
attention shapes and the tiny test model's kernels.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from contract.attention import LAYOUT_NAMES, LAYOUTS, LAYOUTS_BY_NAME, MATRIX_PREFILL, Layout
from contract.kernels import (MATRIX_FRAGMENT, PREFILL_TOKEN_TILE, QUANTIZED_X, SERVED_MATMUL_SUBGROUP_LANES,
                              SHORT_PREFILL_TOKENS, SPLIT_WORKSPACE, TILED_WORKGROUP_STORAGE_BYTES,
                              WORKGROUP_STORAGE_BYTES, AttentionSpec, MatmulSpec, llama_kernels)
from contract.model import (BENCH_SHAPES, DTYPE_TAGS, DTYPES, MODEL_CONFIGS, MODEL_SHAPES, SYNTHETIC_CONFIGS,
                            SYNTHETIC_DTYPES, TEST_MODEL_CONFIGS, AttentionShape, LlamaConfig)
from kernels import decode_matmul, layer_ops, sampling
from kernels.decode_attention_merge import decode_attention_merge
from kernels.decode_attention_tiled import decode_attention_tiled
from kernels.prefill_attention import prefill_attention, prefill_layout
from kernels.prefill_attention_matrix import matrix_prefill_attention
from kernels.prefill_matmul import quantized_matmul_tiled
from kernels.prefill_matmul_matrix import matrix_matmul
from kernels.wgsl import MAX_WORKGROUP_STORAGE
from kernels.probe import row_sum_probe, stream_read_probe
from kernels.gguf_repack import gguf_repack
from kernels.quantize_x import quantize_x
from kernels.random_fill import random_q4_blocks, random_uniform, random_words
from contract.gguf import GGML_TYPES, REPACK_BUFFERS, REPACK_TARGETS, repack_kernel_name

# Builders by name (a recipe names its builder, so recipes stay picklable for the build's process
# pool). The sharded family's layouts name theirs in contract.attention.LAYOUTS ("module:function").
BUILDERS = {
    "row_sum_probe": row_sum_probe, "stream_read_probe": stream_read_probe,
    "tiled": decode_attention_tiled, "merge": decode_attention_merge, "prefill_attention": prefill_attention,
    "prefill_attention_matrix": matrix_prefill_attention,
    "quantized_matmul_tiled": quantized_matmul_tiled, "prefill_matmul_matrix": matrix_matmul,
    "embedding_q8": layer_ops.embedding_q8, "rms_norm": layer_ops.rms_norm,
    "quantized_matmul": decode_matmul.quantized_matmul,
    "rope_and_append": layer_ops.rope_and_append, "swiglu": layer_ops.swiglu,
    "argmax_partials": sampling.argmax_partials,
    "sample_top_k_top_p": sampling.sample_top_k_top_p,
    "random_words": random_words, "random_uniform": random_uniform, "random_q4_blocks": random_q4_blocks,
    "gguf_repack": gguf_repack, "quantize_x": quantize_x,
}
PROBE_BUFFERS = {"row_sum_probe": ("x", "out"), "stream_read_probe": ("x", "partial")}


def _resolve(path: str):
    """The function a "module:function" path names."""
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


@dataclass(frozen=True)
class KernelRecipe:
    """A kernel to build: its builder (a BUILDERS name or a "module:function" path) called with
    (*args, **options) gives its PrimFunc (picklable for a process pool). `buffers` are the names
    the runtime will bind: the build fails unless the kernel declares exactly these. `subgroups`
    builds it with WebGPU's subgroup operations."""

    name: str
    builder: str
    args: tuple
    meta: dict = field(hash=False)
    buffers: tuple[str, ...]
    max_workgroup_storage: int = WORKGROUP_STORAGE_BYTES
    options: dict = field(default_factory=dict, hash=False)
    subgroups: bool = False

    def make(self):
        builder = _resolve(self.builder) if ":" in self.builder else BUILDERS[self.builder]
        return builder(*self.args, **self.options)


def probe_recipe(builder: str, name: str) -> KernelRecipe:
    return KernelRecipe(name, builder, (), {"kind": "probe"}, PROBE_BUFFERS[builder])


def fill_recipes() -> list[KernelRecipe]:
    """The GPU fills of a synthetic model's weights (model_glue.synthetic.FILL_KERNELS)."""
    return [KernelRecipe(name, name, (), {"kind": "fill"}, ("scale", "wmin") if name == "random_q4_blocks" else ("out",))
            for name in ("random_words", "random_uniform", "random_q4_blocks")]


def repack_recipes() -> list[KernelRecipe]:
    """The GPU repack of every GGUF tensor type the runtime reads into each weight format
    (model_glue.formats.gguf_upload); sizes are runtime values, so these serve every shape."""
    return [KernelRecipe(repack_kernel_name(source, target), "gguf_repack", (source, target),
                         {"kind": "gguf_repack", "source": source, "target": target}, REPACK_BUFFERS[target])
            for source in GGML_TYPES for target in REPACK_TARGETS]


def attention_recipe(spec: AttentionSpec, builder: str, meta: dict | None = None, *, options: dict | None = None,
                     suffix: str = "", subgroups: bool = False) -> KernelRecipe:
    """The recipe of an attention kernel: its name and buffers from `spec`, the builder's shape
    arguments from the spec's shape. A sharded layout's build is recorded in the manifest as
    `build` (its label, e.g. "subgroup_l8s32"; a sweep build's carries its suffix and `sweep`)."""
    s = spec.shape
    if spec.kernel == "merge":
        args = (s.num_qo_heads, s.head_dim, spec.dtype)
    elif spec.kernel == "prefill":
        args = (s.num_kv_heads, s.num_qo_heads, s.head_dim, spec.dtype)
    else:
        args = (s.num_kv_heads, s.num_qo_heads, s.head_dim, spec.dtype, spec.sliding_window)
    common = {"kind": "decode_attention", "num_kv_heads": s.num_kv_heads, "num_qo_heads": s.num_qo_heads,
              "head_dim": s.head_dim, "dtype": spec.dtype, "sliding_window": spec.sliding_window}
    if spec.kernel == "merge":
        common["kind"] = "decode_attention_merge"
    elif spec.kernel == "prefill":
        common = {"kind": "prefill_attention", **{k: common[k] for k in ("num_kv_heads", "num_qo_heads", "head_dim",
                                                                          "dtype")}}
    elif spec.kernel == "tiled":
        common.update(nest="tiled", split=False)
    else:
        common.update(nest="sharded", layout=spec.kernel, split=spec.split,
                      build=spec.kernel + (f"_{spec.tag}" if spec.tag else "") + suffix)
        if suffix:
            common["sweep"] = True
    # TVM's tiled kernel may exceed the 16 KiB default (f32, group 1); ours may not, but on subgroup matrices.
    storage = (TILED_WORKGROUP_STORAGE_BYTES if spec.kernel == "tiled" else
               MAX_WORKGROUP_STORAGE if spec.kernel == "prefill" and spec.tag else WORKGROUP_STORAGE_BYTES)
    return KernelRecipe(spec.name + suffix, builder, args, {**common, **(meta or {})}, spec.buffers, storage,
                        options or {}, subgroups=subgroups)


def layout_recipes(layout: Layout, shape: AttentionShape, dtype: str, sliding_window: bool = False, *,
                   build_params: dict | None = None, suffix: str = "") -> list[KernelRecipe]:
    """Every build of one layout for a shape (none where the shape does not fit), each over the
    whole context and split. `build_params` go to the layout's `builds` function (the sweep's and
    the tests' choice of subgroup builds)."""
    recipes = []
    for build in _resolve(layout.builds)(layout.name, shape, **(build_params or {})):
        for split in (False, True):
            spec = AttentionSpec(layout.name, shape, dtype, sliding_window, split, build.tag)
            recipes.append(attention_recipe(spec, layout.builder, build.meta, options={**build.options, "split": split},
                                            suffix=suffix, subgroups=layout.needs_subgroups))
    return recipes


def attention_recipes(shape: AttentionShape, dtype: str, sliding_window: bool = False, *,
                      layouts: tuple[str, ...] = LAYOUT_NAMES, build_params: dict | None = None) -> list[KernelRecipe]:
    """Every decode attention kernel the host may run for one shape: tiled, each layout of the
    sharded family (contract.attention.LAYOUTS) over the whole context and split, and the merge."""
    recipes = [attention_recipe(AttentionSpec("tiled", shape, dtype, sliding_window), "tiled")]
    for layout in LAYOUTS:
        if layout.name in layouts:
            recipes += layout_recipes(layout, shape, dtype, sliding_window,
                                      build_params=build_params if layout.needs_subgroups else None)
    return recipes + [attention_recipe(AttentionSpec("merge", shape, dtype), "merge")]


def prefill_attention_recipes(shape: AttentionShape, dtype: str) -> list[KernelRecipe]:
    """The causal paged prefill attention kernel of one shape (head_dim at most 128: it keeps D/4
    vectors of q and O a thread), and in f16 its build on subgroup matrices."""
    if shape.head_dim > 128:
        return []
    recipes = [attention_recipe(AttentionSpec("prefill", shape, dtype), "prefill_attention",
                                prefill_layout(shape.head_dim, dtype))]
    if dtype == "float16" and shape.head_dim % MATRIX_FRAGMENT == 0:
        recipes.append(matrix_prefill_attention_recipe(shape))
    return recipes


def matrix_prefill_attention_recipe(shape: AttentionShape) -> KernelRecipe:
    """The causal prefill attention of one shape on subgroup matrices (f16, WGSL)."""
    return attention_recipe(AttentionSpec("prefill", shape, "float16", tag=MATRIX_PREFILL), "prefill_attention_matrix",
                            {"build": MATRIX_PREFILL})


def llama_recipes(c: LlamaConfig, dtype: str, subgroup_lanes: tuple = ()) -> list[KernelRecipe]:
    """Every non-attention kernel of one model config, named by what it is compiled for
    (contract.kernels.llama_kernels): configs that share a row width, a head_dim or a model width
    share those kernels, and the runtime finds them by name. The decode matmuls also in each
    subgroup build of `subgroup_lanes` (MatmulSpec.subgroup_lanes), with and without int8 codes of
    x (MatmulSpec.int8_x: only beside subgroups, the GPUs' path). In f16 the folded prefill matmuls
    also have their subgroup-matrix builds (MatmulSpec.matrix, WGSL: kernels.prefill_matmul_matrix)."""
    recipes = {}
    for lanes, int8_x in [(None, False)] + [(lanes, int8_x) for lanes in subgroup_lanes for int8_x in (False, True)]:
        for role, spec in llama_kernels(c, dtype, lanes, int8_x, prefill_matrix=dtype == "float16").items():
            matrix = getattr(spec, "matrix", False)
            recipes[spec.name] = KernelRecipe(spec.name, spec.builder, spec.args,
                                              {"kind": "llama", "role": role, "dtype": dtype}, spec.buffers,
                                              MAX_WORKGROUP_STORAGE if matrix else WORKGROUP_STORAGE_BYTES,
                                              subgroups=getattr(spec, "subgroup_lanes", None) is not None)
    return list(recipes.values())


def all_recipes() -> list[KernelRecipe]:
    """The served artifact: the probes, decode attention for the benchmark's and the models' shapes,
    and every model's kernels."""
    recipes = [probe_recipe("row_sum_probe", "row_sum_probe"), probe_recipe("stream_read_probe", "stream_read")]
    for shape in BENCH_SHAPES + MODEL_SHAPES:
        for dtype in DTYPES:
            recipes += attention_recipes(shape, dtype)
            recipes += prefill_attention_recipes(shape, dtype)
    for name, config in MODEL_CONFIGS.items():
        for dtype in DTYPES:
            recipes += llama_recipes(config, dtype, (SERVED_MATMUL_SUBGROUP_LANES,))
    served_shapes = set(BENCH_SHAPES + MODEL_SHAPES)
    for name, config in SYNTHETIC_CONFIGS.items():
        for dtype in SYNTHETIC_DTYPES:
            recipes += llama_recipes(config, dtype, (SERVED_MATMUL_SUBGROUP_LANES,))
            if config.attention_shape not in served_shapes:  # Llama 3's 1B and 8B shapes are benchmark shapes
                recipes += attention_recipes(config.attention_shape, dtype)
                recipes += prefill_attention_recipes(config.attention_shape, dtype)
    recipes += fill_recipes() + repack_recipes()
    unique = {r.name: r for r in recipes}  # shapes may repeat across lists
    return list(unique.values())


# The benchmark's sweep of the subgroup layout's build parameters (`python -m app build --sweep`).
SWEEP_BUILDS = ((8, None), (16, None), (32, None), (8, 32), (16, 32), (32, 32))
SWEEP_UNROLL = (2, 4)
SWEEP_INVOCATIONS = (128, 256)


def sweep_recipes() -> list[KernelRecipe]:
    """Subgroup kernels for every (row lanes, unroll, invocations) of the sweep, f16, for the
    benchmark's shapes (named with a _u{unroll}_i{invocations} suffix; the runtime never loads them)."""
    recipes = []
    subgroup = LAYOUTS_BY_NAME["subgroup"]
    for shape in BENCH_SHAPES + [MODEL_CONFIGS["smollm2_135m"].attention_shape]:
        for unroll in SWEEP_UNROLL:
            for invocations in SWEEP_INVOCATIONS:
                recipes += layout_recipes(subgroup, shape, "float16", suffix=f"_u{unroll}_i{invocations}", build_params={
                    "builds": SWEEP_BUILDS, "unroll": unroll, "invocations": invocations})
    return recipes


# The tests' kernels (`python -m app build --set tests`; tests/test_decode_attention.py). The family
# runs on a grid of (head_dim, GQA group, dtype) that gives every head_dim both dtypes and every
# head-vector layout of the subgroup builds (1, 2, 3-4 and 8 heads) a shape; the RoPE, empty-sequence
# and unused-slot tests reuse its f32 shapes, the window tests have two shapes of their own. The
# subgroup layout runs as the relative build of 8 lanes per row, and the exact build of 4 lanes per
# row for subgroups of exactly 8: the subgroup size of the CPU adapter the tests run on (lavapipe on
# 256-bit vectors). Lavapipe compiles each kernel at its first dispatch, 10-25 s for the largest on a
# machine without Mesa's shader cache, so the grid is kept to what covers each code path: both dtypes
# per head_dim (head_dim 256 f16 through the window test), head vectors of 1, 2, 3 and 8 heads, two
# results per thread (head_dim 256 with 8 heads), the exact build's shuffle pre-merge.
TEST_SUBGROUP_BUILDS = ((8, None), (4, 8))
# The shards layouts (the fallback without subgroups) compile slowest, so they run on fewer shapes:
# both row paths (head_dim 64: a lane per dim; 128 and 256: dims split over threadIdx.y), both
# dtypes, groups 3 and 8, a window at head_dim 64 (shards_group) and 256 (shards, f16).
ALL_LAYOUTS = LAYOUT_NAMES
TEST_FAMILY_GRID = [(64, 1, "float16", ("subgroup",)), (64, 3, "float32", ALL_LAYOUTS),
                    (128, 2, "float16", ("subgroup",)), (128, 8, "float32", ALL_LAYOUTS),
                    (256, 8, "float32", ("shards", "subgroup"))]
# TVM's tiled kernel on every head_dim with every GQA group 1-8 (one KV head keeps lavapipe fast;
# group 1 with two), both dtypes per head_dim. It is wrong at head_dim 256 with groups 5 and 7; the
# build marks it (kernels.decode_attention_tiled.tiled_query_heads_computed) and the host never runs it.
TEST_SHAPES = [AttentionShape(2 if group == 1 else 1, (2 if group == 1 else 1) * group, d)
               for d in (64, 128, 256) for group in range(1, 9)]
TEST_TILED_GRID = [(shape, DTYPES[i % 2]) for i, shape in enumerate(TEST_SHAPES)]
TEST_WINDOW_SHAPES = [(AttentionShape(1, 4, 64), "float32", ("shards_group", "subgroup")),
                      (AttentionShape(1, 4, 256), "float16", ("shards", "subgroup"))]


# Prefill attention on GQA groups 1, 3, 4 and 8 at head_dim 64 and groups 1 and 8 at 128 (lavapipe
# compiles head_dim 128 slowly), the dtypes alternating so that each head_dim has both; the tiled
# prefill matmul with each fold on a small shape, both dtypes (tests/test_prefill_kernels.py).
TEST_PREFILL_ATTENTION = [(AttentionShape(2 if group == 1 else 1, (2 if group == 1 else 1) * group, d), DTYPES[i % 2])
                          for d, groups in ((64, (1, 3, 4, 8)), (128, (1, 8))) for i, group in enumerate(groups)]
TEST_PREFILL_MATMULS = {  # name: (out_features, in_features, residual, norm, swiglu)
    "plain": (128, 256, False, False, False), "residual": (192, 128, True, False, False),
    "norm": (320, 96, False, True, False), "norm_swiglu": (256, 160, False, True, True)}


# The decode matmul (kernels.decode_matmul.quantized_matmul) on the Llama shapes' row widths, with one, two and
# four weight rows a thread (contract.kernels.MatmulSpec.rows_per_thread: two where enough rows remain
# for PAIRED_MIN_WORKGROUPS workgroups, four for QUAD_MIN_WORKGROUPS; SwiGLU's gate and up rows in one
# thread), named by it.
TEST_DECODE_MATMULS = {"paired_norm_swiglu": (2048, 2048, False, True, True), "long_residual": (40, 4096, True, False, False),
                       "paired_norm_residual": (6144, 256, True, True, False), "quad_norm_swiglu": (16384, 128, False, True, True),
                       "quad_residual": (16384, 96, True, False, False)}


# The decode matmuls' subgroup builds the tests run (MatmulSpec.subgroup_lanes), each where the
# adapter's subgroups hold it: 8 lanes, the subgroup size of lavapipe on a 256-bit CPU (the tiny test
# model runs it too), and the served artifact's 32 (GPUs: the H200).
TEST_MATMUL_SUBGROUP_LANES = (8, SERVED_MATMUL_SUBGROUP_LANES)


def prefill_matmul_test_name(flags: str, dtype: str, subgroup_lanes: int | None = None, int8_x: bool = False,
                             quantizes_y: bool = False, token_tile: int = PREFILL_TOKEN_TILE, matrix: bool = False) -> str:
    prefix = "test_decode_matmul" if flags in TEST_DECODE_MATMULS else "test_prefill_matmul"
    tile = ("_smx" if matrix else "") + (f"_t{token_tile}" if token_tile != PREFILL_TOKEN_TILE else "")
    return (f"{prefix}_{flags}{f'_sg{subgroup_lanes}' if subgroup_lanes else ''}{'_xi8' * int8_x}{'_yi8' * quantizes_y}"
            f"{tile}_{DTYPE_TAGS[dtype]}")


def subgroup_builds_for_tests(shape: AttentionShape) -> tuple:
    """The subgroup builds the tests run for a shape: the exact build (4 lanes a row, so 16 dims a
    lane at head_dim 64) only up to head_dim 128 and 4 heads, where lavapipe compiles it in seconds
    (at head_dim 256 with 8 heads its 64 dims a lane for 2 head vectors took 2 minutes)."""
    return TEST_SUBGROUP_BUILDS if shape.head_dim <= 128 and shape.group <= 4 else TEST_SUBGROUP_BUILDS[:1]


def grid_shape(head_dim: int, group: int) -> AttentionShape:
    """The grid's shape of a (head_dim, group): one KV head (two for group 1, so heads share nothing)."""
    kv_heads = 2 if group == 1 else 1
    return AttentionShape(kv_heads, kv_heads * group, head_dim)


def test_matmul_spec(flags: str, dtype: str, subgroup_lanes: int | None = None, int8_x: bool = False,
                     quantizes_y: bool = False, token_tile: int = PREFILL_TOKEN_TILE, matrix: bool = False) -> MatmulSpec:
    decode = flags in TEST_DECODE_MATMULS
    out_features, in_features, residual, norm, swiglu = (TEST_DECODE_MATMULS if decode else TEST_PREFILL_MATMULS)[flags]
    return MatmulSpec(out_features, in_features, dtype, residual=residual, norm_eps=1e-5 if norm else None,
                      swiglu=swiglu, tiled=not decode, subgroup_lanes=subgroup_lanes, int8_x=int8_x,
                      quantizes_y=quantizes_y, token_tile=token_tile, matrix=matrix)


# The prefill matmuls' token tiles and subgroup-matrix builds the tests run, (token tile, matrix) by
# dtype: the subgroup-matrix builds (f16 only) run on the tests' adapter with their builtins emulated
# (tests/matrix_emulation.py).
TEST_PREFILL_TILES = {"float16": ((PREFILL_TOKEN_TILE, False), (SHORT_PREFILL_TOKENS, False),
                                  (PREFILL_TOKEN_TILE, True), (SHORT_PREFILL_TOKENS, True)),
                      "float32": ((PREFILL_TOKEN_TILE, False), (SHORT_PREFILL_TOKENS, False))}


TEST_QUANTIZING_MATMUL = "quad_norm_swiglu"  # 16 columns a workgroup: the int8_x build that quantizes y


# The quantizers the int8_x tests run (kernels.quantize_x): (dtype, normed, merged head_dim) -> name
TEST_QUANTIZERS = {(dtype, normed, merge): f"test_quantize_x{'_norm' * normed}{f'_merge_d{merge}' if merge else ''}"
                                           f"_{DTYPE_TAGS[dtype]}"
                   for dtype in DTYPES for normed, merge in ((False, None), (True, None), (False, 64))}


TEST_SYNTHETIC_SHAPES = ("llama_3_2_1b", "llama_3_1_8b")


def test_recipes() -> list[KernelRecipe]:
    """TVM's tiled kernel for every head_dim with GQA groups 1-8 (it is wrong for some: the build
    marks them), the sharded family on the test grid and the shapes of the RoPE, window and
    empty-sequence tests, prefill attention and matmuls, and the tiny test model's kernels."""
    recipes = [probe_recipe("stream_read_probe", "stream_read")]
    recipes += [attention_recipe(AttentionSpec("tiled", shape, dtype), "tiled") for shape, dtype in TEST_TILED_GRID]
    cases = [(grid_shape(d, g), dtype, False, layouts) for d, g, dtype, layouts in TEST_FAMILY_GRID] + [
        (shape, dtype, True, layouts) for shape, dtype, layouts in TEST_WINDOW_SHAPES]
    for shape, dtype, window, layouts in cases:
        recipes += attention_recipes(shape, dtype, window, layouts=layouts,
                                     build_params={"builds": subgroup_builds_for_tests(shape)})
    recipes += [prefill_attention_recipe for shape, dtype in TEST_PREFILL_ATTENTION
                for prefill_attention_recipe in prefill_attention_recipes(shape, dtype)]
    recipes += [matrix_prefill_attention_recipe(shape) for shape, _dtype in TEST_PREFILL_ATTENTION]  # every group
    for flags in [*TEST_PREFILL_MATMULS, *TEST_DECODE_MATMULS]:
        for dtype in DTYPES:
            builds = [(None, False, False, tile, matrix)  # (subgroup lanes, int8_x, quantizes_y, token tile, matrix)
                      for tile, matrix in (((PREFILL_TOKEN_TILE, False),) if flags in TEST_DECODE_MATMULS
                                           else TEST_PREFILL_TILES[dtype])]
            if flags in TEST_DECODE_MATMULS:
                builds += [(lanes, False, False, PREFILL_TOKEN_TILE, False) for lanes in TEST_MATMUL_SUBGROUP_LANES]
                builds += [(TEST_MATMUL_SUBGROUP_LANES[0], True, False, PREFILL_TOKEN_TILE, False)]
            if flags == TEST_QUANTIZING_MATMUL:
                builds.append((TEST_MATMUL_SUBGROUP_LANES[0], True, True, PREFILL_TOKEN_TILE, False))
            for build in builds:
                spec = test_matmul_spec(flags, dtype, *build)
                recipes.append(KernelRecipe(prefill_matmul_test_name(flags, dtype, *build), spec.builder,
                                            spec.args, {"kind": "test_matmul", "dtype": dtype}, spec.buffers,
                                            MAX_WORKGROUP_STORAGE if spec.matrix else WORKGROUP_STORAGE_BYTES,
                                            subgroups=build[0] is not None))
    for (dtype, normed, merge), name in TEST_QUANTIZERS.items():
        buffers = (SPLIT_WORKSPACE if merge else ("x",)) + ("norm",) * normed + QUANTIZED_X
        recipes.append(KernelRecipe(name, "quantize_x", (dtype, normed, merge), {"kind": "test_quantizer"}, buffers))
    # TVM's kernel with a window (test_tiled_with_inline_rope_and_window)
    recipes.append(attention_recipe(AttentionSpec("tiled", AttentionShape(1, 4, 128), "float32", True), "tiled"))
    # SmolLM2's shape in f32 with the 8-lane int8_x build (tests/test_llama_cpp_agreement.py, `make test-slow`)
    smollm2 = MODEL_CONFIGS["smollm2_135m"]
    recipes += attention_recipes(smollm2.attention_shape, "float32", layouts=("subgroup",),
                                 build_params={"builds": TEST_SUBGROUP_BUILDS[:1]})
    recipes += prefill_attention_recipes(smollm2.attention_shape, "float32")
    recipes += llama_recipes(smollm2, "float32", TEST_MATMUL_SUBGROUP_LANES[:1])
    for name, config in TEST_MODEL_CONFIGS.items():  # the native model tests' tiny model
        for dtype in DTYPES:
            recipes += attention_recipes(config.attention_shape, dtype)
            recipes += prefill_attention_recipes(config.attention_shape, dtype)
            recipes += llama_recipes(config, dtype, TEST_MATMUL_SUBGROUP_LANES[:1])
    # Llama 3's 1B and 8B shapes, one layer of each (tests/test_synthetic.py), and the fills
    for name in TEST_SYNTHETIC_SHAPES:
        config = SYNTHETIC_CONFIGS[name]
        recipes += attention_recipes(config.attention_shape, "float16", layouts=("subgroup",),
                                     build_params={"builds": TEST_SUBGROUP_BUILDS[:1]})
        recipes += prefill_attention_recipes(config.attention_shape, "float16")
        # the 1B's also with int8 codes of x (its gate/up quantizes down's x: tests/test_synthetic.py)
        recipes += llama_recipes(config, "float16", TEST_MATMUL_SUBGROUP_LANES[:1] if name == "llama_3_2_1b" else ())
    recipes += fill_recipes() + repack_recipes()
    unique = {r.name: r for r in recipes}
    return list(unique.values())
