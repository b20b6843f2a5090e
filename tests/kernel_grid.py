"""The tests' kernel grid: what the tests' artifact holds (`python -m app build --set tests`, built into
build/test-kernels; `grid_recipes`) and the names the tests look those kernels up by. Never served.

Not a test module (pytest collects test_*.py only): the tests import it as `kernel_grid`, the CLI's
build as `tests.kernel_grid`.
"""

from __future__ import annotations

from contract.attention import LAYOUT_NAMES
from contract.kernels import (PREFILL_TOKEN_TILE, QUANTIZED_X, SERVED_MATMUL_SUBGROUP_LANES, SHORT_PREFILL_TOKENS,
                              SPLIT_WORKSPACE, WORKGROUP_STORAGE_BYTES, AttentionSpec, MatmulSpec)
from contract.model import (DTYPE_TAGS, DTYPES, MODEL_CONFIGS, SYNTHETIC_CONFIGS, TEST_MODEL_CONFIGS,
                            AttentionShape, all_wide)
from kernels.catalog import (KernelRecipe, attention_recipe, attention_recipes, fill_recipes, llama_recipes,
                             matrix_prefill_attention_recipe, model_dtypes, prefill_attention_recipes, probe_recipe,
                             repack_recipes)
from kernels.prefill_attention import prefill_layout
from kernels.wgsl import MAX_WORKGROUP_STORAGE

# Decode attention (tests/test_decode_attention.py): the family runs on a grid of (head_dim, GQA group,
# dtype) that gives every head_dim both dtypes and every head-vector layout of the subgroup builds (1,
# 2, 3-4 and 8 heads) a shape; the RoPE, empty-sequence and unused-slot tests reuse its f32 shapes, the
# window tests have shapes of their own. The subgroup layout runs as the relative build of 8 lanes
# per row, and the exact build of 4 lanes per row for subgroups of exactly 8: the subgroup size of the
# CPU adapter the tests run on (lavapipe on 256-bit vectors). Lavapipe compiles each kernel at its
# first dispatch, 10-25 s for the largest on a machine without Mesa's shader cache, so the grid is kept
# to what covers each code path: both dtypes per head_dim (head_dim 256 f16 through the window test),
# head vectors of 1, 2, 3 and 8 heads, two results per thread (head_dim 256 with 8 heads), the exact
# build's shuffle pre-merge.
TEST_SUBGROUP_BUILDS = ((8, None), (4, 8))
# The shards layouts (the fallback without subgroups) compile slowest, so they run on fewer shapes:
# both row paths (head_dim 64: a lane per dim; 128 and 256: dims split over threadIdx.y), both
# dtypes, groups 3 and 8, a window at head_dim 64 (shards_group) and at Gemma 3's head_dim 256
# (every layout, both dtypes).
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
# Gemma 3's attention shape (1 KV head, 4 query heads, head_dim 256, most layers a sliding window):
# every layout, both dtypes.
GEMMA3_SHAPE = AttentionShape(1, 4, 256)
TEST_WINDOW_SHAPES = [(AttentionShape(1, 4, 64), "float32", ("shards_group", "subgroup")),
                      (GEMMA3_SHAPE, "float16", ALL_LAYOUTS), (GEMMA3_SHAPE, "float32", ALL_LAYOUTS)]


# Prefill attention on GQA groups 1, 3, 4 and 8 at head_dim 64 and groups 1 and 8 at 128 (lavapipe
# compiles head_dim 128 slowly), the dtypes alternating so that each head_dim has both, and Gemma 3's
# shape (head_dim 256: a row's dims split over two threads) in both; the tiled prefill matmul with
# each fold on a small shape, both dtypes (tests/test_prefill_kernels.py).
TEST_PREFILL_ATTENTION = [(AttentionShape(2 if group == 1 else 1, (2 if group == 1 else 1) * group, d), DTYPES[i % 2])
                          for d, groups in ((64, (1, 3, 4, 8)), (128, (1, 8))) for i, group in enumerate(groups)] + [
    (GEMMA3_SHAPE, dtype) for dtype in DTYPES]
# the matrix attention in f32 (an f32-only family's: f16 fragments of f32 q, K and V), at a cheap head_dim
TEST_MATRIX_ATTENTION_F32 = AttentionShape(1, 4, 64)
TEST_PREFILL_MATMULS = {  # name: (out_features, in_features, residual, norm, swiglu)
    "plain": (128, 256, False, False, False), "residual": (192, 128, True, False, False),
    "norm": (320, 96, False, True, False), "norm_swiglu": (256, 160, False, True, True)}


