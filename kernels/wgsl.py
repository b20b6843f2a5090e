"""What the kernels written as WGSL share: their declared ABI (`WgslKernel`) and their header.

Kernels on subgroup matrices (the tensor cores) are written as WGSL text because TVM 0.27's WebGPU
codegen emits no subgroup-matrix code (its SPIR-V codegen has cooperative matrices) and WebGPU's
subgroup matrices exist only as Chromium's experimental extension
(`chromium_experimental_subgroup_matrix`). Each is made under the same contract as the TVM-built
kernels: its builder returns the WGSL with the ABI it declares, and the build
(kernels.build.build_wgsl_kernel) checks the text against that ABI before it enters the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.kernels import MATRIX_FRAGMENT, MATRIX_SUBGROUP

SUBGROUP = MATRIX_SUBGROUP  # invocations a subgroup: the kernels run only where every subgroup has exactly this many
FRAG = MATRIX_FRAGMENT  # the fragments' M = N = K (an f16 -> f32 subgroup-matrix config the adapter must list)
MAX_WORKGROUP_STORAGE = 32768  # what the kernels may need (an adapter's maxComputeWorkgroupStorageSize)
# Fragment loads and stores need 16-byte aligned rows (Vulkan's cooperative-matrix rule), and the
# driver places workgroup variables in an order of its own: so each variable's size is a multiple of this.
MATRIX_ALIGN_BYTES = 16


@dataclass(frozen=True)
class WgslKernel:
    """A kernel written as WGSL, with the ABI the build checks it against: storage buffers in binding
    order as (name, access, element dtype, WGSL element type), then the PODArgs fields (name, WGSL
    type) and `packGridDimX: u32` in a uniform, the workgroup size and the grid (manifest expressions)."""

    wgsl: str
    entry: str
    buffers: tuple[tuple[str, str, str, str], ...]
    pod: tuple[tuple[str, str], ...]
    workgroup_size: tuple[int, int, int]
    grid: tuple


def matrix_header(buffers, pod, extensions: tuple[str, ...] = ()) -> list[str]:
    """The lines every subgroup-matrix kernel starts with: its extensions, its storage bindings in
    order, then the PODArgs uniform (with TVM's packGridDimX, so the runtime binds it like theirs)."""
    lines = ["diagnostic(off, chromium.subgroup_matrix_uniformity);", "enable f16;"]
    lines += [f"enable {extension};" for extension in extensions]
    lines += ["enable chromium_experimental_subgroup_matrix;", ""]
    lines += [f"@group(0) @binding({i}) var<storage, {access}> {buf} : array<{wgsl_type}>;"
              for i, (buf, access, _dtype, wgsl_type) in enumerate(buffers)]
    lines += ["", "struct PODArgs {"] + [f"  {field}: {wgsl_type}," for field, wgsl_type in pod]
    lines += ["  packGridDimX: u32", "}", f"@group(0) @binding({len(buffers)}) var<uniform> podArgs : PODArgs;", ""]
    return lines


def left(array: str, offset: str, stride: str) -> str:
    """A left (M x K) f16 fragment loaded from a row-major workgroup tile."""
    return f"subgroupMatrixLoad<subgroup_matrix_left<f16, {FRAG}, {FRAG}>, row_major>(&{array}, {offset}, {stride})"


def right(array: str, offset: str, stride: str) -> str:
    """A right (K x N) f16 fragment loaded from a row-major workgroup tile (element (k, n) at k * stride + n)."""
    return f"subgroupMatrixLoad<subgroup_matrix_right<f16, {FRAG}, {FRAG}>, row_major>(&{array}, {offset}, {stride})"


def result_zero() -> str:
    return f"subgroup_matrix_result<f32, {FRAG}, {FRAG}>()"


def result_load(array: str, offset: str, stride: str) -> str:
    """An f32 result fragment loaded back from a row-major workgroup array (after it was stored)."""
    return (f"subgroupMatrixLoad<subgroup_matrix_result<f32, {FRAG}, {FRAG}>, row_major>"
            f"(&{array}, {offset}, {stride})")


def result_store(array: str, offset: str, value: str, stride: str) -> str:
    return f"subgroupMatrixStore<row_major>(&{array}, {offset}, {value}, {stride});"
