"""What the overlay, the export and the benchmarks know of one forward pass: `StepStats`, and how its
GPU times come from the pass's timestamps.

A pass writes 2 * n_layers + 2 timestamps: each layer's attention (begin, end), then the whole pass
(its first dispatch's begin, its last dispatch's end). `stamp_count` and `PassStamps` say where each
one lives; `StepStats.add_gpu_times` turns the ticks into milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


def stamp_count(n_layers: int) -> int:
    """Timestamps one pass writes: each layer's attention, then the whole pass."""
    return 2 * n_layers + 2


@dataclass(frozen=True)
class PassStamps:
    """Where a pass's timestamps go: layer i's attention at (2i, 2i + 1), the pass at the last two."""

    n_layers: int

    def attention(self, layer: int) -> tuple[int, int]:
        return 2 * layer, 2 * layer + 1

    @property
    def pass_begin(self) -> int:
        return 2 * self.n_layers

    @property
    def pass_end(self) -> int:
        return 2 * self.n_layers + 1


@dataclass
class StepStats:
    """One forward pass: what the overlay shows and the export writes (field names are the page's
    column names: static/export.js and static/overlay.js read them)."""

    kind: str  # "prefill" or "decode"
    tokens: int  # tokens processed in this pass
    context: int  # tokens attended by the last query (the step's longest context)
    nest: str  # decode: "tiled" or "sharded" (the family; the comparison mode's axis); "prefill"
    kernel: str  # the attention kernels that ran: "tiled", "subgroup", "subgroup S=8", "shards_group", "prefill"
    attention_ms: float | None  # GPU time of all attention dispatches, summed over layers
    step_ms: float  # wall time of the pass (encoding, GPU work, token id back); pipelined steps overlap,
    #                 so a decode step counts from when the previous id arrived
    timing_note: str = ""
    encode_ms: float = 0.0  # host time to encode and submit the pass
    gpu_ms: float | None = None  # GPU time from the pass's first dispatch to its last (timestamps)
    dispatches: int = 0  # compute dispatches in the pass
    # How long the host waited for the pass's id. At steady state above 0: the host keeps up and the
    # GPU is the bound; near 0 with step_ms above gpu_ms: the host is, and the GPU waits for it.
    wait_ms: float = 0.0
    # How long the GPU sat idle before this pass: from the previous pass's last dispatch to this
    # one's first (timestamps). Near the 0.035 ms a submission boundary costs on an H200: the GPU
    # had the pass queued. Higher: it waited for the host (or the browser's GPU process). None
    # without timestamps, and for a pass submitted when none was in flight (the gap is then idle time).
    gpu_gap_ms: float | None = None

    def add_gpu_times(self, ticks: list[int] | None, n_layers: int, attention_timed: bool = True) -> None:
        """Fill attention_ms and gpu_ms from the pass's raw timestamps (ns), or say why there are none.
        A pass that did not time attention (RunOptions.time_attention_every) has only the whole pass's."""
        if ticks is None:
            self.timing_note = "no timestamp-query on this adapter"
            return
        at = PassStamps(n_layers)
        self.gpu_ms = (ticks[at.pass_end] - ticks[at.pass_begin]) / 1e6
        if not attention_timed:
            self.timing_note = "attention timed in sampled steps only (time_attention_every)"
            return
        spans = [ticks[end] - ticks[begin] for begin, end in map(at.attention, range(n_layers))]
        self.attention_ms = sum(spans) / 1e6
        # Some browsers quantize timestamps (100 us) unless developer features are on. A note the pass
        # already had (the merge inside the o-projection) stays.
        quantized = "quantized timestamps (100 us steps)" if all(s % 100_000 == 0 for s in spans) else ""
        self.timing_note = "; ".join(note for note in (self.timing_note, quantized) if note)

    def to_dict(self) -> dict:
        # Every field is a number or a string: no deep copy (dataclasses.asdict) is needed, and in
        # the page this runs once a decode step (the overlay's row).
        return {name: getattr(self, name) for name in STEP_FIELDS}


STEP_FIELDS = tuple(f.name for f in fields(StepStats))
