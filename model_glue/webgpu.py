"""The one WebGPU seam: a small async device API with two backends.

`BrowserDevice` drives Pyodide's `js.navigator.gpu`; `WgpuDevice` drives wgpu-py (native, used by
tests and benchmarks). Both expose the same methods, so everything above this module runs unchanged
in the browser and natively. The API is async because the browser's WebGPU promises must be awaited.
"""

from __future__ import annotations

import asyncio
import sys
from array import array
from contextlib import contextmanager

# WebGPU's GPUBufferUsage / GPUMapMode bits (identical in the JS API and wgpu-py).
MAP_READ, COPY_SRC, COPY_DST, UNIFORM, STORAGE, QUERY_RESOLVE = 1, 4, 8, 64, 128, 512

# Limits the device asks for, each at the adapter's best value. What the artifact's kernels need of
# them is read from the manifest when a kernel is compiled (model_glue.kernel.unmet_limits) and the
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
OPTIONAL_FEATURES = ("shader-f16", "timestamp-query", "subgroups")
# wgpu-py spells WebGPU's "subgroups" feature "subgroup".
WGPU_FEATURE_NAMES = {"subgroups": "subgroup"}
LOST_WAIT_MS = 200
# Native only: every invocation writes its subgroup's size (WgpuDevice._probe_subgroup_size).
SUBGROUP_PROBE_WGSL = """
@group(0) @binding(0) var<storage, read_write> size: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) n: u32) { size[i] = n; }
"""


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


def _kebab(name: str) -> str:
    return "".join("-" + c.lower() if c.isupper() else c for c in name)


class Device:
    """Backend-independent part. Subclasses implement the `_`-prefixed primitives."""

    backend = "?"

    def __init__(self, adapter_name: str, features: set[str], limits: dict[str, int]):
        self.adapter_name = adapter_name
        self.features = frozenset(features)
        self.limits = limits
        self.has_f16 = "shader-f16" in self.features
        self.has_timestamps = "timestamp-query" in self.features
        # The fewest invocations a subgroup of this device holds (None without `subgroups`): a
        # subgroup-layout kernel runs only if its row lanes fit in one (model_glue.attention).
        self.subgroup_min_size: int | None = None
        self.subgroup_max_size: int | None = None
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
            "shader_f16": self.has_f16,
            "timestamp_query": self.has_timestamps,
            "subgroup_min_size": self.subgroup_min_size,
            "subgroup_max_size": self.subgroup_max_size,
            "features": sorted(self.features),
        }


