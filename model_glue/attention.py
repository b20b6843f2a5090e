"""Decode attention on the host side: which nest runs, and the paged inputs it reads.

`pick_decode_nest` is the one place that decides between TVM's tiled kernel and the
sequence-sharded kernel; the runtime, the tests and the benchmarks all call it.
"""

from __future__ import annotations

# Up to this many context tokens the tiled nest's low fixed cost wins; above it, sharded.
TILED_MAX_CONTEXT = 256
NEST_CHOICES = ("auto", "tiled", "sharded")


def context_length(num_pages: int, last_page_len: int, page_size: int = 16) -> int:
    """Tokens of one sequence's context from its page count and last page's fill."""
    if num_pages == 0:
        return 0
    return (num_pages - 1) * page_size + last_page_len


def tiled_defect(tiled_spec: dict) -> str | None:
    """Why TVM's tiled kernel must not run for this shape, or None when it is correct.

    The build reads from TVM's lowered launch how many query heads of each KV head the kernel
    computes; for some GQA groups it is fewer than the group (head_dim 256 with groups 5 or 7,
    head_dim 128 with 9 or 11: the last heads of every group are never written), and the build
    records that in the kernel's manifest entry as `defect`.
    """
    return tiled_spec["meta"].get("defect")


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
