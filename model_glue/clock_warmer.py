"""Raising the GPU's clocks before work that must run at full speed.

Between chat turns a GPU idles at low clocks (an H200 at 345 MHz) and a decode step is too short and
too light to ramp them: on the H200 the page's first reply after load decoded a 1B-shape model at
6.4-7.1 ms of GPU time a step, the same steps 1.84 ms a moment later. `ClockWarmer.warm(seconds)`
streams a buffer through the stream_read probe kernel for that long: the page runs it while the user
types (static/main.js), the benchmarks before they time.

It is bounded: it stops after `seconds` of wall time, and waits for each batch it submits (batches
double from one dispatch up to MAX_BATCH), so nothing queues behind a reply that starts meanwhile.
"""

from __future__ import annotations

import time

STREAM_KERNEL = "stream_read"  # kernels.probe.stream_read_probe
STREAM_GROUP_WORDS = 256 * 16  # f32 words one workgroup of the probe reads
STREAM_WORDS = 24 * 1024 * 1024  # 96 MiB of f32: far beyond any cache, within default binding limits
MAX_BATCH = 256  # dispatches per submit at most (a CPU adapter takes ~0.2 s per dispatch)


class ClockWarmer:
    """Streaming work that keeps a GPU busy; its buffers are made at the first `warm` and kept."""

    def __init__(self, device, library, words: int = STREAM_WORDS):
        self.device, self.library, self.words = device, library, words
        self._bound = None
        self._buffers = ()

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
        started, calls, dispatches = time.perf_counter(), 1, 0
        while time.perf_counter() - started < seconds:
            batch = self.device.batch()
            for _ in range(calls):
                self._bound.dispatch(batch)
            batch.submit()
            await self.device.read(self._buffers[1], 4)
            dispatches += calls
            calls = min(2 * calls, MAX_BATCH)
        return {"seconds": time.perf_counter() - started, "dispatches": dispatches}

    def release(self) -> None:
        if self._bound is not None:
            self._bound.release()
            for buffer in self._buffers:
                self.device.destroy(buffer)
            self._bound, self._buffers = None, ()