# The decode matmul (kernels.decode_matmul.quantized_matmul) on the Llama shapes' row widths, with one, two and
# four weight rows a thread (contract.kernels.MatmulSpec.rows_per_thread: two where enough rows remain
# for PAIRED_MIN_WORKGROUPS workgroups, four for QUAD_MIN_WORKGROUPS; SwiGLU's gate and up rows in one
# thread), named by it.
TEST_DECODE_MATMULS = {"paired_norm_swiglu": (2048, 2048, False, True, True), "long_residual": (40, 4096, True, False, False),
                       "paired_norm_residual": (6144, 256, True, True, False), "quad_norm_swiglu": (16384, 128, False, True, True),
                       "quad_residual": (16384, 96, True, False, False),
                       # x of 288 chunks: a quantizes_x prologue's second turn part-full
                       "long_norm": (64, 4608, False, True, False)}


# Grid matmuls also on Q8A weights (a GGUF's 5- to 8-bit matrices: contract.model), named with this suffix.
Q8A_SUFFIX = "_q8a"
TEST_PREFILL_MATMULS.update({f"{flags}{Q8A_SUFFIX}": TEST_PREFILL_MATMULS[flags] for flags in ("residual", "norm_swiglu")})
TEST_DECODE_MATMULS.update({f"{flags}{Q8A_SUFFIX}": TEST_DECODE_MATMULS[flags]
                            for flags in ("paired_norm_swiglu", "quad_residual")})


def grid_weights(flags: str) -> str:
    """The weight format of a grid matmul: q8a where its name says so, else q4."""
    return "q8a" if flags.endswith(Q8A_SUFFIX) else "q4"


# The decode matmuls' subgroup builds the tests run (MatmulSpec.subgroup_lanes), each where the
# adapter's subgroups hold it: 8 lanes, the subgroup size of lavapipe on a 256-bit CPU (the tiny test
# model runs it too), and the served artifact's 32 (GPUs: the H200).
TEST_MATMUL_SUBGROUP_LANES = (8, SERVED_MATMUL_SUBGROUP_LANES)


def grid_matmul_name(flags: str, dtype: str, subgroup_lanes: int | None = None, int8_x: bool = False,
                     quantizes_y: bool = False, token_tile: int = PREFILL_TOKEN_TILE, matrix: bool = False,
                     quantizes_x: bool = False) -> str:
    prefix = "test_decode_matmul" if flags in TEST_DECODE_MATMULS else "test_prefill_matmul"
    tile = ("_smx" if matrix else "") + (f"_t{token_tile}" if token_tile != PREFILL_TOKEN_TILE else "")
    return (f"{prefix}_{flags}{f'_sg{subgroup_lanes}' if subgroup_lanes else ''}{'_xi8' * int8_x}{'_xq' * quantizes_x}"
            f"{'_yi8' * quantizes_y}{tile}_{DTYPE_TAGS[dtype]}")


def subgroup_builds_for_tests(shape: AttentionShape) -> tuple:
    """The subgroup builds the tests run for a shape: the exact build (4 lanes a row, so 16 dims a
    lane at head_dim 64) only up to head_dim 128 and 4 heads, where lavapipe compiles it in seconds
    (at head_dim 256 with 8 heads its 64 dims a lane for 2 head vectors took 2 minutes)."""
    return TEST_SUBGROUP_BUILDS if shape.head_dim <= 128 and shape.group <= 4 else TEST_SUBGROUP_BUILDS[:1]


def grid_shape(head_dim: int, group: int) -> AttentionShape:
    """The grid's shape of a (head_dim, group): one KV head (two for group 1, so heads share nothing)."""
    kv_heads = 2 if group == 1 else 1
    return AttentionShape(kv_heads, kv_heads * group, head_dim)


def grid_matmul_spec(flags: str, dtype: str, subgroup_lanes: int | None = None, int8_x: bool = False,
                     quantizes_y: bool = False, token_tile: int = PREFILL_TOKEN_TILE, matrix: bool = False,
                     quantizes_x: bool = False) -> MatmulSpec:
    decode = flags in TEST_DECODE_MATMULS
    out_features, in_features, residual, norm, swiglu = (TEST_DECODE_MATMULS if decode else TEST_PREFILL_MATMULS)[flags]
    return MatmulSpec(out_features, in_features, dtype, grid_weights(flags), residual=residual,
                      norm_eps=1e-5 if norm else None,
                      glu="silu" if swiglu else None, tiled=not decode, subgroup_lanes=subgroup_lanes, int8_x=int8_x,
                      quantizes_y=quantizes_y, token_tile=token_tile, matrix=matrix, quantizes_x=quantizes_x)


