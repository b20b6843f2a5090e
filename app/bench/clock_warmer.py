"""Raising the GPU's clocks before a benchmark times anything.

An idle GPU runs at low clocks. `ClockWarmer.warm(seconds)` streams a buffer through the stream_read
probe kernel for that long, so that the timed calls after it run at full clocks. It is bounded: it
stops after `seconds` of wall time or when `cancel()` is called, and waits for each batch it submits
(batches double from one dispatch up to `max_batch`), so at most one batch is still queued after it.

(The page does not stream to warm: streaming work before a reply made the reply slower on an H200,
docs/benchmarks.md. Its opt-in warm, static/clock_warm.js, spins a compute-bound kernel instead.)
"""

from __future__ import annotations

import asyncio
import time

STREAM_KERNEL = "stream_read"  # kernels.probe.stream_read_probe
STREAM_GROUP_WORDS = 256 * 16  # f32 words one workgroup of the probe reads
STREAM_WORDS = 24 * 1024 * 1024  # 96 MiB of f32: far beyond any cache, within default binding limits
MAX_BATCH = 256  # dispatches per submit at most (a CPU adapter takes ~0.2 s per dispatch)


class ClockWarmer:
    """Streaming work that keeps a GPU busy; its buffers are made at the first `warm` and kept."""

    def __init__(self, device, library, words: int = STREAM_WORDS, max_batch: int = MAX_BATCH):
        self.device, self.library, self.words, self.max_batch = device, library, words, max_batch
        self._bound = None
        self._buffers = ()
        self._cancelled = False

    async def _bind(self):
        kernel = await self.library.kernel(STREAM_KERNEL)
        groups = self.words // STREAM_GROUP_WORDS
        x, partial = self.device.storage_buffer(self.words * 4), self.device.storage_buffer(groups * 256 * 4)
        self._buffers = (x, partial)
        self._bound = kernel.bind({"x": x, "partial": partial}, {"num_groups": groups})

    async def warm(self, seconds: float) -> dict:
        """Stream for about `seconds`; returns how long it ran and how many dispatches it made."""
        if self._bound is None:
            await self._bind()
        self._cancelled = False
        started, calls, dispatches = time.perf_counter(), 1, 0
        while time.perf_counter() - started < seconds and not self._cancelled:
            batch = self.device.batch()
            for _ in range(calls):
                self._bound.dispatch(batch)
            batch.submit()
            await self.device.read(self._buffers[1], 4)
            await asyncio.sleep(0)  # a native read may not yield: let a cancel (or a reply) run
            dispatches += calls
            calls = min(2 * calls, self.max_batch)
        return {"seconds": time.perf_counter() - started, "dispatches": dispatches, "cancelled": self._cancelled}

    def cancel(self) -> None:
        """Stop a running `warm` after the batch in flight."""
        self._cancelled = True

    def release(self) -> None:
        if self._bound is not None:
            self._bound.release()
            for buffer in self._buffers:
                self.device.destroy(buffer)
            self._bound, self._buffers = None, ()