class Batch:
    """One command encoder: compute dispatches and copies, submitted together.

    Untimed dispatches share one open compute pass (WebGPU orders their storage accesses
    dispatch by dispatch); a timed dispatch gets a pass of its own, because timestamps are written
    at pass boundaries. Fewer passes means less encoding work per decode step.
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
            with self.timed(timestamps):
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
    def timed(self, timestamps: tuple):
        """Dispatches inside run in one compute pass whose start and end write `timestamps`
        (Timestamps, begin_index, end_index): e.g. a split attention's partial and merge kernels.
        Either index may be None (that end writes no timestamp). Within a pass WebGPU still
        orders each dispatch's storage writes before the next one."""
        self._close_pass()
        self._begin(timestamps)
        try:
            yield
        finally:
            self._close_pass()

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
    a per-step kernel's grid may change). This backend's version walks the tape in Python."""

    def __init__(self, device: "Device", tape: list, varying=()):
        if any(op[0] not in ("begin", "dispatch", "end") for op in tape):
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


# ---------------------------------------------------------------------------------------------
# Native backend: wgpu-py
# ---------------------------------------------------------------------------------------------
class WgpuDevice(Device):
    backend = "wgpu"

    def __init__(self, adapter, device, features, limits):
        info = adapter.info
        name = info.get("device") or info.get("description") or "unknown adapter"
        super().__init__(f"{name} ({info.get('backend_type', '?')})", features, limits)
        self.is_cpu = self.is_cpu or info.get("adapter_type") == "CPU"
        self._adapter = adapter
        self._device = device

    @classmethod
    async def open(cls, limit_caps: dict[str, int] | None = None) -> "WgpuDevice":
        """The best adapter (a GPU before a CPU rasterizer); `limit_caps` pretends to be a smaller one."""
        import wgpu

        adapters = wgpu.gpu.enumerate_adapters_sync()
        if not adapters:
            raise WebGPUUnavailable("wgpu found no adapter (is a Vulkan driver installed? try mesa-vulkan-drivers)")
        # Prefer a real GPU over a CPU rasterizer when both are present.
        rank = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
        adapter = min(adapters, key=lambda a: rank.get(a.info.get("adapter_type"), 4))
        limits = negotiate_limits(lambda name: adapter.limits[_kebab(name)], limit_caps)
        features = {f for f in OPTIONAL_FEATURES if WGPU_FEATURE_NAMES.get(f, f) in adapter.features}
        device = adapter.request_device_sync(
            required_features=sorted(WGPU_FEATURE_NAMES.get(f, f) for f in features),
            required_limits={_kebab(k): v for k, v in limits.items()},
        )
        opened = cls(adapter, device, features, limits)
        if "subgroups" in features:
            # The size this adapter's pipelines get (an NVIDIA GPU: always 32). An adapter that picks
            # it per pipeline (AMD, Intel) could give another pipeline another size.
            opened.subgroup_min_size = opened.subgroup_max_size = opened._probe_subgroup_size()
        return opened

    def _probe_subgroup_size(self) -> int:
        """The subgroup size a compute pipeline of 64 invocations gets, read from `subgroup_size`
        (wgpu-native reports only WebGPU's default bounds, 4 and 128, as the adapter's)."""
        import wgpu

        module = self._device.create_shader_module(code=SUBGROUP_PROBE_WGSL)
        pipeline = self._device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        out = self._device.create_buffer(size=4 * 64, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        bind_group = self._device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                                    entries=[{"binding": 0, "resource": {"buffer": out}}])
        encoder = self._device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(1)
        compute.end()
        self._device.queue.submit([encoder.finish()])
        sizes = memoryview(self._device.queue.read_buffer(out)).cast("I")
        size = min(sizes)
        out.destroy()
        return size

    def record(self, tape: list, varying=()) -> RecordedPasses:
        return WgpuRecordedPasses(self, tape)  # reads every grid as it replays

    def _create_buffer(self, size, usage):
        return self._device.create_buffer(size=size, usage=usage)

    def _destroy(self, buffer):
        buffer.destroy()

    def _write(self, buffer, offset, data):
        self._device.queue.write_buffer(buffer, offset, data)

    def _map_start(self, buffer, size):
        return None  # wgpu-py maps synchronously, when the bytes are wanted

    async def _map_read(self, buffer, size, started=None):
        buffer.map_sync(MAP_READ, 0, size)
        data = bytes(buffer.read_mapped(0, size))
        buffer.unmap()
        return data

    async def _compute_pipeline(self, wgsl, entry, label):
        try:
            # naga implements the subgroup built-ins (under the device feature) but not yet WGSL's
            # `enable subgroups;` directive (gfx-rs/wgpu#5555), so the directive goes.
            module = self._device.create_shader_module(code=wgsl.replace("enable subgroups;", ""), label=label)
            return self._device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": entry}, label=label
            )
        except Exception as err:  # wgpu raises GPUValidationError with naga's report
            raise RuntimeError(f"WGSL of {label} rejected by wgpu/naga: {err}") from err

    def _bind_group(self, pipeline, buffers):
        entries = [{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)]
        return self._device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)

    def _create_encoder(self):
        return self._device.create_command_encoder()

    def _begin_pass(self, encoder, timestamps):
        kwargs = {}
        if timestamps is not None:
            queries, begin, end = timestamps
            kwargs["timestamp_writes"] = {"query_set": queries.query_set}
            if begin is not None:
                kwargs["timestamp_writes"]["beginning_of_pass_write_index"] = begin
            if end is not None:
                kwargs["timestamp_writes"]["end_of_pass_write_index"] = end
        return encoder.begin_compute_pass(**kwargs)

    def _dispatch_in(self, compute, pipeline, bind_group, grid):
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(*grid)

    def _copy(self, encoder, src, src_offset, dst, dst_offset, nbytes):
        encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)

    def _create_query_set(self, count):
        return self._device.create_query_set(type="timestamp", count=count)

    def _resolve(self, encoder, timestamps):
        encoder.resolve_query_set(timestamps.query_set, 0, timestamps.count, timestamps.resolved, 0)

    def _submit(self, encoder):
        self._device.queue.submit([encoder.finish()])


class WgpuRecordedPasses(RecordedPasses):
    """wgpu-py wraps every native call in error capturing (profiled here: 12.6 us per dispatch of three
    calls), which made most of a decode step's host time. A replay issues the same calls that already succeeded when the
    passes were recorded, so it calls wgpu-native directly for the dispatches (passes still begin
    and end through wgpu-py, which owns them). A replayed dispatch's validation error still reaches
    the device's uncaptured-error log, not an exception at the call."""

    def encode(self, encoder) -> None:
        from wgpu.backends.wgpu_native._ffi import ffi, lib

        set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
        device, compute, handle = self.device, None, None
        for op in self.tape:
            if op[0] == "dispatch":
                bound = op[1]
                set_pipeline(handle, bound.kernel.pipeline._internal)
                set_bind_group(handle, 0, bound.bind_group._internal, 0, ffi.NULL)
                dispatch(handle, *bound.grid)
            elif op[0] == "begin":
                compute = device._begin_pass(encoder, op[1])
                handle = compute._internal
            else:
                compute.end()


