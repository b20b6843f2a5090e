"""Raising the GPU's clocks before work that must run at full speed.

Between chat turns a GPU idles at low clocks (an H200 at 345 MHz). `ClockWarmer.warm(seconds)` streams
a buffer through the stream_read probe kernel for that long: the benchmarks run it before they time,
and the page, with `?warm=on`, while the user types (static/main.js). In the page on the H200 it did
not help a reply: after 1.5 s of typing with warms a 1B-shape model's first reply decoded at 259 tok/s
(5.2 ms of GPU a step), without them at 486 tok/s (1.95 ms), and after 30 s idle 238 against 357
tok/s (docs/benchmarks.md); so the page leaves it off by default.

It is bounded: it stops after `seconds` of wall time or when `cancel()` is called (the page calls it as
a reply starts: streaming work beside a reply slowed its decode from 442 to 259 tok/s on the H200), and
waits for each batch it submits (batches double from one dispatch up to `max_batch`), so what can still
be queued when a reply starts is one batch.
"""

from __future__ import annotations

import asyncio
import time

STREAM_KERNEL = "stream_read"  # kernels.probe.stream_read_probe
STREAM_GROUP_WORDS = 256 * 16  # f32 words one workgroup of the probe reads
STREAM_WORDS = 24 * 1024 * 1024  # 96 MiB of f32: far beyond any cache, within default binding limits
MAX_BATCH = 256  # dispatches per submit at most (a CPU adapter takes ~0.2 s per dispatch)
PAGE_MAX_BATCH = 16  # the page's: a batch of 96 MiB reads is ~0.5 ms at full clocks, a few ms at idle ones


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
