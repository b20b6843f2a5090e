"""Dispatch a TVM-built WGSL kernel from its manifest entry (contract.artifacts.KernelSpec).

The entry gives storage buffers in binding order, the PODArgs fields (4 bytes each, then
`packGridDimX: u32`), the workgroup size, and the grid as small expression trees over the kernel's
shape variables and scalars. Nothing here reads WGSL beyond handing it to the compiler.
"""

from __future__ import annotations

import struct

_POD_FORMAT = {"i32": "i", "u32": "I", "f32": "f"}
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    ">>": lambda a, b: a >> b,
    "<<": lambda a, b: a << b,
    "min": min,
    "max": max,
}

from contract.artifacts import KernelSpec
from model_glue.gpu.webgpu import AdapterLimitError


def evaluate(expr, values: dict[str, float]):
    """Evaluate a manifest expression: an int, a variable name, or [op, lhs, rhs]."""
    if isinstance(expr, (int, float)):
        return expr
    if isinstance(expr, str):
        if expr in values:
            return values[expr]
        if expr.endswith("_elem_offset"):
            return 0  # a binding starts where the kernel's buffer starts (a BufferSlice's offset is the bind group's)
        raise KeyError(f"kernel needs a value for '{expr}'")
    op, lhs, rhs = expr
    return _OPS[op](evaluate(lhs, values), evaluate(rhs, values))


def unmet_limits(spec: KernelSpec, limits: dict[str, int]) -> list[str]:
    """What one kernel needs (from its manifest entry) beyond the device's limits, in words."""
    size = spec.workgroup_size
    needs = [
        ("maxStorageBuffersPerShaderStage", len(spec.buffers), "storage buffers it binds"),
        ("maxComputeInvocationsPerWorkgroup", spec.invocations, "invocations per workgroup"),
        ("maxComputeWorkgroupStorageSize", spec.workgroup_storage_bytes, "bytes of workgroup storage"),
        ("maxComputeWorkgroupSizeX", size[0], "workgroup size in x"),
        ("maxComputeWorkgroupSizeY", size[1], "workgroup size in y"),
        ("maxComputeWorkgroupSizeZ", size[2], "workgroup size in z"),
    ]
    return [f"{limit} is {limits[limit]} on this adapter, but kernel {spec.name} needs {need} ({what})"
            for limit, need, what in needs if limit in limits and need > limits[limit]]


class Kernel:
    """A compiled pipeline plus the ABI needed to bind and launch it."""

    def __init__(self, device, spec: KernelSpec, pipeline):
        self.device = device
        self.spec = spec
        self.name = spec.name
        self.pipeline = pipeline
        self.buffer_names = spec.buffer_names

    @classmethod
    async def compile(cls, device, spec: KernelSpec, wgsl: str) -> "Kernel":
        unmet = unmet_limits(spec, device.limits) + [
            f"kernel {spec.name} needs the WebGPU feature {feature}, which this device lacks"
            for feature in spec.features if feature not in device.features]
        if unmet:
            raise AdapterLimitError("this GPU adapter's limits are too low: " + "; ".join(unmet))
        pipeline = await device.compute_pipeline(wgsl, spec.entry, spec.name)
        return cls(device, spec, pipeline)

    def pod_bytes(self, values: dict[str, float], grid_x: int) -> bytes:
        packed = b"".join(
            struct.pack("<" + _POD_FORMAT[f["type"]], evaluate(f["name"], values)) for f in self.spec.pod
        )
        return packed + struct.pack("<I", grid_x)

    def grid(self, values: dict[str, float]) -> tuple[int, int, int]:
        x, y = (int(evaluate(e, values)) for e in self.spec.grid)
        # TVM would pack a wider grid into z; we never launch one.
        most = self.device.limits.get("maxComputeWorkgroupsPerDimension", 65535)
        if x > most or y > most:
            raise AdapterLimitError(f"{self.name}: a grid of {x}x{y} workgroups exceeds "
                                    f"maxComputeWorkgroupsPerDimension={most} on this adapter")
        return (x, y, 1)

    def bind(self, buffers: dict, values: dict[str, float], uniform=None) -> "BoundKernel":
        """Bind named GPU buffers and scalar/shape values; the result can be dispatched repeatedly.

        `buffers` must name exactly the buffers the kernel declares: a missing one cannot be
        bound, and an extra one means the caller and the kernel disagree on the contract. Each is a
        GPU buffer or a model_glue.gpu.webgpu.BufferSlice of one (a tensor past the binding limit).
        `uniform`, when given, is a uniform buffer already holding `values` (shared by several
        bindings of this kernel; its owner frees it).
        """
        if buffers.keys() != set(self.buffer_names):
            missing = sorted(set(self.buffer_names) - buffers.keys())
            extra = sorted(buffers.keys() - set(self.buffer_names))
            raise KeyError(f"{self.name} declares buffers {self.buffer_names}; missing {missing}, not declared {extra}")
        grid = self.grid(values)
        owns_uniform = uniform is None
        if owns_uniform:
            uniform = self.device.uniform_buffer(self.pod_bytes(values, grid[0]))
        ordered = [buffers[n] for n in self.buffer_names] + [uniform]
        return BoundKernel(self, self.device.bind_group(self.pipeline, ordered), grid, uniform if owns_uniform else None)


