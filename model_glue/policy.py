"""Every per-adapter runtime choice, in one place: the options' defaults, the builds a model loads,
and the kernels a pass runs.

Each rule says why in a line and names the constant it uses; the measurements behind the constants
are in docs/benchmarks.md. contract/ holds what the build and the runtime must agree on (kernel names,
compiled sizes, which kernels exist for a shape); this module only chooses among what the artifact has.
The rules read plain values (a device, a config, a request's booleans), never a model, so each can be
tested alone. No numpy and no TVM: the same code runs in Pyodide and natively.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from contract.attention import LAYOUTS, LAYOUTS_BY_NAME, MAX_SPLITS, NEST_CHOICES, AttentionChoice, LayoutChoice
from contract.kernels import (MATMUL_SUBGROUP_LANES, MATRIX_CONFIG, MATRIX_FRAGMENT, MATRIX_SUBGROUP,
                              SHORT_PREFILL_TOKENS, has_int8_x_form, has_matrix_builds, llama_kernels, matrix_roles,
                              o_merges_splits)
from contract.model import AttentionShape, LlamaConfig
from model_glue.errors import ModelError
from model_glue.gpu.webgpu import SUBGROUP_MATRIX

# -- the options' defaults: a GPU or a CPU rasterizer ---------------------------------------------------
# Prompt tokens per prefill pass: a GPU's prefill tiles fill its SMs only from a few thousand tokens on;
# a CPU rasterizer has no idle cores to fill, and smaller chunks keep the stop button responsive there.
GPU_PREFILL_CHUNK = 4096
CPU_PREFILL_CHUNK = 256
# Decode steps in flight: a GPU's must cover the round trip from a step's end to the host's next
# submission (mapAsync goes through the browser's GPU process); a CPU rasterizer's step is far longer
# than that round trip, and more steps in flight would only add work a stop throws away.
GPU_PIPELINE_DEPTH = 6
CPU_PIPELINE_DEPTH = 4
# Decode steps whose attention is timed per layer: one in this many (RunOptions.time_attention_every),
# so that timing costs the steps little on average. A timed layer drains the GPU around its attention
# whether its timestamps are written inside the step's pass or bracket a pass of its own.
ATTENTION_TIMING_EVERY = 16


def option_defaults(is_cpu: bool) -> dict:
    """RunOptions' per-adapter defaults. The folds (norm into matmul, SwiGLU into gate/up) and the
    warm-up run on GPUs only: on a CPU rasterizer a folded matmul costs more than the dispatches it
    saves, and a warm-up takes seconds."""
    return {"fold_norms": not is_cpu, "warm_up": not is_cpu,
            "prefill_chunk": CPU_PREFILL_CHUNK if is_cpu else GPU_PREFILL_CHUNK,
            "pipeline_depth": CPU_PIPELINE_DEPTH if is_cpu else GPU_PIPELINE_DEPTH,
            "time_attention_every": ATTENTION_TIMING_EVERY}


# -- the builds a model loads -------------------------------------------------------------------------
def pick_matmul_subgroup_lanes(library, config: LlamaConfig, dtype: str, device, wanted: bool | None) -> int | None:
    """The decode matmuls' subgroup build (MatmulSpec.subgroup_lanes) this device runs: the widest
    whose lanes fit the adapter's smallest subgroup (subgroups fill in invocation order, so such
    runs of lanes sit in one subgroup) and whose kernels the artifact has for this model; None if
    there is none or `wanted` is False. With `wanted` True, none is a ModelError saying why."""
    if wanted is False:
        return None
    smallest = device.subgroup_min_size if device is not None else None
    for lanes in MATMUL_SUBGROUP_LANES:
        if smallest and lanes <= smallest and all(
                spec.name in library.specs for spec in llama_kernels(config, dtype, lanes).values()):
            return lanes
    if wanted:
        raise ModelError("matmul_subgroups was asked for, but " + (
            "this adapter has no subgroups" if not smallest else
            f"the kernel artifact has no subgroup build of this model's decode matmuls that fits this adapter's "
            f"subgroups of {smallest} (one of {', '.join(str(n) for n in MATMUL_SUBGROUP_LANES if n <= smallest)} "
            "lanes)"))
    return None


# The int8_x decode matmuls by default only for models at least this wide: their quantizers (before o,
# and before down where gate/up cannot write its codes) add dispatches that the 1B shape's matmuls
# repay and SmolLM2's do not.
INT8_X_MIN_DIM = 2048


def pick_matmul_int8_x(library, config: LlamaConfig, dtype: str, lanes: int | None, wanted: bool | None,
                       device=None, fold_norms: bool = True) -> bool:
    """Whether the decode matmuls read int8 codes of x (MatmulSpec.int8_x): by default (`wanted`
    None) for models of INT8_X_MIN_DIM or wider, where the artifact has them beside the subgroup
    build `lanes` (the GPUs' path), the device's WGSL has dot4I8Packed and the norms are folded (the
    only roles built so); never with `wanted` False; with `wanted` True wherever all that holds, and
    not holding is a ModelError."""
    if wanted is False or (wanted is None and (config.dim < INT8_X_MIN_DIM or not has_int8_x_form(config.arch))):
        return False
    why_not = None
    if not has_int8_x_form(config.arch):
        why_not = f"the {config.family} family's layer has no int8_x build"
    elif lanes is None:
        why_not = "it runs only beside the decode matmuls' subgroup builds, which this adapter does not run"
    elif device is not None and not device.has_packed_int8_dot:
        why_not = "this browser's WGSL has no dot4I8Packed (packed_4x8_integer_dot_product)"
    elif not fold_norms:
        why_not = "it runs only with the norms folded into the matmuls (fold_norms)"
    elif not all(spec.name in library.specs for spec in llama_kernels(config, dtype, lanes, True).values()):
        why_not = f"the kernel artifact has no int8_x build of this model's decode matmuls for {lanes} lanes"
    if why_not is None:
        return True
    if wanted:
        raise ModelError(f"matmul_int8_x was asked for, but {why_not}")
    return False


def why_no_prefill_matrix(library, config: LlamaConfig, dtype: str, device, fold_norms: bool = True) -> str | None:
    """Why this device cannot run the model's prefill matmuls on subgroup matrices, or None if it can:
    it needs the feature and shader-f16, an f16 -> f32 16x16x16 shape, subgroups of exactly 32 (the kernels
    place their fragments by subgroup), builds in the model's dtype with the norms folded, in the artifact."""
    if device is None or SUBGROUP_MATRIX not in device.features:
        return f"this adapter has no subgroup matrices ({SUBGROUP_MATRIX})"
    if not device.has_f16:
        return "the matrix kernels multiply in f16 and this adapter has no shader-f16"
    if MATRIX_CONFIG not in device.subgroup_matrix_configs:
        offered = ", ".join(f"{a}->{r} {m}x{n}x{k}" for a, r, m, n, k in device.subgroup_matrix_configs) or "none"
        return (f"this adapter's subgroup matrices have no f16->f32 {MATRIX_FRAGMENT}x{MATRIX_FRAGMENT}x"
                f"{MATRIX_FRAGMENT} shape (it offers {offered})")
    if device.subgroup_min_size != MATRIX_SUBGROUP or device.subgroup_max_size != MATRIX_SUBGROUP:
        return (f"the matrix kernels need subgroups of exactly {MATRIX_SUBGROUP} invocations (this adapter's hold "
                f"{device.subgroup_min_size}-{device.subgroup_max_size})")
    if not has_matrix_builds(config, dtype):
        return f"this model's matrix kernels are built in float16 and it runs in {dtype}"
    if not fold_norms:
        return "the matrix kernels fold the norms into the matmuls (fold_norms)"
    missing = [spec.name for spec in matrix_roles(llama_kernels(config, dtype), config.arch).values() if spec.name not in library.specs]
    if missing:
        return f"the kernel artifact has no subgroup-matrix build of this model's prefill matmuls ({missing[0]}, ...)"
    return None


def pick_prefill_matrix(library, config: LlamaConfig, dtype: str, device, wanted: bool | None,
                        fold_norms: bool = True) -> bool:
    """Whether the model loads its prefill matmuls' subgroup-matrix builds: wherever they run
    (`why_no_prefill_matrix`), unless `wanted` is False; `wanted` True where they cannot is a ModelError."""
    if wanted is False:
        return False
    why_not = why_no_prefill_matrix(library, config, dtype, device, fold_norms)
    if why_not and wanted:
        raise ModelError(f"prefill_matrix was asked for, but {why_not}")
    return why_not is None


# -- a decode step's attention: the nest, then the layout and its splits -------------------------------
# Up to this many context tokens the tiled nest's low fixed cost wins; above it, sharded.
TILED_MAX_CONTEXT = 256


def pick_decode_nest(context_lens: list[int], override: str = "auto", tiled_defect: str | None = None) -> str:
    """'tiled' or 'sharded' for one decode step of a batch.

    A batch runs one kernel, chosen by its longest context: sharded as soon as any sequence holds
    more than TILED_MAX_CONTEXT tokens. The long sequence dominates the step's time and the
    sharded nest is correct for short sequences too, just not the fastest for them.
    `override` forces a nest ('tiled' / 'sharded') for comparisons.

    Where TVM's tiled kernel gives wrong output for the shape (`tiled_defect`: model_glue.model.attention),
    it never runs: `auto` always picks sharded and forcing tiled is an error.
    """
    if override not in NEST_CHOICES:
        raise ValueError(f"attention override must be one of {NEST_CHOICES}, got {override!r}")
    if tiled_defect is not None:
        if override == "tiled":
            raise ValueError(f"the tiled nest is not run for this shape: {tiled_defect}")
        return "sharded"
    if override != "auto":
        return override
    return "sharded" if max(context_lens, default=0) > TILED_MAX_CONTEXT else "tiled"


class LayoutRule(NamedTuple):
    """Where the rule ranks a layout (contract.attention.LAYOUTS) and how it splits the context."""

    gpu_rank: int | None  # the rule on GPUs takes the lowest rank this device runs; None: only when forced
    cpu_rank: int | None  # the same on CPU rasterizers (one split there)
    # The split rule on GPUs: S doubles (powers of two) while some tier (most workgroups, fewest K/V
    # rows a split, fewest K/V elements a split: rows x head_dim) admits it.
    split_tiers: tuple[tuple[int, int, int], ...] = ()


# From sweeps on an H200 and on lavapipe ("Choosing S" in docs/benchmarks.md). A split pays while the
# GPU has idle SMs and costs a merge. "subgroup" reads each K/V row once per GQA group and wins wherever
# its subgroups fit: up to 128 workgroups while a split keeps 128 rows, and on to 256 while a split keeps
# 512 rows and 65,536 K/V elements. Without subgroups, "shards" on GPUs; a CPU rasterizer has no idle SMs
# to fill and prefers a whole GQA group per workgroup ("shards_group": a K/V row read once per group).
LAYOUT_RULES = {
    "subgroup": LayoutRule(gpu_rank=0, cpu_rank=0, split_tiers=((128, 128, 0), (256, 512, 65536))),
    "shards": LayoutRule(gpu_rank=1, cpu_rank=2, split_tiers=((128, 64, 0),)),
    "shards_group": LayoutRule(gpu_rank=None, cpu_rank=1, split_tiers=((128, 64, 0),)),
}


def layout_rank(layout: str, is_cpu: bool) -> int | None:
    """A layout's rank on this kind of adapter (None: it runs only when forced)."""
    rule = LAYOUT_RULES[layout]
    return rule.cpu_rank if is_cpu else rule.gpu_rank


def pick_subgroup_build(builds, subgroup_min_size: int | None, subgroup_max_size: int | None):
    """Of a subgroup layout's builds, (row_lanes, exact subgroup size or None) each, the one this
    device runs best, or None. A build for an exact size needs subgroups of exactly that size
    (min == max); a relative build needs a row's lanes to fit the smallest subgroup
    (kernels.decode_attention_subgroup), and the widest such build wins."""
    exact = [b for b in builds if b[1] and subgroup_min_size == subgroup_max_size == b[1]]
    relative = [b for b in builds if not b[1] and subgroup_min_size and b[0] <= subgroup_min_size]
    return max(exact or relative, default=None)


def _splits(workgroups_per_split: int, longest: int, head_dim: int, max_splits: int, tiers) -> int:
    """The largest power of two S (<= max_splits) that some tier (most workgroups, fewest rows a
    split, fewest K/V elements a split) admits."""
    def admits(splits, most, rows, elements):
        split_rows = longest // splits
        return splits * workgroups_per_split <= most and split_rows >= rows and split_rows * head_dim >= elements

    splits = 1
    while 2 * splits <= max_splits and any(admits(2 * splits, *tier) for tier in tiers):
        splits *= 2
    return splits


def pick_layout(context_lens: list[int], shape: AttentionShape, *, available: Collection[str], is_cpu: bool,
                max_rows: int = MAX_SPLITS, forced: LayoutChoice | None = None) -> AttentionChoice:
    """The sharded nest's layout and split count S for one step of a batch (whose longest context
    is above the tiled nest's range).

    `available`: the layouts that run this shape on this device (AttentionKernels.layouts; required,
    so that no caller picks a kernel the artifact or the device refused); `max_rows` bounds batch * S
    (the workspace's size); `forced` holds the choice to a layout and S. The rule: the available
    layout of lowest rank (`LAYOUT_RULES`); on GPUs, S from the layout's split tiers; a CPU
    rasterizer has no idle SMs to fill and runs one split.
    """
    if forced is not None:
        if forced.layout not in available:
            raise ValueError(f"the {forced.layout!r} layout does not run this shape here")
        return AttentionChoice("sharded", forced.layout, min(forced.num_splits, max(max_rows // max(len(context_lens), 1), 1)))
    ranked = sorted((rank, layout.name) for layout in LAYOUTS if layout.name in available
                    for rank in [layout_rank(layout.name, is_cpu)] if rank is not None)
    if not ranked:
        raise ValueError(f"no layout of the sharded family runs {shape} here (available: {sorted(available)})")
    layout = LAYOUTS_BY_NAME[ranked[0][1]]
    if is_cpu:
        return AttentionChoice("sharded", layout.name, 1)
    batch = max(len(context_lens), 1)
    heads = shape.num_kv_heads if layout.group_per_workgroup else shape.num_qo_heads
    max_splits = min(MAX_SPLITS, max(max_rows // batch, 1))
    return AttentionChoice("sharded", layout.name, _splits(batch * heads, max(context_lens, default=0), shape.head_dim,
                                                           max_splits, LAYOUT_RULES[layout.name].split_tiers))


def choose_decode_attention(context_lens: list[int], kernels, *, is_cpu: bool, attention: str = "auto",
                            forced: LayoutChoice | None = None, max_rows: int = MAX_SPLITS) -> AttentionChoice:
    """One decode step's attention over the artifact's kernels for the shape
    (model_glue.model.attention.AttentionKernels): the nest (`attention`: "auto", or forced "tiled" /
    "sharded"), then for the sharded nest its layout and S on this device."""
    nest = pick_decode_nest(context_lens, attention, kernels.tiled_defect)
    if nest == "tiled":
        return AttentionChoice("tiled")
    return pick_layout(context_lens, kernels.shape, available=kernels.layouts, is_cpu=is_cpu, max_rows=max_rows,
                       forced=forced)


# -- a pass's kernels ------------------------------------------------------------------------------------
# A prefill pass of at most this many tokens runs its attention with the decode kernels, a batch of its
# tokens each over its own prefix: a follow-up turn's few rows would give the causal prefill kernel one
# workgroup a KV head, walking the cached context serially.
DECODE_BATCH_MAX_TOKENS = 64
# The longest prefill pass whose matmuls run the short token tile: one tile for the scalar builds, where
# two short tiles cost more than one long one; two for the matrix builds, which few workgroups bound on a
# short pass.
SHORT_TILE_MAX_TOKENS = SHORT_PREFILL_TOKENS
MATRIX_SHORT_TILE_MAX_TOKENS = 2 * SHORT_PREFILL_TOKENS


def short_token_tile(n: int, matrix: bool) -> bool:
    """Whether a prefill pass of n tokens runs its matmuls' short token tile (`matrix`: their
    subgroup-matrix builds)."""
    return n <= (MATRIX_SHORT_TILE_MAX_TOKENS if matrix else SHORT_TILE_MAX_TOKENS)


def merges_in_o(config: LlamaConfig, dtype: str, choice: AttentionChoice, merge_in_o: bool | None) -> bool:
    """Whether a split decode call's partial states merge inside the o-projection rather than in the
    merge dispatch (where the shape has that kernel and no int8 quantizer merges them: the caller's
    checks): RunOptions.merge_in_o True or False decides; by default while the o workgroups' reads of
    the states stay small beside a dispatch (contract.kernels.o_merges_splits, which the build uses too)."""
    if not choice.split or merge_in_o is False:
        return False
    return merge_in_o or o_merges_splits(config, dtype, choice.num_splits)
