"""The native backend of the WebGPU seam (model_glue.gpu.webgpu): `WgpuDevice` on wgpu-py.

Tests, benchmarks and the native CLI run on it; the browser never imports this module
(`model_glue.gpu.device.open_device` imports it only outside Pyodide). Also here: the measurement of
the subgroup size (wgpu-native reports none) and `WgpuRecordedPasses`, a replay that calls
wgpu-native directly.
"""

from __future__ import annotations

import wgpu

from contract.kernels import MAX_INVOCATIONS
from model_glue.gpu.webgpu import (
    MAP_READ, OPTIONAL_FEATURES, TIMESTAMPS_INSIDE_PASSES, Device, RecordedPasses, WebGPUUnavailable, binding_resource,
    negotiate_limits,
)

# wgpu-py spells WebGPU's "subgroups" feature "subgroup".
WGPU_FEATURE_NAMES = {"subgroups": "subgroup", TIMESTAMPS_INSIDE_PASSES: "timestamp-query-inside-passes"}


def subgroup_probe_wgsl(invocations: int = MAX_INVOCATIONS) -> str:
    """A shader of one workgroup of `invocations` in which every invocation writes its subgroup's
    size (WgpuDevice._probe_subgroup_sizes)."""
    return f"""
@group(0) @binding(0) var<storage, read_write> size: array<u32>;
@compute @workgroup_size({invocations})
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) n: u32) {{ size[i] = n; }}
"""


def _kebab(name: str) -> str:
    return "".join("-" + c.lower() if c.isupper() else c for c in name)


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
            # Measured in a workgroup as large as the subgroup kernels' (MAX_INVOCATIONS): an adapter
            # that picks the size per pipeline (AMD, Intel) may give a small probe another size than
            # those kernels. Still a measurement of one pipeline, not a bound: a compiler that picks
            # the width from the shader itself (Intel's, by register pressure) could differ again.
            opened.subgroup_min_size, opened.subgroup_max_size = opened._probe_subgroup_sizes()
        return opened

    def _probe_subgroup_sizes(self) -> tuple[int | None, int | None]:
        """(min, max) of `subgroup_size` over every invocation of one workgroup of MAX_INVOCATIONS, or
        of as many as the device's limits allow (below that no subgroup kernel runs anyway: loading
        refuses it); wgpu-native reports only WebGPU's default bounds, 4 and 128, as the adapter's.
        (None, None), so that no subgroup kernel runs, if an invocation wrote no size."""
        sizes = self._subgroup_sizes(min(MAX_INVOCATIONS, self.limits["maxComputeInvocationsPerWorkgroup"],
                                         self.limits["maxComputeWorkgroupSizeX"]))
        if 0 in sizes:
            return None, None
        return min(sizes), max(sizes)

    def _subgroup_sizes(self, invocations: int) -> list[int]:
        """What each invocation of one workgroup of `subgroup_probe_wgsl(invocations)` wrote (0: nothing)."""
        module = self._device.create_shader_module(code=subgroup_probe_wgsl(invocations))
        pipeline = self._device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        out = self._device.create_buffer(size=4 * invocations, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        try:
            bind_group = self._device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                                        entries=[{"binding": 0, "resource": {"buffer": out}}])
            encoder = self._device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, bind_group)
            compute.dispatch_workgroups(1)
            compute.end()
            self._device.queue.submit([encoder.finish()])
            return list(memoryview(self._device.queue.read_buffer(out)).cast("I"))
        finally:
            out.destroy()

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
        entries = [{"binding": i, "resource": binding_resource(b)} for i, b in enumerate(buffers)]
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

    def _write_timestamp(self, compute, query_set, index):
        from wgpu.backends.wgpu_native.extras import write_timestamp  # wgpu's native extension

        write_timestamp(compute, query_set, index)

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
            elif op[0] == "stamp":
                device._write_timestamp(compute, op[1], op[2])
            else:
                compute.end()
