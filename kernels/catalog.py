"""Which kernels the artifacts hold. Every kernel comes from a typed spec of contract.kernels
(`AttentionSpec`, `MatmulSpec`, `KernelRole`): its name and the buffers the runtime binds are the
spec's, and the build fails unless the kernel declares exactly those buffers.

The served artifact (`all_recipes`): decode attention for each shape the benchmark and the served
models use, f16 for adapters with shader-f16 and f32 for the others (e.g. Chromium's SwiftShader):
TVM's tiled nest and every layout of the sharded family (contract.attention.LAYOUTS), each over the whole context and split,
plus the merge and the prefill kernel; and every served model's kernels, named by what they are
compiled for (row widths, head_dim: contract.kernels.llama_kernels), so shapes that share a width
share a kernel and the runtime gives the rest as values. The tests' artifact (`python -m app build
--set tests`) holds what only the tests run, a grid of shapes and the tiny test model's kernels, built
from these recipes by tests/kernel_grid.py (`grid_recipes`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from contract.attention import LAYOUT_NAMES, LAYOUTS, LAYOUTS_BY_NAME, MATRIX_PREFILL, Layout
from contract.kernels import (MATRIX_FRAGMENT, SERVED_MATMUL_SUBGROUP_LANES, TILED_WORKGROUP_STORAGE_BYTES,
                              WORKGROUP_STORAGE_BYTES, AttentionSpec, has_int8_x_form, has_matrix_builds,
                              llama_kernels)
from contract.model import (BENCH_SHAPES, DTYPES, MODEL_CONFIGS, MODEL_SHAPES, SYNTHETIC_CONFIGS, SYNTHETIC_DTYPES,
                            AttentionShape, LlamaConfig, all_wide)
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
    "rope_and_append": layer_ops.rope_and_append, "rope_heads_and_append": layer_ops.rope_heads_and_append,
    "swiglu": layer_ops.swiglu,
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
    recipes = [attention_recipe(AttentionSpec("prefill", shape, dtype), "prefill_attention",
                                prefill_layout(shape.head_dim, dtype))]
    if dtype == "float16" and shape.head_dim % MATRIX_FRAGMENT == 0:
        recipes.append(matrix_prefill_attention_recipe(shape))
    return recipes


def matrix_prefill_attention_recipe(shape: AttentionShape, dtype: str = "float16") -> KernelRecipe:
    """The causal prefill attention of one shape on subgroup matrices (WGSL; f16 products whatever `dtype`)."""
    return attention_recipe(AttentionSpec("prefill", shape, dtype, tag=MATRIX_PREFILL), "prefill_attention_matrix",
                            {"build": MATRIX_PREFILL})


def llama_recipes(c: LlamaConfig, dtype: str, subgroup_lanes: tuple = ()) -> list[KernelRecipe]:
    """Every non-attention kernel of one model config, named by what it is compiled for
    (contract.kernels.llama_kernels): configs that share a row width, a head_dim or a model width
    share those kernels, and the runtime finds them by name. The decode matmuls also in each
    subgroup build of `subgroup_lanes` (MatmulSpec.subgroup_lanes), with and without int8 codes of
    x (MatmulSpec.int8_x: only beside subgroups, the GPUs' path). In f16 the folded prefill matmuls
    also have their subgroup-matrix builds (MatmulSpec.matrix, WGSL: kernels.prefill_matmul_matrix), as in
    f32 do a float32-only family's (`has_matrix_builds`)."""
    recipes = {}
    int8_forms = (False, True) if has_int8_x_form(c.arch) else (False,)
    for lanes, int8_x in [(None, False)] + [(lanes, int8_x) for lanes in subgroup_lanes for int8_x in int8_forms]:
        for role, spec in llama_kernels(c, dtype, lanes, int8_x, prefill_matrix=has_matrix_builds(c, dtype)).items():
            matrix = getattr(spec, "matrix", False)
            recipes[spec.name] = KernelRecipe(spec.name, spec.builder, spec.args,
                                              {"kind": "llama", "role": role, "dtype": dtype}, spec.buffers,
                                              MAX_WORKGROUP_STORAGE if matrix else WORKGROUP_STORAGE_BYTES,
                                              subgroups=getattr(spec, "subgroup_lanes", None) is not None)
    return list(recipes.values())


def model_dtypes(c: LlamaConfig) -> tuple[str, ...]:
    """The dtypes a model's kernels are built in: f32 only for a family whose activations overflow f16."""
    return DTYPES if c.arch.f16_activations else ("float32",)


def all_recipes() -> list[KernelRecipe]:
    """The served artifact: the probes, decode attention for the benchmark's and the models' shapes,
    and every model's kernels."""
    recipes = [probe_recipe("row_sum_probe", "row_sum_probe"), probe_recipe("stream_read_probe", "stream_read")]
    for shape in BENCH_SHAPES + MODEL_SHAPES:
        for dtype in DTYPES:
            recipes += attention_recipes(shape, dtype)
            recipes += prefill_attention_recipes(shape, dtype)
    for config in MODEL_CONFIGS.values():  # the decode nests over a window, for models with sliding-window layers
        if config.sliding_window is not None:
            for dtype in model_dtypes(config):
                recipes += attention_recipes(config.attention_shape, dtype, sliding_window=True)
        if not config.arch.f16_activations:  # its prefill attention on subgroup matrices, in f32
            recipes.append(matrix_prefill_attention_recipe(config.attention_shape, "float32"))
    for name, config in MODEL_CONFIGS.items():  # each also with Q8A matrices (a GGUF wider than 4 bits)
        for dtype in model_dtypes(config):
            for weights in (config, all_wide(config)):
                recipes += llama_recipes(weights, dtype, (SERVED_MATMUL_SUBGROUP_LANES,))
    served_shapes = set(BENCH_SHAPES + MODEL_SHAPES)
    for name, config in SYNTHETIC_CONFIGS.items():
        for dtype in SYNTHETIC_DTYPES:
            for weights in (config, all_wide(config)):
                recipes += llama_recipes(weights, dtype, (SERVED_MATMUL_SUBGROUP_LANES,))
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
