"""The one WebGPU seam: a small async device API, backend-neutral; each backend in its own module.

This module holds what both share: the usage bits, the limits and features a device asks for, the
errors, `Device` (buffers, reads, pipelines, device loss; a backend implements its `_`-prefixed
primitives), `Batch`, `RecordedPasses` and `Timestamps`. The backends:
`model_glue.gpu.webgpu_browser.BrowserDevice` drives Pyodide's `js.navigator.gpu`;
`model_glue.gpu.webgpu_native.WgpuDevice` drives wgpu-py (native, used by tests and benchmarks).
`model_glue.gpu.device.open_device` imports the one this process runs on, so neither `js` nor `wgpu` is
imported where it does not exist. Both expose the same methods, so everything above this seam runs unchanged in
the browser and natively. The API is async because the browser's WebGPU promises must be awaited.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

from contract.slices import BINDING_OFFSET_ALIGN

# WebGPU's GPUBufferUsage / GPUMapMode bits (identical in the JS API and wgpu-py).
MAP_READ, COPY_SRC, COPY_DST, UNIFORM, STORAGE, QUERY_RESOLVE = 1, 4, 8, 64, 128, 512

# Limits the device asks for, each at the adapter's best value. What the artifact's kernels need of
# them is read from the manifest when a kernel is compiled (model_glue.gpu.kernel.unmet_limits) and the
# model checks its buffer sizes at load, so an adapter below the artifact's needs is refused there,
# with the limit named, instead of failing somewhere inside a pass.
KERNEL_LIMITS = (
    "maxStorageBuffersPerShaderStage",  # TVM's tiled decode kernel binds 9 (WebGPU's default is 8)
    "maxComputeInvocationsPerWorkgroup",
    "maxComputeWorkgroupStorageSize",  # TVM's tiled kernel in f32 with GQA group 1 needs ~17.5 KiB
    "maxComputeWorkgroupSizeX", "maxComputeWorkgroupSizeY", "maxComputeWorkgroupSizeZ",
    "maxComputeWorkgroupsPerDimension",
)
BUFFER_LIMITS = ("maxStorageBufferBindingSize", "maxBufferSize")  # weights and long KV caches
REQUESTED_LIMITS = KERNEL_LIMITS + BUFFER_LIMITS
# Chromium's experimental subgroup matrices (the tensor cores) run the prefill matmuls' matrix builds.
SUBGROUP_MATRIX = "chromium-experimental-subgroup-matrix"
# Timestamps written between dispatches inside a compute pass (`Batch.timed`), not only at its ends: a
# span is then timed without a pass of its own (Chromium's experimental name; wgpu's maps to it).
TIMESTAMPS_INSIDE_PASSES = "chromium-experimental-timestamp-query-inside-passes"
OPTIONAL_FEATURES = ("shader-f16", "timestamp-query", "subgroups", SUBGROUP_MATRIX, TIMESTAMPS_INSIDE_PASSES)


class BufferSlice:
    """Bytes [offset, offset + size) of a buffer, bound wherever a whole buffer may be (`Kernel.bind`):
    a tensor larger than one storage binding (maxStorageBufferBindingSize) is bound a slice at a time
    (contract.slices). `offset` is a multiple of BINDING_OFFSET_ALIGN, the alignment every adapter
    accepts (WebGPU's default minStorageBufferOffsetAlignment)."""

    __slots__ = ("buffer", "offset", "size")

    def __init__(self, buffer, offset: int, size: int):
        if offset % BINDING_OFFSET_ALIGN or size <= 0 or size % 4:
            raise ValueError(f"a binding's offset must be a multiple of {BINDING_OFFSET_ALIGN} and its size a "
                             f"positive multiple of 4, not {offset} and {size}")
        self.buffer, self.offset, self.size = buffer, offset, size

    def __repr__(self) -> str:
        return f"BufferSlice(offset={self.offset}, size={self.size})"


def binding_resource(binding) -> dict:
    """A bind group entry's resource (the JS API's and wgpu-py's spelling are the same): a whole
    buffer, or a BufferSlice's range of one."""
    if isinstance(binding, BufferSlice):
        return {"buffer": binding.buffer, "offset": binding.offset, "size": binding.size}
    return {"buffer": binding}


def negotiate_limits(offered, caps: dict[str, int] | None = None) -> dict[str, int]:
    """The limits to request: the adapter's value of each (`offered(name)`), lowered by `caps`.

    `caps` lets tests and benchmarks pretend to be a smaller adapter.
    """
    caps = caps or {}
    return {name: min(int(offered(name)), caps.get(name, 1 << 62)) for name in REQUESTED_LIMITS}


class WebGPUUnavailable(RuntimeError):
    """No usable adapter: the message says what is missing, in words a user can act on."""


class AdapterLimitError(WebGPUUnavailable):
    """The adapter's limits are below what a kernel or buffer of the artifact needs."""


class DeviceLostError(RuntimeError):
    """The GPU device was lost (driver reset, device.destroy(), ...): open a new one to go on."""


def _looks_lost(err: Exception) -> bool:
    text = str(err).lower()
    return "lost" in text or "destroyed" in text


class Device:
    """Backend-independent part. Subclasses implement the `_`-prefixed primitives."""

    backend = "?"

    def __init__(self, adapter_name: str, features: set[str], limits: dict[str, int]):
        self.adapter_name = adapter_name
        self.features = frozenset(features)
        self.limits = limits
        self.has_f16 = "shader-f16" in self.features
        self.has_timestamps = "timestamp-query" in self.features
        self.timestamps_inside_passes = self.has_timestamps and TIMESTAMPS_INSIDE_PASSES in self.features
        # WGSL's dot4I8Packed (the int8 decode matmuls, MatmulSpec.int8_x): a WGSL language feature,
        # not a device feature; wgpu 0.32's naga compiles it (seen on lavapipe and an H200), a
        # browser says whether it does in navigator.gpu.wgslLanguageFeatures (BrowserDevice.open)
        self.has_packed_int8_dot = True
        # The fewest and most invocations a subgroup of this device holds (None without
        # `subgroups`; each backend finds them its own way): a subgroup-layout kernel runs only if
        # its row lanes fit in one (model_glue.model.attention).
        self.subgroup_min_size: int | None = None
        self.subgroup_max_size: int | None = None
        # The subgroup-matrix shapes the adapter multiplies (with SUBGROUP_MATRIX), each as
        # (component type, result type, M, N, K), e.g. ("f16", "f32", 16, 16, 16); wgpu has none.
        self.subgroup_matrix_configs: tuple[tuple[str, str, int, int, int], ...] = ()
        self.live_buffers = 0  # created minus destroyed: a leak shows up as growth
        self.bind_groups_made = 0  # a pass bound once and replayed makes none
        self._reads: dict[int, object] = {}  # id(staging buffer) -> its map, asked for (`start_read`)
        # A CPU rasterizer (lavapipe, SwiftShader): no memory-level parallelism to win by splitting work.
        lowered = adapter_name.lower()
        self.is_cpu = any(word in lowered for word in ("llvmpipe", "lavapipe", "swiftshader", "(cpu)"))
        self.lost_reason: str | None = None  # set once the device is lost

    async def _settle_lost(self) -> None:
        """Let a pending device-lost notification arrive before a failure is classified."""
        await asyncio.sleep(0)

    def _lost(self, err: Exception) -> Exception:
        """`err` as a DeviceLostError when the device is gone, else unchanged."""
        if self.lost_reason is None and not _looks_lost(err):
            return err
        reason = self.lost_reason or str(err).strip().splitlines()[-1]
        return DeviceLostError(f"the GPU device was lost ({reason})")

    # -- buffers ------------------------------------------------------------------------------
    def _buffer(self, size: int, usage: int):
        try:
            buffer = self._create_buffer(size, usage)
        except Exception as err:
            raise self._lost(err) from err
        self.live_buffers += 1
        return buffer

    def storage_buffer(self, nbytes: int, data: bytes | memoryview | None = None):
        """A storage buffer that can also be copied from (readback) and written by the queue."""
        buffer = self._buffer(max(4, _align4(nbytes)), STORAGE | COPY_SRC | COPY_DST)
        if data is not None:
            self.write(buffer, data)
        return buffer

    def uniform_buffer(self, data: bytes):
        buffer = self._buffer(max(16, _align(len(data), 16)), UNIFORM | COPY_DST)
        self.write(buffer, data)
        return buffer

    def destroy(self, buffer) -> None:
        """Free a buffer now (work already submitted that uses it still completes)."""
        self._destroy(buffer)
        self.live_buffers -= 1

    def write(self, buffer, data: bytes | memoryview, offset: int = 0) -> None:
        data = memoryview(data).cast("B")
        if not len(data):
            return  # nothing to write (e.g. an empty page table); wgpu refuses a zero-size write
        if len(data) % 4:  # writeBuffer sizes must be multiples of 4
            data = memoryview(bytes(data) + bytes(4 - len(data) % 4))
        try:
            self._write(buffer, offset, data)
        except Exception as err:
            raise self._lost(err) from err

    async def read(self, buffer, nbytes: int, offset: int = 0) -> bytes:
        """Copy `nbytes` of a buffer back to the host (through a mappable staging buffer)."""
        size = _align4(nbytes)
        staging = self.staging_buffer(size)
        try:
            batch = self.batch()
            batch.copy(buffer, offset, staging, 0, size)
            batch.submit()
            return (await self.read_staging(staging, size))[:nbytes]
        finally:
            self.destroy(staging)

    def staging_buffer(self, nbytes: int):
        """A buffer the host can map and read, filled by copies in a batch (a pass's readback)."""
        return self._buffer(_align4(nbytes), MAP_READ | COPY_DST)

    def start_read(self, staging, nbytes: int) -> None:
        """Ask now for a staging buffer's bytes, to be mapped once the work submitted so far is done
        (`read_staging` takes them). A pass's readback is asked for right after its submit, so the
        wait overlaps the passes behind it: in the browser every map is a round trip to the GPU
        process, and asked for only when the id was wanted it added ~1 ms to every decode step."""
        self._reads[id(staging)] = self._map_start(staging, _align4(nbytes))

    def cancel_read(self, staging) -> None:
        """Forget a read asked for and never taken (its pass abandoned), so the buffer can be reused."""
        if self._reads.pop(id(staging), None) is not None:
            staging.unmap()  # a pending map is cancelled; its promise's rejection is handled

    async def read_staging(self, staging, nbytes: int) -> bytes:
        """Map a staging buffer once the work that fills it is done (or take the map `start_read`
        asked for), and copy its bytes out."""
        try:
            return await self._map_read(staging, _align4(nbytes), self._reads.pop(id(staging), None))
        except Exception as err:
            await self._settle_lost()  # a device-lost notification may still be on its way
            raise self._lost(err) from err

    # -- pipelines ----------------------------------------------------------------------------
    async def compute_pipeline(self, wgsl: str, entry: str, label: str = ""):
        """Compile WGSL; raises RuntimeError with the compiler's messages if it is rejected."""
        return await self._compute_pipeline(wgsl, entry, label or entry)

    def bind_group(self, pipeline, buffers: list):
        """A bind group of `buffers` in binding order: GPU buffers, or BufferSlices of them."""
        self.bind_groups_made += 1
        return self._bind_group(pipeline, buffers)

    def batch(self) -> "Batch":
        return Batch(self)

    def record(self, tape: list, varying=()) -> RecordedPasses:
        """The passes of a Batch's tape, ready to replay (`Batch.replay`); `varying` are the
        BoundKernels whose grid may change between replays."""
        return RecordedPasses(self, tape)

    def timestamps(self, count: int) -> "Timestamps":
        if not self.has_timestamps:
            raise RuntimeError(f"{self.adapter_name} has no timestamp-query feature")
        return Timestamps(self, count)

    def describe(self) -> dict:
        return {
            "adapter": self.adapter_name,
            "backend": self.backend,
            "cpu": self.is_cpu,
            "shader_f16": self.has_f16,
            "timestamp_query": self.has_timestamps,
            "timestamps_inside_passes": self.timestamps_inside_passes,
            "subgroup_min_size": self.subgroup_min_size,
            "subgroup_max_size": self.subgroup_max_size,
            "subgroup_matrix_configs": [f"{a}->{r} {m}x{n}x{k}" for a, r, m, n, k in self.subgroup_matrix_configs],
            "features": sorted(self.features),
        }


class Batch:
    """One command encoder: compute dispatches and copies, submitted together.

    Untimed dispatches share one open compute pass (WebGPU orders their storage accesses
    dispatch by dispatch). A span timed with `timed` stays in that pass where the device writes
    timestamps inside passes (Device.timestamps_inside_passes), else it gets a pass of its own,
    since timestamps are then written only at pass boundaries; a dispatch timed alone (the
    profiler's) always gets its own pass. Fewer passes means less encoding work per decode step.
    """

    def __init__(self, device: Device):
        self.device = device
        self.encoder = device._create_encoder()
        self._open_pass = None
        self._release_after_submit: list = []
        self.dispatches = 0  # compute dispatches encoded so far
        # When a list: every pass boundary and dispatch is also appended to it, so the same
        # passes can later be replayed in one call (`Device.record`, `Batch.replay`).
        self.tape: list | None = None

    def dispatch(self, pipeline, bind_group, grid: tuple[int, int, int], timestamps: tuple | None = None,
                 source=None):
        """Dispatch; `timestamps=(Timestamps, begin_index, end_index)` brackets it alone.
        `source` (a BoundKernel, whose `grid` a replay reads) is what a tape records."""
        if timestamps is not None:
            with self.timed(timestamps, own_pass=True):
                self.dispatch(pipeline, bind_group, grid, source=source)
            return
        if self._open_pass is None:
            self._begin(None)
        self.device._dispatch_in(self._open_pass, pipeline, bind_group, grid)
        self.dispatches += 1
        if self.tape is not None:
            if source is None:
                raise ValueError("a recorded dispatch needs its BoundKernel (source=...)")
            self.tape.append(("dispatch", source))

    def _begin(self, timestamps) -> None:
        self._open_pass = self.device._begin_pass(self.encoder, timestamps)
        if self.tape is not None:
            self.tape.append(("begin", timestamps))

    def stop_recording(self) -> list:
        """End the open pass and hand over the tape (its passes are then complete)."""
        self._close_pass()
        tape, self.tape = self.tape, None
        return tape

    def replay(self, recorded: "RecordedPasses") -> None:
        """Encode passes recorded earlier, reading each dispatch's grid from its BoundKernel now."""
        self._close_pass()
        recorded.encode(self.encoder)
        self.dispatches += recorded.dispatches

    @contextmanager
    def timed(self, timestamps: tuple, own_pass: bool = False):
        """The dispatches inside are bracketed by `timestamps` (Timestamps, begin_index, end_index),
        e.g. a split attention's partial and merge kernels; either index may be None (that end
        writes no timestamp). Where the device writes timestamps inside passes (and not
        `own_pass`), they are written between the dispatches of the open pass; else the dispatches
        run in a compute pass of their own whose start and end write them. Within a pass WebGPU
        still orders each dispatch's storage writes before the next one."""
        if self.device.timestamps_inside_passes and not own_pass:
            queries, begin, end = timestamps
            self._write_timestamp(queries, begin)
            yield
            self._write_timestamp(queries, end)
            return
        self._close_pass()
        self._begin(timestamps)
        try:
            yield
        finally:
            self._close_pass()

    def _write_timestamp(self, queries: "Timestamps", index: int | None) -> None:
        if index is None:
            return
        if self._open_pass is None:
            self._begin(None)
        self.device._write_timestamp(self._open_pass, queries.query_set, index)
        if self.tape is not None:
            self.tape.append(("stamp", queries.query_set, index))

    def _close_pass(self) -> None:
        if self._open_pass is not None:
            self._open_pass.end()
            self._open_pass = None
            if self.tape is not None:
                self.tape.append(("end",))

    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        self._close_pass()
        self.device._copy(self.encoder, src, src_offset, dst, dst_offset, nbytes)

    def resolve(self, timestamps: "Timestamps") -> None:
        self._close_pass()
        self.device._resolve(self.encoder, timestamps)

    def release_after_submit(self, buffer) -> None:
        """Destroy `buffer` once this batch is submitted (one-shot uniforms of a prefill pass)."""
        self._release_after_submit.append(buffer)

    def submit(self) -> None:
        self._close_pass()
        try:
            self.device._submit(self.encoder)
        except Exception as err:
            raise self.device._lost(err) from err
        finally:
            for buffer in self._release_after_submit:
                self.device.destroy(buffer)


class RecordedPasses:
    """Compute passes recorded from a Batch's tape, encoded again with one call per replay (the
    same pipelines, bind groups and timestamp writes; each grid read from its BoundKernel, since
    a per-step kernel's grid may change). This version walks the tape in Python; each backend has a faster one."""

    def __init__(self, device: "Device", tape: list, varying=()):
        if any(op[0] not in ("begin", "dispatch", "stamp", "end") for op in tape):
            raise ValueError("only compute passes can be recorded")
        self.device = device
        self.tape = list(tape)
        self.dispatches = sum(op[0] == "dispatch" for op in tape)

    def encode(self, encoder) -> None:
        device, compute = self.device, None
        for op in self.tape:
            if op[0] == "dispatch":
                bound = op[1]
                device._dispatch_in(compute, bound.kernel.pipeline, bound.bind_group, bound.grid)
            elif op[0] == "begin":
                compute = device._begin_pass(encoder, op[1])
            elif op[0] == "stamp":
                device._write_timestamp(compute, op[1], op[2])
            else:
                compute.end()


class Timestamps:
    """A timestamp query set with its resolve buffer; `read_ns` gives raw u64 ticks in ns."""

    def __init__(self, device: Device, count: int):
        self.device = device
        self.count = count
        self.query_set = device._create_query_set(count)
        self.resolved = device._buffer(8 * count, QUERY_RESOLVE | COPY_SRC)

    async def read_ns(self) -> list[int]:
        raw = await self.device.read(self.resolved, 8 * self.count)
        return list(memoryview(raw).cast("Q"))


def _align4(n: int) -> int:
    return _align(n, 4)


def _align(n: int, k: int) -> int:
    return (n + k - 1) // k * k