# ---------------------------------------------------------------------------------------------
# Browser backend: Pyodide's js.navigator.gpu
# ---------------------------------------------------------------------------------------------
class BrowserDevice(Device):
    backend = "browser"

    def __init__(self, device, name, features, limits):
        super().__init__(name, features, limits)
        self._device = device
        self._ignore_rejection = None

    @classmethod
    async def open(cls, limit_caps: dict[str, int] | None = None) -> "BrowserDevice":
        import js
        from pyodide.ffi import create_proxy

        gpu = getattr(js.navigator, "gpu", None)
        if gpu is None:
            raise WebGPUUnavailable("this browser has no WebGPU (navigator.gpu is missing)")
        adapter = await gpu.requestAdapter(_js({"powerPreference": "high-performance"}))
        if adapter is None:
            raise WebGPUUnavailable("WebGPU is present but no adapter was granted")
        limits = negotiate_limits(lambda name: getattr(adapter.limits, name), limit_caps)
        features = {f for f in OPTIONAL_FEATURES if adapter.features.has(f)}
        device = await adapter.requestDevice(
            _js({"requiredFeatures": sorted(features), "requiredLimits": limits})
        )
        info = adapter.info
        parts = [str(getattr(info, k, "") or "") for k in ("vendor", "architecture", "device", "description")]
        name = " / ".join(p for p in parts if p) or "unknown adapter"
        opened = cls(device, name, features, limits)
        if "subgroups" in features:
            opened.subgroup_min_size = int(getattr(info, "subgroupMinSize", 0) or 0) or None
            opened.subgroup_max_size = int(getattr(info, "subgroupMaxSize", 0) or 0) or None
        device.lost.then(create_proxy(opened._on_lost))
        return opened

    @property
    def js_device(self):
        """The GPUDevice itself (the fault tests destroy it; the page waits on `lost()`)."""
        return self._device

    def _on_lost(self, info) -> None:
        self.lost_reason = f"{info.reason}: {info.message}" if info.message else str(info.reason)

    async def lost(self) -> str:
        """Waits until the device is lost; returns why."""
        info = await self._device.lost
        if self.lost_reason is None:
            self._on_lost(info)
        return self.lost_reason

    async def _settle_lost(self) -> None:
        # A failed mapAsync and the device's `lost` promise settle in no fixed order: wait for
        # `lost` a little (LOST_WAIT_MS) before deciding whether the device is gone.
        import js
        from pyodide.ffi import create_once_callable

        timer = js.Promise.new(create_once_callable(
            lambda resolve, reject: js.setTimeout(create_once_callable(lambda: resolve(None)), LOST_WAIT_MS)))
        info = await js.Promise.race(js.Array.of(self._device.lost, timer))
        if info is not None and self.lost_reason is None:
            self._on_lost(info)

    def record(self, tape: list, varying=()) -> RecordedPasses:
        import js

        if getattr(js, "replayComputePasses", None) is None:  # static/replay.js, installed by the page
            return RecordedPasses(self, tape)
        return BrowserRecordedPasses(self, tape, varying)

    def _create_buffer(self, size, usage):
        return self._device.createBuffer(_js({"size": size, "usage": usage}))

    def _destroy(self, buffer):
        buffer.destroy()

    def _write(self, buffer, offset, data):
        import js

        array = js.Uint8Array.new(len(data))
        array.assign(data)
        self._device.queue.writeBuffer(buffer, offset, array)

    def _map_start(self, buffer, size):
        from pyodide.ffi import create_proxy

        if self._ignore_rejection is None:  # one proxy for every map: a cancelled map rejects, unseen
            self._ignore_rejection = create_proxy(lambda err: None)
        promise = buffer.mapAsync(MAP_READ, 0, size)
        promise.catch(self._ignore_rejection)
        return promise

    async def _map_read(self, buffer, size, started=None):
        import js

        await (started if started is not None else buffer.mapAsync(MAP_READ, 0, size))
        data = js.Uint8Array.new(buffer.getMappedRange(0, size)).to_bytes()
        buffer.unmap()
        return data

    async def _compute_pipeline(self, wgsl, entry, label):
        module = self._device.createShaderModule(_js({"code": wgsl, "label": label}))
        info = await module.getCompilationInfo()
        errors = [f"{m.lineNum}:{m.linePos} {m.message}" for m in info.messages if m.type == "error"]
        if errors:
            raise RuntimeError(f"WGSL of {label} rejected by the browser: " + "; ".join(errors))
        try:
            return await self._device.createComputePipelineAsync(
                _js({"layout": "auto", "compute": {"module": module, "entryPoint": entry}, "label": label})
            )
        except Exception as err:  # a GPUPipelineError (e.g. uniformity or limits)
            raise RuntimeError(f"pipeline {label} rejected by the browser: {err}") from err

    def _bind_group(self, pipeline, buffers):
        entries = [{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)]
        return self._device.createBindGroup(_js({"layout": pipeline.getBindGroupLayout(0), "entries": entries}))

    def _create_encoder(self):
        return self._device.createCommandEncoder()

    def _begin_pass(self, encoder, timestamps):
        return encoder.beginComputePass(_js(_pass_descriptor(timestamps)))

    def _dispatch_in(self, compute, pipeline, bind_group, grid):
        compute.setPipeline(pipeline)
        compute.setBindGroup(0, bind_group)
        compute.dispatchWorkgroups(*grid)

    def _copy(self, encoder, src, src_offset, dst, dst_offset, nbytes):
        encoder.copyBufferToBuffer(src, src_offset, dst, dst_offset, nbytes)

    def _create_query_set(self, count):
        return self._device.createQuerySet(_js({"type": "timestamp", "count": count}))

    def _resolve(self, encoder, timestamps):
        encoder.resolveQuerySet(timestamps.query_set, 0, timestamps.count, timestamps.resolved, 0)

    def _submit(self, encoder):
        import js

        self._device.queue.submit(js.Array.of(encoder.finish()))