class BoundKernel:
    def __init__(self, kernel: Kernel, bind_group, grid, uniform):
        self.kernel = kernel
        self.bind_group = bind_group
        self.grid = grid
        self.uniform = uniform  # kept alive with the bind group; None when shared (its owner frees it)

    def update(self, values: dict[str, float]) -> None:
        """New scalar/shape values for the same buffers (rewrites the uniform in place)."""
        self.grid = self.kernel.grid(values)
        self.kernel.device.write(self.uniform, self.kernel.pod_bytes(values, self.grid[0]))

    def dispatch(self, batch, timestamps=None) -> None:
        batch.dispatch(self.kernel.pipeline, self.bind_group, self.grid, timestamps, source=self)

    def release(self) -> None:
        """Free the uniform now (work already submitted still completes)."""
        if self.uniform is not None:
            self.kernel.device.destroy(self.uniform)

    def release_after(self, batch) -> None:
        """A one-shot binding: its uniform is freed once `batch` is submitted."""
        batch.release_after_submit(self.uniform)


class StaleBindingError(RuntimeError):
    """A replayed binding would run a kernel with values from an earlier step."""


class _PlanEntry:
    def __init__(self, bound: BoundKernel, values: dict, shared: "_SharedUniform | None"):
        self.bound = bound
        self.values = dict(values)
        self.shared = shared  # the uniform of a per-step entry
        self.per_step = shared is not None


class _SharedUniform:
    """The uniform that per-step bindings of one kernel in a plan read (e.g. attention in each
    layer: the same context, so one write per step serves all of them)."""

    def __init__(self, kernel: Kernel, values: dict):
        self.kernel = kernel
        self.values = dict(values)
        self.grid = kernel.grid(values)
        self.buffer = kernel.device.uniform_buffer(kernel.pod_bytes(values, self.grid[0]))
        self.used_in_pass = -1

    def set(self, values: dict, pass_number: int) -> None:
        """The values of a dispatch in pass `pass_number`: written if they changed, which only the
        pass's first dispatch of this uniform may do (the GPU reads it when the pass runs)."""
        if values != self.values:
            if self.used_in_pass == pass_number:
                raise StaleBindingError(f"{self.kernel.name}: its per-step dispatches in one pass must share values "
                                        "(they share one uniform)")
            self.grid = self.kernel.grid(values)
            self.kernel.device.write(self.buffer, self.kernel.pod_bytes(values, self.grid[0]))
            self.values = dict(values)
        self.used_in_pass = pass_number


