"""Decode attention on the host side: which kernels run a shape, and how one call is assembled.

`resolve_attention_kernels` says which of the artifact's attention kernels run a shape on this
device (the tiled nest, its defect if any, the merge, prefill, and per layout of contract.attention
the build this device runs); model_glue.policy.choose_decode_attention makes a step's choice among
them. `attention_call` names a call's buffers and values. Loading, the model, the kernel lab, the
benchmarks and the tests all go through these.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.artifacts import KernelSpec
from contract.attention import LAYOUTS, LAYOUTS_BY_NAME, MATRIX_PREFILL, AttentionChoice, Layout, LayoutChoice
from contract.kernels import ATTENTION_BUFFERS, PAGE_SIZE, SPLIT_WORKSPACE, AttentionSpec
from contract.model import AttentionShape
from model_glue.policy import pick_subgroup_build


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


# -- which kernels run a shape on this device ------------------------------------------------------------
def split_workspace_bytes(max_rows: int, shape: AttentionShape) -> dict[str, int]:
    """Bytes of the split workspace for every call with batch * num_splits <= max_rows."""
    rows = max_rows * shape.num_qo_heads
    return dict(zip(SPLIT_WORKSPACE, (rows * shape.head_dim * 4, rows * 2 * 4)))


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
    window: "AttentionKernels | None" = None  # the shape's builds over a sliding window (its layers that have one)

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


def runnable_builds(library, shape: AttentionShape, dtype: str, device, *, sweep: bool = False,
                    sliding_window: bool = False) -> list[LayoutKernels]:
    """Every build of every layout the artifact holds for the shape (over a window: `sliding_window`)
    that this device can run; `sweep` adds the benchmark sweep's builds (`python -m app build --set sweep`)."""
    found = []
    for name in library.names(kind="decode_attention", nest="sharded", split=False, dtype=dtype,
                              sliding_window=sliding_window,
                              head_dim=shape.head_dim, num_kv_heads=shape.num_kv_heads, num_qo_heads=shape.num_qo_heads):
        meta = library.specs[name].meta
        layout = LAYOUTS_BY_NAME.get(meta["layout"])
        if layout is None or (meta.get("sweep") and not sweep):
            continue
        if layout.needs_subgroups and pick_subgroup_build([(meta["row_lanes"], meta["subgroup_size"])],
                                                          device.subgroup_min_size, device.subgroup_max_size) is None:
            continue  # this device's subgroups do not fit the build
        split = next((n for n in library.names(kind="decode_attention", split=True, build=meta["build"], dtype=dtype,
                                               sliding_window=sliding_window, head_dim=shape.head_dim,
                                               num_kv_heads=shape.num_kv_heads, num_qo_heads=shape.num_qo_heads)), None)
        if split is not None:
            found.append(LayoutKernels(layout, meta["build"], name, split))
    return found


def resolve_attention_kernels(library, shape: AttentionShape, dtype: str, device,
                              sliding_window: bool = False) -> AttentionKernels:
    """Which attention kernels of the artifact run `shape` in `dtype` on `device` (their builds over a
    window: `sliding_window`, length_info [3, B]): the one place loading, the model, the kernel lab and
    the benchmarks learn it. A layout with several builds that fit (the subgroup layout) runs the one
    `pick_subgroup_build` prefers."""
    names = {kernel: AttentionSpec(kernel, shape, dtype, sliding_window and kernel == "tiled").name
             for kernel in ("tiled", "merge", "prefill")}
    names["prefill_matrix"] = AttentionSpec("prefill", shape, dtype, tag=MATRIX_PREFILL).name
    missing = [names[k] for k in ("tiled", "merge") if names[k] not in library.specs]
    if missing:
        raise LookupError(f"the kernel artifact has no {' or '.join(missing)}")
    builds = runnable_builds(library, shape, dtype, device, sliding_window=sliding_window)
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
