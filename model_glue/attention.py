"""Decode attention on the host side: which nest runs, and how one call is assembled.

`pick_decode_nest` is the one place that decides between TVM's tiled kernel and the
sequence-sharded kernel, and `attention_call` the one place that names a call's buffers and
values; the runtime, the tests and the benchmarks all use them.
"""

from __future__ import annotations

from model_glue.contract import ATTENTION_BUFFERS, NEST_CHOICES, PAGE_SIZE, KernelSpec

# Up to this many context tokens the tiled nest's low fixed cost wins; above it, sharded.
TILED_MAX_CONTEXT = 256


def attention_call(*, q, pages, page_table_indptr, page_table_values, length_info, k_rope_pos_offset,
                   q_rope_position, output, lse, batch: int, nnz_pages: int, max_num_pages: int,
                   sm_scale: float, rotary_mode: int = 0, rope_scale: float = 1.0,
                   rope_theta: float = 1e4) -> tuple[dict, dict]:
    """The buffers (by the kernels' names) and scalar values of one paged decode-attention call.

    Both nests take TVM's batch_decode_paged_kv arguments. The buffers can be anything the caller
    binds (GPU buffers, numpy arrays, base64 strings); `rotary_mode=1` applies RoPE inline
    (the model applies it when appending K instead, so it passes 0).
    """
    buffers = dict(zip(ATTENTION_BUFFERS, (q, pages, page_table_indptr, page_table_values, length_info,
                                            k_rope_pos_offset, q_rope_position, output, lse)))
    values = {"B": batch, "nnz_pages": nnz_pages, "max_num_pages": max_num_pages, "rotary_mode": rotary_mode,
              "rope_scale": rope_scale, "rope_theta": rope_theta, "sm_scale": sm_scale}
    return buffers, values


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
