"""Decode attention on the host side: which nest runs, and how one call is assembled.

`pick_decode_nest` is the one place that decides between TVM's tiled kernel and the
sequence-sharded kernel, and `attention_call` the one place that names a call's buffers and
values; the runtime, the tests and the benchmarks all use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_glue.contract import (ATTENTION_BUFFERS, MAX_SPLITS, NEST_CHOICES, PAGE_SIZE, SHARDED_VARIANTS,
                                 SPLIT_VARIANTS, SPLIT_WORKSPACE, AttentionShape, KernelSpec)

# Up to this many context tokens the tiled nest's low fixed cost wins; above it, sharded.
TILED_MAX_CONTEXT = 256


def attention_call(*, q, pages, page_table_indptr, page_table_values, length_info, k_rope_pos_offset,
                   q_rope_position, output, lse, batch: int, nnz_pages: int, max_num_pages: int,
                   sm_scale: float, rotary_mode: int = 0, rope_scale: float = 1.0,
                   rope_theta: float = 1e4, workspace: dict | None = None, num_splits: int = 1) -> tuple[dict, dict]:
    """The buffers (by the kernels' names) and scalar values of one paged decode-attention call.

    Every nest takes TVM's batch_decode_paged_kv arguments; the split variants also take the
    `workspace` buffers (SPLIT_WORKSPACE, sized by `split_workspace_bytes`) and `num_splits`. The
    buffers can be anything the caller binds (GPU buffers, numpy arrays, base64 strings);
    `rotary_mode=1` applies RoPE inline (the model applies it when appending K instead: 0).
    """
    buffers = dict(zip(ATTENTION_BUFFERS, (q, pages, page_table_indptr, page_table_values, length_info,
                                            k_rope_pos_offset, q_rope_position, output, lse)))
    buffers.update(workspace or {})
    values = {"B": batch, "nnz_pages": nnz_pages, "max_num_pages": max_num_pages, "rotary_mode": rotary_mode,
              "rope_scale": rope_scale, "rope_theta": rope_theta, "sm_scale": sm_scale, "num_splits": num_splits}
    return buffers, values


def attention_dispatches(kernels: list, buffers: dict, values: dict) -> list[tuple]:
    """(kernel, its buffers, values) for each dispatch of a call: one kernel, or a split's partial
    and merge. Each kernel gets exactly the buffers it declares."""
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
    """The decode-attention kernel(s) of one step: "tiled", or a variant of the sharded family."""

    variant: str  # "tiled" or one of SHARDED_VARIANTS
    num_splits: int = 1

    def __str__(self) -> str:
        return f"{self.variant} S={self.num_splits}" if self.variant in SPLIT_VARIANTS else self.variant


def split_workspace_bytes(max_rows: int, shape: AttentionShape) -> dict[str, int]:
    """Bytes of the split workspace for every call with batch * num_splits <= max_rows."""
    rows = max_rows * shape.num_qo_heads
    return dict(zip(SPLIT_WORKSPACE, (rows * shape.head_dim * 4, rows * 2 * 4)))


def parse_sharded_override(text: str) -> AttentionChoice:
    """'sharded', 'split:8' or 'split_group:4' (benchmarks and tests force a variant this way)."""
    variant, _, splits = text.partition(":")
    if variant not in SHARDED_VARIANTS:
        raise ValueError(f"sharded variant must be one of {SHARDED_VARIANTS}, got {variant!r}")
    return AttentionChoice(variant, int(splits or 1) if variant != "sharded" else 1)


# The rule, from a sweep of S for both split variants on an NVIDIA H200 (docs/benchmarks.md,
# "Choosing S"): the best S put about SPLIT_TARGET_WORKGROUPS workgroups on the GPU for every shape
# and context from 1,024 to 32,768 tokens (S = 4 for 32 query heads, 16 for 8, 8 for 9), and more
# splits only added partial-kernel merges. "split_group" (a GQA group per workgroup) tied or lost
# except at a few points, so GPUs run "split". On a CPU rasterizer (lavapipe, SwiftShader) every
# split only adds work: one split, with the variant that was fastest there (split_group).
SPLIT_TARGET_WORKGROUPS = 128
SPLIT_MIN_TOKENS = 64  # a split shorter than this is mostly fixed cost
GPU_VARIANT = "split"
CPU_CHOICE = AttentionChoice("split_group", 1)


def pick_sharded_variant(context_lens: list[int], shape: AttentionShape, *, is_cpu: bool,
                         max_rows: int = MAX_SPLITS, override: str | None = None) -> AttentionChoice:
    """The sharded-family variant and its split count S for one step of a batch (whose longest
    context is above the tiled nest's range). `max_rows` bounds batch * S (the workspace's size);
    `override` forces a choice ('sharded', 'split:8', 'split_group:4') for benchmarks and tests."""
    if override:
        return parse_sharded_override(override)
    if is_cpu:
        return CPU_CHOICE
    batch = max(len(context_lens), 1)
    splits = 1
    while (splits * 2 * batch * shape.num_qo_heads <= SPLIT_TARGET_WORKGROUPS
           and splits * 2 * SPLIT_MIN_TOKENS <= max(context_lens, default=0)
           and splits * 2 <= min(MAX_SPLITS, max_rows // batch)):
        splits *= 2
    return AttentionChoice(GPU_VARIANT, splits)
