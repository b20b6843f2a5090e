"""The decode-attention registry: the two nests, the sharded family's layouts in one table, and the
typed choices a step makes between them.

Words, each with one meaning:
- **nest**: "tiled" (TVM's kernel) or "sharded" (the family); the comparison mode's axis.
- **layout**: one row of `LAYOUTS`, a way the sharded family lays threads over K/V rows.
- **build**: one compiled form of a layout (the subgroup layout has one per lanes-per-row and
  subgroup size, named by its `tag`).
- **splits** (S): how many parts a call cuts the context into; S > 1 runs the layout's split
  kernel and the merge.

A layout row names everything the build and the host need: the kernel module that builds it
(`builder`, and `builds`, which lists its builds for a shape: an empty list where the shape does not
fit), whether it needs WebGPU subgroups, how many query heads a workgroup serves (which sets the grid
the split rule fills). A new layout is one kernel module, one row here and its rank and split tiers
in model_glue.policy.LAYOUT_RULES (the runtime's choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SPLITS = 128  # the most splits the host picks (the workspace is sized for it)
NESTS = ("tiled", "sharded")
NEST_CHOICES = ("auto",) + NESTS  # 'auto' lets model_glue.policy.pick_decode_nest choose


@dataclass(frozen=True)
class Layout:
    name: str
    builder: str  # "module:function" giving the PrimFunc (kernels/, build side only)
    builds: str  # "module:function": (layout name, shape, **build_params) -> [LayoutBuild] (empty: no fit)
    needs_subgroups: bool  # built with WebGPU subgroup operations; runs where a build fits the subgroups
    group_per_workgroup: bool  # a workgroup serves a whole GQA group (B*H_kv*S workgroups), else one head (B*H_qo*S)
    summary: str = ""


LAYOUTS = (
    Layout("shards", "kernels.decode_attention_sharded:decode_attention_sharded",
           "kernels.decode_attention_sharded:layout_builds", needs_subgroups=False, group_per_workgroup=False,
           summary="the seed's layout: shards of lanes own whole K/V rows, one query head per workgroup"),
    Layout("shards_group", "kernels.decode_attention_sharded:decode_attention_sharded",
           "kernels.decode_attention_sharded:layout_builds", needs_subgroups=False, group_per_workgroup=True,
           summary="the shards layout with a whole GQA group per workgroup (where the group fits)"),
    Layout("subgroup", "kernels.decode_attention_subgroup:decode_attention_subgroup",
           "kernels.decode_attention_subgroup:layout_builds", needs_subgroups=True, group_per_workgroup=True,
           summary="K/V rows across subgroups, head dims across a subgroup's lanes, a GQA group per workgroup"),
)
LAYOUTS_BY_NAME = {layout.name: layout for layout in LAYOUTS}
LAYOUT_NAMES = tuple(LAYOUTS_BY_NAME)


@dataclass(frozen=True)
class LayoutBuild:
    """One build of a layout for a shape: its name tag (None for a layout's only build), the builder's
    keyword arguments, and what the manifest records of it (the host picks a build by these)."""

    tag: str | None
    options: dict = field(hash=False)
    meta: dict = field(hash=False)


def subgroup_tag(row_lanes: int, subgroup_size: int | None = None) -> str:
    """A subgroup-layout build's tag: its lanes per K/V row, and the exact subgroup size it is built
    for, if any (kernels.decode_attention_subgroup)."""
    return f"l{row_lanes}" + (f"s{subgroup_size}" if subgroup_size else "")


@dataclass(frozen=True)
class LayoutChoice:
    """A layout and its split count, e.g. forced by a benchmark or a test as "shards:8"."""

    layout: str
    num_splits: int = 1

    def __post_init__(self):
        if self.layout not in LAYOUTS_BY_NAME:
            raise ValueError(f"the sharded layout must be one of {LAYOUT_NAMES}, got {self.layout!r}")
        if not isinstance(self.num_splits, int) or not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"the number of splits must be in 1..{MAX_SPLITS}, got {self.num_splits!r}")

    @classmethod
    def parse(cls, text: str) -> "LayoutChoice":
        """'subgroup', 'shards:8' or 'shards_group:4'."""
        layout, _, splits = text.partition(":")
        try:
            num_splits = int(splits or 1)
        except ValueError:
            raise ValueError(f"the number of splits must be a whole number, got {splits!r}") from None
        return cls(layout, num_splits)

    def __str__(self) -> str:
        return f"{self.layout}:{self.num_splits}" if self.num_splits > 1 else self.layout


# The prefill attention's build on subgroup matrices (AttentionChoice.layout of a prefill pass;
# AttentionSpec.tag of its kernel: kernels.prefill_attention_matrix)
MATRIX_PREFILL = "subgroup-matrix"


@dataclass(frozen=True)
class AttentionChoice:
    """The attention kernels of one pass: the causal "prefill" kernel, the "tiled" nest, or the
    "sharded" nest in a layout, over the whole context (S = 1: one dispatch) or cut into S splits
    (the layout's split kernel, then the merge)."""

    nest: str  # "prefill", "tiled" or "sharded"
    layout: str | None = None  # a LAYOUTS name, for "sharded"; MATRIX_PREFILL for prefill on subgroup matrices
    num_splits: int = 1

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    def __str__(self) -> str:
        """What the overlay and the export show: "tiled", "prefill", "prefill (subgroup-matrix)",
        "subgroup", "shards S=8"."""
        if self.nest == "prefill" and self.layout:
            return f"prefill ({self.layout})"
        if self.nest != "sharded":
            return self.nest
        return f"{self.layout} S={self.num_splits}" if self.split else self.layout