class DispatchPlan:
    """Bound kernels of a pass that repeats (a decode step), replayed in the same order each time.

    Each entry is bound once, with the buffers and values of its first use. The entries of a
    kernel declared `per_step` (decode attention: the context grows every step) share a uniform,
    rewritten once per pass when the values change: one per kernel and distinct values of its
    first pass (a prefill plan, where every entry is per step, has the layers' rms_norm over n
    tokens and the head's over one). For any other entry a change of values is an error, since
    replaying its binding would silently run it with the old ones. Buffers are fixed for the
    plan's life: whoever reallocates a buffer drops the plan (`release`).
    """

    def __init__(self):
        self.entries: list[_PlanEntry] = []
        self._cursor = 0
        self._passes = 0
        # (kernel name, its values in the first pass) -> the uniform those per-step entries share
        self._shared: dict[tuple, _SharedUniform] = {}
        self._shared_by_name: dict[str, list[_SharedUniform]] = {}  # the same uniforms, per kernel (`refresh`)
        self._per_step_entries: list[_PlanEntry] = []

    def start(self) -> None:
        """A new pass: replay from the first entry."""
        self._cursor = 0
        self._passes += 1

    def dispatch(self, batch, kernel: Kernel, buffers: dict, values: dict, *, per_step: bool = False) -> None:
        index = self._cursor
        self._cursor += 1
        if index == len(self.entries):
            shared = None
            if per_step:
                key = (kernel.name, tuple(sorted(values.items())))
                shared = self._shared.get(key)
                if shared is None:
                    shared = self._shared[key] = _SharedUniform(kernel, values)
                    self._shared_by_name.setdefault(kernel.name, []).append(shared)
            bound = kernel.bind(buffers, values, shared.buffer if shared else None)
            self.entries.append(_PlanEntry(bound, values, shared))
            if per_step:
                self._per_step_entries.append(self.entries[-1])
        entry = self.entries[index]
        if entry.bound.kernel is not kernel or entry.per_step != per_step:
            raise StaleBindingError(f"dispatch {index} of the plan was {entry.bound.kernel.name}, now {kernel.name}: "
                                    "a repeated pass must dispatch the same kernels in the same order")
        if per_step:
            shared = entry.shared
            shared.set(values, self._passes)
            entry.bound.grid = shared.grid
            entry.values = shared.values
        elif values != entry.values:
            changed = sorted(k for k in values.keys() | entry.values.keys() if values.get(k) != entry.values.get(k))
            raise StaleBindingError(f"{kernel.name}: values {changed} changed between steps, but it is not "
                                    "declared per_step, so its binding would replay the old ones")
        entry.bound.dispatch(batch)

    def refresh(self, per_step: list) -> None:
        """A new pass that will be replayed, not dispatched: write the per-step kernels' values
        [(kernel, values)] into their shared uniforms and give their entries the new grids."""
        self.start()
        for kernel, values in per_step:
            for shared in self._shared_by_name.get(kernel.name, ()):
                shared.set(values, self._passes)
        for entry in self._per_step_entries:
            entry.bound.grid = entry.shared.grid
            entry.values = entry.shared.values

    @property
    def per_step_kernels(self) -> list[str]:
        return [e.bound.kernel.name for e in self._per_step_entries]

    @property
    def per_step_bounds(self) -> list[BoundKernel]:
        """The bindings whose grid may change between passes (a replay re-reads only theirs)."""
        return [e.bound for e in self._per_step_entries]

    @property
    def uniform_writes_per_step(self) -> int:
        """At most this many uniforms are rewritten per pass (one per per-step kernel)."""
        return len(self._shared)

    def release(self) -> None:
        for entry in self.entries:
            entry.bound.release()
        for shared in self._shared.values():
            shared.kernel.device.destroy(shared.buffer)
        self.entries.clear()
        self._per_step_entries.clear()
        self._shared.clear()
        self._shared_by_name.clear()