class BrowserRecordedPasses(RecordedPasses):
    """The tape held on the JS side (pipelines, bind groups, pass descriptors), replayed by
    static/replay.js in one Python->JS call: encoding ~180 dispatches through Pyodide's proxies,
    three calls each, costs milliseconds; one call and a grid array cost far less."""

    def __init__(self, device: "BrowserDevice", tape: list, varying=()):
        import js

        super().__init__(device, tape)
        bounds = [op[1] for op in tape if op[0] == "dispatch"]
        self._grids = array("i", [v for bound in bounds for v in bound.grid])
        varying_ids = {id(bound) for bound in varying}
        self._varying = [(d, bound) for d, bound in enumerate(bounds) if id(bound) in varying_ids]
        self._js_grids = js.Int32Array.new(len(self._grids))
        self._js_grids.assign(self._grids)
        ops = js.Array.new()
        for op in tape:
            if op[0] == "dispatch":
                ops.push(js.Array.of(1, op[1].kernel.pipeline, op[1].bind_group))
            elif op[0] == "begin":
                ops.push(js.Array.of(0, _js(_pass_descriptor(op[1]))))
            else:
                ops.push(js.Array.of(2))
        self._ops = ops

    def encode(self, encoder) -> None:
        import js

        changed = False
        for d, bound in self._varying:  # per-step kernels' grids may have changed (a split's S)
            x, y, z = bound.grid
            if self._grids[3 * d] != x or self._grids[3 * d + 1] != y or self._grids[3 * d + 2] != z:
                self._grids[3 * d:3 * d + 3] = array("i", (x, y, z))
                changed = True
        if changed:
            self._js_grids.assign(self._grids)
        js.replayComputePasses(encoder, self._ops, self._js_grids)


def _js(value):
    """Python dicts/lists -> plain JS objects/arrays (JS proxies pass through untouched)."""
    import js
    from pyodide.ffi import to_js

    return to_js(value, dict_converter=js.Object.fromEntries)


def _pass_descriptor(timestamps) -> dict:
    """A GPUComputePassDescriptor (JS spelling) writing (Timestamps, begin, end) indices."""
    desc = {}
    if timestamps is not None:
        queries, begin, end = timestamps
        desc["timestampWrites"] = {"querySet": queries.query_set}
        if begin is not None:
            desc["timestampWrites"]["beginningOfPassWriteIndex"] = begin
        if end is not None:
            desc["timestampWrites"]["endOfPassWriteIndex"] = end
    return desc


def in_browser() -> bool:
    return sys.platform == "emscripten"


async def open_device(limit_caps: dict[str, int] | None = None) -> Device:
    """The browser's device under Pyodide, else wgpu-py's best adapter."""
    if in_browser():
        return await BrowserDevice.open(limit_caps)
    return await WgpuDevice.open(limit_caps)
