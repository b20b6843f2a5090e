"""The browser backend of the WebGPU seam (model_glue.gpu.webgpu): `BrowserDevice` on Pyodide's
`js.navigator.gpu`, and `BrowserRecordedPasses`, whose replay runs in the page (static/replay.js).

Imported only in the browser (`model_glue.gpu.device.open_device` under Pyodide): `js` exists nowhere else.
"""

from __future__ import annotations

from array import array

import js
from pyodide.ffi import create_once_callable, create_proxy, to_js

from model_glue.gpu.webgpu import (
    MAP_READ, OPTIONAL_FEATURES, SUBGROUP_MATRIX, Device, RecordedPasses, WebGPUUnavailable, binding_resource,
    negotiate_limits,
)


def _is_null(value) -> bool:
    """JS null: Pyodide gives it as its own JsNull object, not None."""
    return value is None or type(value).__name__ == "JsNull"


# How long a failed map waits for the device's `lost` promise before the failure is classified.
LOST_WAIT_MS = 200
# The WGSL language feature of dot4I8Packed (navigator.gpu.wgslLanguageFeatures; Device.has_packed_int8_dot)
PACKED_INT8_DOT = "packed_4x8_integer_dot_product"


class BrowserDevice(Device):
    backend = "browser"

    def __init__(self, device, name, features, limits):
        super().__init__(name, features, limits)
        self._device = device
        self._ignore_rejection = None
        # static/replay.js's map helper, installed by the page's worker before Python starts (looked
        # up once: each attribute read on `js` is a crossing into JS)
        self._map_for_reading = getattr(js, "mapForReading", None)

    @classmethod
    async def open(cls, limit_caps: dict[str, int] | None = None) -> "BrowserDevice":
        gpu = getattr(js.navigator, "gpu", None)
        if gpu is None:
            raise WebGPUUnavailable("this browser has no WebGPU (navigator.gpu is missing)")
        adapter = await gpu.requestAdapter(_js({"powerPreference": "high-performance"}))
        if _is_null(adapter):
            raise WebGPUUnavailable("WebGPU is present but the browser granted no adapter (it may be turned off "
                                    "or blocklisted here; chrome://gpu says why)")
        limits = negotiate_limits(lambda name: getattr(adapter.limits, name), limit_caps)
        features = {f for f in OPTIONAL_FEATURES if adapter.features.has(f)}
        device = await adapter.requestDevice(
            _js({"requiredFeatures": sorted(features), "requiredLimits": limits})
        )
        info = adapter.info
        parts = [str(getattr(info, k, "") or "") for k in ("vendor", "architecture", "device", "description")]
        name = " / ".join(p for p in parts if p) or "unknown adapter"
        opened = cls(device, name, features, limits)
        wgsl_features = getattr(gpu, "wgslLanguageFeatures", None)
        opened.has_packed_int8_dot = bool(wgsl_features is not None and not _is_null(wgsl_features)
                                          and wgsl_features.has(PACKED_INT8_DOT))
        if "subgroups" in features:
            # The adapter's supported bounds, no probe: whatever size the browser gives any pipeline
            # (a 256-invocation kernel's too) lies within them, unlike one measured pipeline's. That
            # is enough to run kernels correctly (a relative build needs its row lanes to fit the
            # smallest possible subgroup; an exact build runs only where min == max), not to run the
            # fastest build: an adapter whose sizes range (Intel 8-32, AMD 32-64) never gets an exact
            # build even if every such kernel gets 32 (pick_subgroup_build).
            opened.subgroup_min_size = int(getattr(info, "subgroupMinSize", 0) or 0) or None
            opened.subgroup_max_size = int(getattr(info, "subgroupMaxSize", 0) or 0) or None
        if SUBGROUP_MATRIX in features:
            configs = getattr(info, "subgroupMatrixConfigs", None)
            opened.subgroup_matrix_configs = tuple(
                (str(c.componentType), str(c.resultComponentType), int(c.M), int(c.N), int(c.K))
                for c in ([] if _is_null(configs) else configs))
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
        timer = js.Promise.new(create_once_callable(
            lambda resolve, reject: js.setTimeout(create_once_callable(lambda: resolve(None)), LOST_WAIT_MS)))
        info = await js.Promise.race(js.Array.of(self._device.lost, timer))
        if info is not None and self.lost_reason is None:
            self._on_lost(info)

    def record(self, tape: list, varying=()) -> RecordedPasses:
        if getattr(js, "replayComputePasses", None) is None:  # static/replay.js, installed by the page
            return RecordedPasses(self, tape)
        return BrowserRecordedPasses(self, tape, varying)

    def _create_buffer(self, size, usage):
        return self._device.createBuffer(_js({"size": size, "usage": usage}))

    def _destroy(self, buffer):
        buffer.destroy()

    def _write(self, buffer, offset, data):
        array = js.Uint8Array.new(len(data))
        array.assign(data)
        self._device.queue.writeBuffer(buffer, offset, array)

    def _map_start(self, buffer, size):
        # A cancelled map rejects, unseen: static/replay.js's mapForReading handles that in JS. A
        # .catch() from Python builds Pyodide futures whose callbacks take three more trips through
        # the worker's event loop, every decode step (counted in the page: 5 against 2).
        if self._map_for_reading is not None:
            return self._map_for_reading(buffer, size)
        if self._ignore_rejection is None:  # outside the page's worker: one proxy for every map
            self._ignore_rejection = create_proxy(lambda err: None)
        promise = buffer.mapAsync(MAP_READ, 0, size)
        promise.catch(self._ignore_rejection)
        return promise

    async def _map_read(self, buffer, size, started=None):
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
        entries = [{"binding": i, "resource": binding_resource(b)} for i, b in enumerate(buffers)]
        return self._device.createBindGroup(_js({"layout": pipeline.getBindGroupLayout(0), "entries": entries}))

    def _create_encoder(self):
        return self._device.createCommandEncoder()

    def _begin_pass(self, encoder, timestamps):
        return encoder.beginComputePass(_js(_pass_descriptor(timestamps)))

    def _dispatch_in(self, compute, pipeline, bind_group, grid):
        compute.setPipeline(pipeline)
        compute.setBindGroup(0, bind_group)
        compute.dispatchWorkgroups(*grid)

    def _write_timestamp(self, compute, query_set, index):
        compute.writeTimestamp(query_set, index)

    def _copy(self, encoder, src, src_offset, dst, dst_offset, nbytes):
        encoder.copyBufferToBuffer(src, src_offset, dst, dst_offset, nbytes)

    def _create_query_set(self, count):
        return self._device.createQuerySet(_js({"type": "timestamp", "count": count}))

    def _resolve(self, encoder, timestamps):
        encoder.resolveQuerySet(timestamps.query_set, 0, timestamps.count, timestamps.resolved, 0)

    def _submit(self, encoder):
        self._device.queue.submit(js.Array.of(encoder.finish()))


class BrowserRecordedPasses(RecordedPasses):
    """The tape held on the JS side (pipelines, bind groups, pass descriptors), replayed by
    static/replay.js in one Python->JS call: encoding ~180 dispatches through Pyodide's proxies,
    three calls each, costs milliseconds; one call and a grid array cost far less."""

    def __init__(self, device: "BrowserDevice", tape: list, varying=()):
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
            elif op[0] == "stamp":
                ops.push(js.Array.of(3, op[1], op[2]))
            else:
                ops.push(js.Array.of(2))
        self._ops = ops

    def encode(self, encoder) -> None:
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
