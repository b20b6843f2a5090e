"""Dispatch a TVM-built WGSL kernel from its manifest entry (see kernels.build for how it is made).

The manifest gives, per kernel: storage buffers in binding order, the PODArgs fields (4 bytes each,
then `packGridDimX: u32`), the workgroup size, and the grid as small expression trees over the
kernel's shape variables and scalars. Nothing here reads WGSL beyond handing it to the compiler.
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

from model_glue.webgpu import AdapterLimitError


def evaluate(expr, values: dict[str, float]):
    """Evaluate a manifest expression: an int, a variable name, or [op, lhs, rhs]."""
    if isinstance(expr, (int, float)):
        return expr
    if isinstance(expr, str):
        if expr in values:
            return values[expr]
        if expr.endswith("_elem_offset"):
            return 0  # we always bind whole buffers
        raise KeyError(f"kernel needs a value for '{expr}'")
    op, lhs, rhs = expr
    return _OPS[op](evaluate(lhs, values), evaluate(rhs, values))


def unmet_limits(spec: dict, limits: dict[str, int]) -> list[str]:
    """What one kernel needs (from its manifest entry) beyond the device's limits, in words."""
    size = spec["workgroup_size"]
    needs = [
        ("maxStorageBuffersPerShaderStage", len(spec["buffers"]), "storage buffers it binds"),
        ("maxComputeInvocationsPerWorkgroup", size[0] * size[1] * size[2], "invocations per workgroup"),
        ("maxComputeWorkgroupStorageSize", spec["workgroup_storage_bytes"], "bytes of workgroup storage"),
        ("maxComputeWorkgroupSizeX", size[0], "workgroup size in x"),
        ("maxComputeWorkgroupSizeY", size[1], "workgroup size in y"),
        ("maxComputeWorkgroupSizeZ", size[2], "workgroup size in z"),
    ]
    return [f"{limit} is {limits[limit]} on this adapter, but kernel {spec['name']} needs {need} ({what})"
            for limit, need, what in needs if limit in limits and need > limits[limit]]


class Kernel:
    """A compiled pipeline plus the ABI needed to bind and launch it."""

    def __init__(self, device, spec: dict, pipeline):
        self.device = device
        self.spec = spec
        self.name = spec["name"]
        self.pipeline = pipeline
        self.buffer_names = [b["name"] for b in spec["buffers"]]

    @classmethod
    async def compile(cls, device, spec: dict, wgsl: str) -> "Kernel":
        unmet = unmet_limits(spec, device.limits)
        if unmet:
            raise AdapterLimitError("this GPU adapter's limits are too low: " + "; ".join(unmet))
        pipeline = await device.compute_pipeline(wgsl, spec["entry"], spec["name"])
        return cls(device, spec, pipeline)

    def pod_bytes(self, values: dict[str, float], grid_x: int) -> bytes:
        packed = b"".join(
            struct.pack("<" + _POD_FORMAT[f["type"]], evaluate(f["name"], values)) for f in self.spec["pod"]
        )
        return packed + struct.pack("<I", grid_x)

    def grid(self, values: dict[str, float]) -> tuple[int, int, int]:
        x, y = (int(evaluate(e, values)) for e in self.spec["grid"])
        # TVM would pack a wider grid into z; we never launch one.
        most = self.device.limits.get("maxComputeWorkgroupsPerDimension", 65535)
        if x > most or y > most:
            raise AdapterLimitError(f"{self.name}: a grid of {x}x{y} workgroups exceeds "
                                    f"maxComputeWorkgroupsPerDimension={most} on this adapter")
        return (x, y, 1)

    def bind(self, buffers: dict, values: dict[str, float]) -> "BoundKernel":
        """Bind named GPU buffers and scalar/shape values; the result can be dispatched repeatedly."""
        missing = [n for n in self.buffer_names if n not in buffers]
        if missing:
            raise KeyError(f"{self.name}: missing buffers {missing}")
        grid = self.grid(values)
        uniform = self.device.uniform_buffer(self.pod_bytes(values, grid[0]))
        ordered = [buffers[n] for n in self.buffer_names] + [uniform]
        return BoundKernel(self, self.device.bind_group(self.pipeline, ordered), grid, uniform)


class BoundKernel:
    def __init__(self, kernel: Kernel, bind_group, grid, uniform):
        self.kernel = kernel
        self.bind_group = bind_group
        self.grid = grid
        self.uniform = uniform  # kept alive with the bind group

    def update(self, values: dict[str, float]) -> None:
        """New scalar/shape values for the same buffers (rewrites the uniform in place)."""
        self.grid = self.kernel.grid(values)
        self.kernel.device.write(self.uniform, self.kernel.pod_bytes(values, self.grid[0]))

    def dispatch(self, batch, timestamps=None) -> None:
        batch.dispatch(self.kernel.pipeline, self.bind_group, self.grid, timestamps)

    def release(self) -> None:
        """Free the uniform now (work already submitted still completes)."""
        self.kernel.device.destroy(self.uniform)

    def release_after(self, batch) -> None:
        """A one-shot binding: its uniform is freed once `batch` is submitted."""
        batch.release_after_submit(self.uniform)
