"""Decode attention on the host side: which kernels run, and how one call is assembled.

`pick_decode_nest` decides between TVM's tiled kernel and the sequence-sharded family,
`pick_sharded_variant` which variant of the family and into how many splits the context is cut,
and `attention_call` names a call's buffers and values. The runtime, the tests and the benchmarks
all use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.artifacts import KernelSpec
from contract.kernels import ATTENTION_BUFFERS, MAX_SPLITS, NEST_CHOICES, PAGE_SIZE, SHARDED_VARIANTS, SPLIT_WORKSPACE
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


# -- the sharded family: which variant, and into how many splits the context is cut ---------------------
@dataclass(frozen=True)
class AttentionChoice:
    """The decode-attention kernel(s) of one step: "tiled", or a variant of the sharded family over
    the whole context (num_splits 1: one dispatch) or cut into num_splits splits (split kernel + merge)."""

    variant: str  # "tiled" or one of SHARDED_VARIANTS
    num_splits: int = 1

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    def __str__(self) -> str:
        return f"{self.variant} S={self.num_splits}" if self.split else self.variant


def split_workspace_bytes(max_rows: int, shape: AttentionShape) -> dict[str, int]:
    """Bytes of the split workspace for every call with batch * num_splits <= max_rows."""
    rows = max_rows * shape.num_qo_heads
    return dict(zip(SPLIT_WORKSPACE, (rows * shape.head_dim * 4, rows * 2 * 4)))


def parse_sharded_override(text: str) -> AttentionChoice:
    """'subgroup', 'shards:8' or 'shards_group:4' (benchmarks and tests force a variant this way)."""
    variant, _, splits = text.partition(":")
    if variant not in SHARDED_VARIANTS:
        raise ValueError(f"sharded variant must be one of {SHARDED_VARIANTS}, got {variant!r}")
    num_splits = int(splits or 1)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"the number of splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    return AttentionChoice(variant, num_splits)


# The rules, from sweeps on an NVIDIA H200 (docs/benchmarks.md, "Choosing S"). A split pays while the
# GPU has idle SMs, and costs a merge: S doubles (powers of two) while the call stays within
# TARGET_WORKGROUPS workgroups and each split keeps at least MIN_SPLIT_ROWS rows.
#  - "subgroup" serves a whole GQA group per workgroup (B * H_kv * S workgroups); GPUs whose subgroups
#    fit a build run it (pick_subgroup_build). Long contexts go on to WIDE_WORKGROUPS while a split
#    still holds WIDE_SPLIT_ROWS rows (e.g. 8 KV heads at 32,768 tokens: S = 32).
#  - "shards" serves one query head per workgroup (B * H_qo * S); GPUs without subgroups run it.
#  - A CPU rasterizer (lavapipe, SwiftShader) has no idle SMs to fill: one split. Its subgroups are
#    its SIMD lanes, and "subgroup" with that many lanes per row ran 2-4x faster there than the shards
#    layout (docs/benchmarks.md, lavapipe); without a fitting build, a whole GQA group per workgroup
#    where the shape fits ("shards_group": each K/V row read once per group).
SUBGROUP_TARGET_WORKGROUPS = 128
SUBGROUP_MIN_SPLIT_ROWS = 128
SUBGROUP_WIDE_WORKGROUPS = 256
SUBGROUP_WIDE_SPLIT_ROWS = 512
SHARDS_TARGET_WORKGROUPS = 128
SHARDS_MIN_SPLIT_ROWS = 64


def pick_subgroup_build(builds, subgroup_min_size: int | None, subgroup_max_size: int | None):
    """Of the artifact's subgroup-layout builds, (row_lanes, exact subgroup size or None) each, the
    one this device runs best, or None. A build for an exact size needs subgroups of exactly that
    size (min == max); a relative build needs a row's lanes to fit the smallest subgroup
    (kernels.decode_attention_subgroup), and the widest such build wins."""
    exact = [b for b in builds if b[1] and subgroup_min_size == subgroup_max_size == b[1]]
    relative = [b for b in builds if not b[1] and subgroup_min_size and b[0] <= subgroup_min_size]
    return max(exact or relative, default=None)


def _splits(workgroups_per_split: int, longest: int, max_splits: int, tiers) -> int:
    """The largest power of two S (<= max_splits) such that some tier (most workgroups, fewest rows a
    split) admits it."""
    splits = 1
    while 2 * splits <= max_splits and any(2 * splits * workgroups_per_split <= most and longest // (2 * splits) >= rows
                                           for most, rows in tiers):
        splits *= 2
    return splits


def pick_sharded_variant(context_lens: list[int], shape: AttentionShape, *, is_cpu: bool, subgroups: bool,
                         available: frozenset[str] | set[str] = frozenset(SHARDED_VARIANTS),
                         max_rows: int = MAX_SPLITS, override: str | None = None) -> AttentionChoice:
    """The sharded-family variant and its split count S for one step of a batch (whose longest
    context is above the tiled nest's range).

    `subgroups`: the device runs the artifact's subgroup kernels (it has the feature and subgroups
    of at least their row lanes); `available`: the variants the artifact holds for this shape
    ("shards_group" only where the group fits the layout); `max_rows` bounds batch * S (the
    workspace's size); `override` forces a choice ('shards:8', 'subgroup', ...).
    """
    if override:
        choice = parse_sharded_override(override)
        if choice.variant not in available:
            raise ValueError(f"the artifact has no {choice.variant!r} kernels for this shape")
        if choice.variant == "subgroup" and not subgroups:
            raise ValueError("this device cannot run the subgroup kernels (no subgroups feature, or its "
                             "subgroups are smaller than the kernels' row lanes)")
        return choice
    if is_cpu:
        if subgroups and "subgroup" in available:
            return AttentionChoice("subgroup", 1)
        return AttentionChoice("shards_group" if "shards_group" in available else "shards", 1)
    batch = max(len(context_lens), 1)
    longest = max(context_lens, default=0)
    max_splits = min(MAX_SPLITS, max(max_rows // batch, 1))
    if subgroups and "subgroup" in available:
        return AttentionChoice("subgroup", _splits(batch * shape.num_kv_heads, longest, max_splits, (
            (SUBGROUP_TARGET_WORKGROUPS, SUBGROUP_MIN_SPLIT_ROWS), (SUBGROUP_WIDE_WORKGROUPS, SUBGROUP_WIDE_SPLIT_ROWS))))
    return AttentionChoice("shards", _splits(batch * shape.num_qo_heads, longest, max_splits,
                                             ((SHARDS_TARGET_WORKGROUPS, SHARDS_MIN_SPLIT_ROWS),)))