# The prefill matmuls' token tiles and subgroup-matrix builds the tests run, (token tile, matrix) by
# dtype: the subgroup-matrix builds (f16 only) run on the tests' adapter with their builtins emulated
# (tests/matrix_emulation.py).
TEST_PREFILL_TILES = {"float16": ((PREFILL_TOKEN_TILE, False), (SHORT_PREFILL_TOKENS, False),
                                  (PREFILL_TOKEN_TILE, True), (SHORT_PREFILL_TOKENS, True)),
                      # an f32-only family's matrix builds: the short tile only (the emulated long one compiles slowly)
                      "float32": ((PREFILL_TOKEN_TILE, False), (SHORT_PREFILL_TOKENS, False), (SHORT_PREFILL_TOKENS, True))}


TEST_QUANTIZING_MATMUL = "quad_norm_swiglu"  # 16 columns a workgroup: the int8_x build that quantizes y
# The normed grid matmuls, each also built to quantize its x in its prologue (MatmulSpec.quantizes_x)
TEST_PROLOGUE_MATMULS = tuple(flags for flags, (_, _, _, norm, _) in TEST_DECODE_MATMULS.items() if norm)


# The quantizers the int8_x tests run (kernels.quantize_x): (dtype, normed, merged head_dim) -> name
TEST_QUANTIZERS = {(dtype, normed, merge): f"test_quantize_x{'_norm' * normed}{f'_merge_d{merge}' if merge else ''}"
                                           f"_{DTYPE_TAGS[dtype]}"
                   for dtype in DTYPES for normed, merge in ((False, None), (True, None), (False, 64))}


TEST_SYNTHETIC_SHAPES = ("llama_3_2_1b", "llama_3_1_8b")


def grid_prefill_attention_recipe(shape: AttentionShape, dtype: str) -> KernelRecipe:
    """The scalar prefill attention of a grid shape (what kernels.catalog.prefill_attention_recipes
    builds, but at every head_dim the kernel takes, 256 included)."""
    return attention_recipe(AttentionSpec("prefill", shape, dtype), "prefill_attention",
                            prefill_layout(shape.head_dim, dtype))


def grid_recipes() -> list[KernelRecipe]:
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
    recipes += [grid_prefill_attention_recipe(shape, dtype) for shape, dtype in TEST_PREFILL_ATTENTION]
    recipes += [matrix_prefill_attention_recipe(shape) for shape, _dtype in TEST_PREFILL_ATTENTION]  # every group
    recipes.append(matrix_prefill_attention_recipe(TEST_MATRIX_ATTENTION_F32, "float32"))
    for flags in [*TEST_PREFILL_MATMULS, *TEST_DECODE_MATMULS]:
        for dtype in DTYPES:
            # (subgroup lanes, int8_x, quantizes_y, token tile, matrix, quantizes_x)
            builds = [(None, False, False, tile, matrix, False)
                      for tile, matrix in (((PREFILL_TOKEN_TILE, False),) if flags in TEST_DECODE_MATMULS
                                           else TEST_PREFILL_TILES[dtype])]
            if flags in TEST_DECODE_MATMULS:
                builds += [(lanes, False, False, PREFILL_TOKEN_TILE, False, False) for lanes in TEST_MATMUL_SUBGROUP_LANES]
                builds += [(TEST_MATMUL_SUBGROUP_LANES[0], True, False, PREFILL_TOKEN_TILE, False, False)]
            if flags == TEST_QUANTIZING_MATMUL:
                builds.append((TEST_MATMUL_SUBGROUP_LANES[0], True, True, PREFILL_TOKEN_TILE, False, False))
            if flags in TEST_PROLOGUE_MATMULS:
                builds.append((TEST_MATMUL_SUBGROUP_LANES[0], True, False, PREFILL_TOKEN_TILE, False, True))
            for build in builds:
                spec = grid_matmul_spec(flags, dtype, *build)
                recipes.append(KernelRecipe(grid_matmul_name(flags, dtype, *build), spec.builder,
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
    for name, config in TEST_MODEL_CONFIGS.items():  # the native model tests' tiny models
        for dtype in model_dtypes(config):
            recipes += attention_recipes(config.attention_shape, dtype)
            if config.sliding_window is not None:
                recipes += attention_recipes(config.attention_shape, dtype, sliding_window=True)
            recipes += prefill_attention_recipes(config.attention_shape, dtype)
            if not config.arch.f16_activations:  # an f32-only family's attention on subgroup matrices
                recipes.append(matrix_prefill_attention_recipe(config.attention_shape, dtype))
            for weights in (config, all_wide(config)):  # Q8A matrices: tests/test_gguf_model.py
                recipes += llama_recipes(weights, dtype, TEST_MATMUL_SUBGROUP_LANES[:1])
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
