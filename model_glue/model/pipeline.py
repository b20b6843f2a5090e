"""Passes in flight: each submitted pass copies its chosen id and its timestamps into a readback
buffer of its own, and the host reads them back in submission order, up to `pipeline_depth` passes
behind (model_glue.options). Reading is asked for as a pass is submitted, so waiting for one
overlaps the passes queued behind it.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from model_glue.options import MAX_PIPELINE_DEPTH
from model_glue.model.step_stats import PassStamps, StepStats

STAMPS_OFFSET = 8  # a pass's readback: the chosen id (4 bytes, padded), then its raw timestamps


@dataclass
class PendingPass:
    """A submitted pass whose token id is not read back yet (`PassPipeline.read_back` reads it)."""

    staging: object  # the readback buffer its id and timestamps are copied to
    tokens: int
    start: int  # cache length before it
    input_on_gpu: bool  # its one token is the id the previous pass chose, not yet known to the host
    stats: StepStats  # filled in when it finishes (timings)
    started: float  # perf_counter() when its encoding began
    attention_timed: bool = True  # each layer's attention had timestamps (RunOptions.time_attention_every)
    queued_behind: bool = False  # another pass was in flight when it was submitted (StepStats.gpu_gap_ms)


class PassPipeline:
    """The readback buffers (MAX_PIPELINE_DEPTH, used in turn) and the passes not yet read back."""

    def __init__(self, device, stamps):
        self.device = device
        self.stamps = stamps  # the timestamp query set every pass writes (None without timestamp-query)
        self.readback_bytes = STAMPS_OFFSET + (8 * stamps.count if stamps is not None else 0)
        self._staging = [device.staging_buffer(self.readback_bytes) for _ in range(MAX_PIPELINE_DEPTH)]
        self.in_flight: list[PendingPass] = []
        self._submitted = 0
        self.last_finish = 0.0  # perf_counter() when the last id arrived
        self._last_pass_end_ns: int | None = None  # the last finished pass's end (timestamps)

    def check_room(self, depth: int) -> None:
        if len(self.in_flight) >= depth:
            raise ValueError(f"at most {depth} passes can be in flight: finish one first")

    def submit(self, batch, next_id, stats: StepStats, *, start: int, input_on_gpu: bool,
               started: float, attention_timed: bool = True) -> PendingPass:
        """Copy the pass's id and timestamps to its readback buffer, submit it and ask for the readback."""
        staging = self._staging[self._submitted % MAX_PIPELINE_DEPTH]
        self._submitted += 1
        batch.copy(next_id, 0, staging, 0, 4)
        if self.stamps is not None:
            batch.resolve(self.stamps)
            batch.copy(self.stamps.resolved, 0, staging, STAMPS_OFFSET, 8 * self.stamps.count)
        batch.submit()
        self.device.start_read(staging, self.readback_bytes)  # mapped once the pass is done
        stats.encode_ms = round((time.perf_counter() - started) * 1e3, 3)
        stats.dispatches = batch.dispatches
        step = PendingPass(staging, stats.tokens, start, input_on_gpu, stats, started, attention_timed,
                           queued_behind=bool(self.in_flight))
        self.in_flight.append(step)
        return step

    async def read_back(self, step: PendingPass) -> tuple[int, list[int] | None]:
        """The oldest pass's chosen id and raw timestamps (None without timestamp-query)."""
        if not self.in_flight or self.in_flight[0] is not step:
            raise ValueError("passes must be finished in the order they were submitted")
        self.in_flight.pop(0)
        raw = await self.device.read_staging(step.staging, self.readback_bytes)
        (next_id,) = struct.unpack_from("<i", raw)
        ticks = list(memoryview(raw)[STAMPS_OFFSET:].cast("Q")) if self.stamps is not None else None
        return next_id, ticks

    async def finish(self, step: PendingPass, n_layers: int) -> int:
        """Wait for the oldest pass, fill in its stats and return the token id it chose."""
        waited = time.perf_counter()
        next_id, ticks = await self.read_back(step)
        now = time.perf_counter()
        stats = step.stats
        stats.add_gpu_times(ticks, n_layers, step.attention_timed)
        if ticks is not None:
            at = PassStamps(n_layers)
            if step.queued_behind and self._last_pass_end_ns is not None:
                stats.gpu_gap_ms = max(ticks[at.pass_begin] - self._last_pass_end_ns, 0) / 1e6
            self._last_pass_end_ns = ticks[at.pass_end]
        stats.wait_ms = round((now - waited) * 1e3, 3)
        # Pipelined steps overlap: a step's time runs from when the previous id arrived (or from its
        # own start, if that is later) to when its own id arrives.
        stats.step_ms = (now - max(step.started, self.last_finish)) * 1e3
        self.last_finish = now
        return next_id

    def abandon(self) -> None:
        """Forget passes left unfinished (an error midway)."""
        for step in self.in_flight:
            self.device.cancel_read(step.staging)
        self.in_flight.clear()
        self._last_pass_end_ns = None
