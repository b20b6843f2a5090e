"""Decode attention on the host side: which kernels run, and how one call is assembled.

`resolve_attention_kernels` says which of the artifact's attention kernels run a shape on this
device (the tiled nest, its defect if any, the merge, prefill, and per layout of contract.attention
the build this device runs). `choose_decode_attention` makes a step's choice from it:
`pick_decode_nest` (tiled or sharded), then `pick_layout` (which layout and how many splits).
`attention_call` names a call's buffers and values. Loading, the model, the kernel lab, the
benchmarks and the tests all go through these.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Collection

from contract.artifacts import KernelSpec
from contract.attention import (LAYOUTS, LAYOUTS_BY_NAME, MATRIX_PREFILL, MAX_SPLITS, NEST_CHOICES, AttentionChoice,
                                Layout, LayoutChoice)
from contract.kernels import ATTENTION_BUFFERS, PAGE_SIZE, SPLIT_WORKSPACE, AttentionSpec
from contract.model import AttentionShape

# Up to this many context tokens the tiled nest's low fixed cost wins; above it, sharded.
TILED_MAX_CONTEXT = 256


def attention_call(*, q, pages, page_table_indptr, page_table_values, length_info, k_rope_pos_offset,
                   q_rope_position, output, lse, batch: int, nnz_pages: int, max_num_pages: int,
                   sm_scale: float, rotary_mode: int = 0, rope_scale: float = 1.0,
                   rope_theta: float = 1e4, workspace: dict | None = None, num_splits: int = 1) -> tuple[dict, dict]:
    """The buffers (by the kernels' names) and scalar values of one paged decode-attention call.

    Every kernel takes TVM's batch_decode_paged_kv arguments; a split kernel writes the `workspace`
    buffers (SPLIT_WORKSPACE, sized by `split_workspace_bytes`) instead of output and lse, and the
    merge reads them. The buffers can be anything the caller binds (GPU buffers, numpy arrays,
    base64 strings); `rotary_mode=1` applies RoPE inline (the model applies it when appending K: 0).
    """
    buffers = dict(zip(ATTENTION_BUFFERS, (q, pages, page_table_indptr, page_table_values, length_info,
                                            k_rope_pos_offset, q_rope_position, output, lse)))
    buffers.update(workspace or {})
    values = {"B": batch, "nnz_pages": nnz_pages, "max_num_pages": max_num_pages, "rotary_mode": rotary_mode,
              "rope_scale": rope_scale, "rope_theta": rope_theta, "sm_scale": sm_scale, "num_splits": num_splits}
    return buffers, values


def attention_dispatches(kernels: list, buffers: dict, values: dict) -> list[tuple]:
    """(kernel, its buffers, values) for each dispatch of a call: one kernel, or a split kernel
    and the merge. Each kernel gets exactly the buffers it declares."""
    return [(kernel, {name: buffers[name] for name in kernel.buffer_names}, values) for kernel in kernels]


def context_length(num_pages: int, last_page_len: int, page_size: int = PAGE_SIZE) -> int:
    """Tokens of one sequence's context from its page count and last page's fill."""
    if num_pages == 0:
        return 0
    return (num_pages - 1) * page_size + last_page_len


def tiled_defect(tiled_spec: KernelSpec) -> str | None:
    """Why TVM's tiled kernel must not run for this shape, or None when it is correct.

    The build reads from TVM's lowered launch how many query heads of each KV head the kernel
    computes; for some GQA groups it is fewer than the group (head_dim 256 with groups 5 or 7,
    head_dim 128 with 9 or 11: the last heads of every group are never written), and the build
    records that in the kernel's manifest entry as `defect`.
    """
    return tiled_spec.meta.get("defect")


# A prefill pass of at most this many tokens runs its attention with the decode kernels, a batch of
# its tokens each over its own prefix (LlamaModel.prefill_attention): a follow-up turn's few rows
# would give the causal prefill kernel one workgroup a KV head, walking the cached context serially.
DECODE_BATCH_MAX_TOKENS = 64


def pick_decode_nest(context_lens: list[int], override: str = "auto", tiled_defect: str | None = None) -> str:
    """'tiled' or 'sharded' for one decode step of a batch.

    A batch runs one kernel, chosen by its longest context: sharded as soon as any sequence holds
    more than TILED_MAX_CONTEXT tokens. The long sequence dominates the step's time and the
    sharded nest is correct for short sequences too, just not the fastest for them.
    `override` forces a nest ('tiled' / 'sharded') for comparisons.

    Where TVM's tiled kernel gives wrong output for the shape (`tiled_defect`, see above), it never
    runs: `auto` always picks sharded and forcing tiled is an error.
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


# -- which kernels run a shape on this device ------------------------------------------------------------
def split_workspace_bytes(max_rows: int, shape: AttentionShape) -> dict[str, int]:
    """Bytes of the split workspace for every call with batch * num_splits <= max_rows."""
    rows = max_rows * shape.num_qo_heads
    return dict(zip(SPLIT_WORKSPACE, (rows * shape.head_dim * 4, rows * 2 * 4)))


def pick_subgroup_build(builds, subgroup_min_size: int | None, subgroup_max_size: int | None):
    """Of a subgroup layout's builds, (row_lanes, exact subgroup size or None) each, the one this
    device runs best, or None. A build for an exact size needs subgroups of exactly that size
    (min == max); a relative build needs a row's lanes to fit the smallest subgroup
    (kernels.decode_attention_subgroup), and the widest such build wins."""
    exact = [b for b in builds if b[1] and subgroup_min_size == subgroup_max_size == b[1]]
    relative = [b for b in builds if not b[1] and subgroup_min_size and b[0] <= subgroup_min_size]
    return max(exact or relative, default=None)


@dataclass(frozen=True)
class LayoutKernels:
    """One build of a layout for a shape: its whole-context and split kernels (artifact names)."""

    layout: Layout
    build: str  # the manifest's label of the build, e.g. "subgroup_l8s32" or "shards"
    whole: str
    split: str


@dataclass(frozen=True)
class AttentionKernels:
    """The artifact's attention kernels that run one shape and dtype on one device."""

    shape: AttentionShape
    dtype: str
    tiled: str
    tiled_defect: str | None  # why TVM's tiled kernel must not run for this shape (see `tiled_defect`)
    merge: str
    prefill: str | None  # the causal prefill kernel (None: the artifact has none for the shape)
    prefill_matrix: str | None  # its build on subgroup matrices (None: the artifact has none)
    layouts: dict[str, LayoutKernels]  # layout name -> the build this device runs, for each it can
    unavailable: dict[str, str]  # layout name -> why it does not run here

    def kernel_names(self, choice: AttentionChoice) -> list[str]:
        """The kernels of one call, in dispatch order: one kernel, or a layout's split kernel and the merge."""
        if choice.nest == "prefill":
            kernel = self.prefill_matrix if choice.layout == MATRIX_PREFILL else self.prefill
            if kernel is None:
                raise LookupError(f"the kernel artifact has no {choice} attention for {self.shape}")
            return [kernel]
        if choice.nest == "tiled":
            return [self.tiled]
        kernels = self.layouts.get(choice.layout)
        if kernels is None:
            raise ValueError(self._why_not(choice.layout))
        return [kernels.split, self.merge] if choice.split else [kernels.whole]

    def check(self, forced: LayoutChoice) -> None:
        """A ValueError saying why a forced layout cannot run here, if it cannot."""
        if forced.layout not in self.layouts:
            raise ValueError(self._why_not(forced.layout))

    def _why_not(self, layout: str) -> str:
        return f"the {layout!r} layout does not run here: {self.unavailable.get(layout, 'no such layout')}"


def runnable_builds(library, shape: AttentionShape, dtype: str, device, *, sweep: bool = False) -> list[LayoutKernels]:
    """Every build of every layout the artifact holds for the shape (without a window) that this
    device can run; `sweep` adds the benchmark sweep's builds (`python -m app build --set sweep`)."""
    found = []
    for name in library.names(kind="decode_attention", nest="sharded", split=False, dtype=dtype, sliding_window=False,
                              head_dim=shape.head_dim, num_kv_heads=shape.num_kv_heads, num_qo_heads=shape.num_qo_heads):
        meta = library.specs[name].meta
        layout = LAYOUTS_BY_NAME.get(meta["layout"])
        if layout is None or (meta.get("sweep") and not sweep):
            continue
        if layout.needs_subgroups and pick_subgroup_build([(meta["row_lanes"], meta["subgroup_size"])],
                                                          device.subgroup_min_size, device.subgroup_max_size) is None:
            continue  # this device's subgroups do not fit the build
        split = next((n for n in library.names(kind="decode_attention", split=True, build=meta["build"], dtype=dtype,
                                               sliding_window=False, head_dim=shape.head_dim,
                                               num_kv_heads=shape.num_kv_heads, num_qo_heads=shape.num_qo_heads)), None)
        if split is not None:
            found.append(LayoutKernels(layout, meta["build"], name, split))
    return found


def resolve_attention_kernels(library, shape: AttentionShape, dtype: str, device) -> AttentionKernels:
    """Which attention kernels of the artifact run `shape` in `dtype` on `device`: the one place
    loading, the model, the kernel lab and the benchmarks learn it. A layout with several builds
    that fit (the subgroup layout) runs the one `pick_subgroup_build` prefers."""
    names = {kernel: AttentionSpec(kernel, shape, dtype).name for kernel in ("tiled", "merge", "prefill")}
    names["prefill_matrix"] = AttentionSpec("prefill", shape, dtype, tag=MATRIX_PREFILL).name
    missing = [names[k] for k in ("tiled", "merge") if names[k] not in library.specs]
    if missing:
        raise LookupError(f"the kernel artifact has no {' or '.join(missing)}")
    builds = runnable_builds(library, shape, dtype, device)
    layouts, unavailable = {}, {}
    for layout in LAYOUTS:
        mine = [b for b in builds if b.layout is layout]
        if layout.needs_subgroups and mine:
            metas = {(library.specs[b.whole].meta["row_lanes"], library.specs[b.whole].meta["subgroup_size"]): b
                     for b in mine}
            mine = [metas[pick_subgroup_build(metas, device.subgroup_min_size, device.subgroup_max_size)]]
        if len(mine) > 1:
            raise LookupError(f"the artifact has {len(mine)} builds of the {layout.name!r} layout for {shape} "
                              "and no rule to choose between them")
        if mine:
            layouts[layout.name] = mine[0]
        elif layout.needs_subgroups and library.names(kind="decode_attention", layout=layout.name, dtype=dtype,
                                                      head_dim=shape.head_dim, num_kv_heads=shape.num_kv_heads,
                                                      num_qo_heads=shape.num_qo_heads):
            unavailable[layout.name] = (f"this device cannot run it (subgroups {device.subgroup_min_size}-"
                                        f"{device.subgroup_max_size}; its builds need the subgroups feature and "
                                        "a subgroup that holds their lanes per row)")
        else:
            unavailable[layout.name] = "the kernel artifact has no kernels of it for this shape (it may not fit)"
    return AttentionKernels(shape, dtype, names["tiled"], tiled_defect(library.specs[names["tiled"]]), names["merge"],
                            *(names[k] if names[k] in library.specs else None for k in ("prefill", "prefill_matrix")),
                            layouts, unavailable)


# -- a step's choice: the nest, then the layout and its splits ------------------------------------------------
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
    layout of lowest rank (contract.attention.LAYOUTS: gpu_rank, or cpu_rank on a CPU rasterizer,
    which has no idle SMs to fill and runs one split); on GPUs, S from the layout's split tiers.
    """
    if forced is not None:
        if forced.layout not in available:
            raise ValueError(f"the {forced.layout!r} layout does not run this shape here")
        return AttentionChoice("sharded", forced.layout, forced.num_splits)
    ranked = sorted((rank, layout.name) for layout in LAYOUTS if layout.name in available
                    for rank in [layout.cpu_rank if is_cpu else layout.gpu_rank] if rank is not None)
    if not ranked:
        raise ValueError(f"no layout of the sharded family runs {shape} here (available: {sorted(available)})")
    layout = LAYOUTS_BY_NAME[ranked[0][1]]
    if is_cpu:
        return AttentionChoice("sharded", layout.name, 1)
    batch = max(len(context_lens), 1)
    heads = shape.num_kv_heads if layout.group_per_workgroup else shape.num_qo_heads
    max_splits = min(MAX_SPLITS, max(max_rows // batch, 1))
    return AttentionChoice("sharded", layout.name, _splits(batch * heads, max(context_lens, default=0), shape.head_dim,
                                                           max_splits, layout.split_tiers))


def choose_decode_attention(context_lens: list[int], kernels: AttentionKernels, *, is_cpu: bool,
                            attention: str = "auto", forced: LayoutChoice | None = None,
                            max_rows: int = MAX_SPLITS) -> AttentionChoice:
    """One decode step's attention: the nest (`attention`: "auto", or forced "tiled" / "sharded"),
    then for the sharded nest its layout and S on this device."""
    nest = pick_decode_nest(context_lens, attention, kernels.tiled_defect)
    if nest == "tiled":
        return AttentionChoice("tiled")
    return pick_layout(context_lens, kernels.shape, available=kernels.layouts, is_cpu=is_cpu, max_rows=max_rows,
                       forced=forced)
