"""Read a kernel's WebGPU ABI out of TVM's lowered device module.

TVM's WGSL codegen binds the device kernel's handle parameters as storage buffers, in parameter
order, then one uniform struct `PODArgs` holding the scalar parameters (4 bytes each) followed by
`packGridDimX: u32`. The launch extents (grid and workgroup size) are `thread_extent` attributes in
the kernel body, written in terms of the same scalar variables. This module turns all of that into
one `KernelSpec` (contract.artifacts documents its fields), the manifest entry the runtime
dispatches from without TVM and without parsing WGSL.
"""

from __future__ import annotations

import re

import tvm
from tvm import tirx

from contract.artifacts import BufferSpec, KernelSpec

# JSON expression trees: an int, a variable name, or [op, lhs, rhs].
_BINARY_OPS = {
    tirx.Add: "+",
    tirx.Sub: "-",
    tirx.Mul: "*",
    tirx.FloorDiv: "//",
    tirx.FloorMod: "%",
    tirx.Div: "//",  # only ever integer division in launch extents
    tirx.Min: "min",
    tirx.Max: "max",
}
_BINARY_OPS[tvm.ir.prim.expr.RShift] = ">>"  # ceildiv by a power of two lowers to a shift
_BINARY_OPS[tvm.ir.prim.expr.LShift] = "<<"
_CALL_OPS = {"tirx.shift_right": ">>", "tirx.shift_left": "<<"}


def expr_to_json(expr):
    """A launch-extent expression as a JSON tree the runtime can evaluate (see model_glue.gpu.kernel)."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return expr.name
    if isinstance(expr, tirx.Cast):
        return expr_to_json(expr.value)
    if isinstance(expr, tvm.ir.expr.Call) and expr.op.name in _CALL_OPS:
        return [_CALL_OPS[expr.op.name], expr_to_json(expr.args[0]), expr_to_json(expr.args[1])]
    for node_type, op in _BINARY_OPS.items():
        if isinstance(expr, node_type):
            return [op, expr_to_json(expr.a), expr_to_json(expr.b)]
    raise ValueError(f"unsupported expression in a launch extent: {expr!r} ({type(expr).__name__})")


def _children(node):
    """Every IR child of a node, found through tvm-ffi reflection (TVM exposes no TIR visitor)."""
    info = type(node).__tvm_ffi_type_info__
    while info is not None:
        for field in info.fields:
            if field.name == "span":
                continue
            yield getattr(node, field.name)
        info = info.parent_type_info


def thread_extents(stmt) -> dict[str, object]:
    """Map 'blockIdx.x' / 'threadIdx.y' ... to their extent expressions."""
    found: dict[str, object] = {}

    def walk(node):
        if isinstance(node, (list, tuple)) or type(node).__name__ == "Array":
            for item in node:
                walk(item)
            return
        if not isinstance(node, (tirx.Stmt, tvm.ir.expr.Expr)):
            return
        if isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            tag = node.node.thread_tag
            if tag in found and not tvm.ir.structural_equal(found[tag], node.value):
                raise ValueError(f"{tag} launched with two different extents")
            found[tag] = node.value
        if isinstance(node, tvm.ir.expr.Expr):
            return  # launch attributes live on statements only
        for child in _children(node):
            walk(child)

    walk(stmt)
    return found


def _device_kernel_abi(func: tirx.PrimFunc) -> dict:
    """ABI of one lowered device kernel: bindings, PODArgs, workgroup size and grid."""
    handles, pods = [], []
    for param in func.params:
        if isinstance(param.ty, tvm.ir.PointerType):
            handles.append(param.name)
        else:
            pods.append({"name": param.name, "type": str(param.ty)})
    extents = thread_extents(func.body)
    workgroup_size = []
    for axis in "xyz":
        extent = extents.get(f"threadIdx.{axis}", 1)
        extent = expr_to_json(extent) if not isinstance(extent, int) else extent
        if not isinstance(extent, int):
            raise ValueError(f"threadIdx.{axis} has a non-constant extent {extent}")
        workgroup_size.append(extent)
    grid = []
    for axis in "xy":
        extent = extents.get(f"blockIdx.{axis}", 1)
        grid.append(extent if isinstance(extent, int) else expr_to_json(extent))
    if "blockIdx.z" in extents:
        raise ValueError("blockIdx.z is reserved by TVM's WGSL codegen for packing wide grids")
    return {"handles": handles, "pod": pods, "workgroup_size": workgroup_size, "grid": grid}


# What the WGSL declares, read at build time only (the runtime never parses WGSL).
_WGSL_SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2}
BINDING_RE = re.compile(r"@binding\((\d+)\) var<storage, (read|read_write)> (\w+) : array<(\w+|vec\d<\w+>)>")
_WORKGROUP_RE = re.compile(r"var<workgroup> (\w+) : array<(?:vec(\d)<(\w+)>|atomic<(\w+)>|(\w+)), (\d+)>")
_WORKGROUP_SCALAR_RE = re.compile(r"var<workgroup> (\w+) : (?:atomic<(\w+)>|(\w+));")
_POD_STRUCT_RE = re.compile(r"struct PODArgs \{(.*?)\}", re.S)
_ENABLE_RE = re.compile(r"^enable (\w+);", re.M)
WGSL_EXTENSION_FEATURES = {"f16": "shader-f16", "subgroups": "subgroups",  # WGSL `enable` -> device feature
                           "chromium_experimental_subgroup_matrix": "chromium-experimental-subgroup-matrix"}


def wgsl_features(wgsl: str) -> list[str]:
    """The WebGPU device features a WGSL module's `enable` directives need."""
    return sorted(WGSL_EXTENSION_FEATURES[ext] for ext in _ENABLE_RE.findall(wgsl))


def workgroup_variables(wgsl: str) -> dict[str, int]:
    """Each `var<workgroup>` array or scalar a WGSL module declares, and its bytes."""
    sizes = {}
    for name, lanes, vec_elem, atomic_elem, scalar_elem, count in _WORKGROUP_RE.findall(wgsl):
        sizes[name] = _WGSL_SCALAR_BYTES[vec_elem or atomic_elem or scalar_elem] * int(lanes or 1) * int(count)
    for name, atomic, plain in _WORKGROUP_SCALAR_RE.findall(wgsl):
        sizes[name] = _WGSL_SCALAR_BYTES[atomic or plain]
    return sizes


def workgroup_storage_bytes(wgsl: str) -> int:
    """Bytes of `var<workgroup>` arrays and scalars declared in a WGSL module."""
    return sum(workgroup_variables(wgsl).values())


def pod_struct_fields(wgsl: str) -> list[tuple[str, str]]:
    """(name, type) of the PODArgs uniform struct, as the WGSL declares it."""
    match = _POD_STRUCT_RE.search(wgsl)
    if match is None:
        return []
    fields = [line.strip().rstrip(",") for line in match.group(1).splitlines() if line.strip()]
    return [tuple(part.strip() for part in field.split(":")) for field in fields]


def kernel_spec(name: str, func: tirx.PrimFunc, entry: str, kernel: tirx.PrimFunc, wgsl: str,
                meta: dict) -> KernelSpec:
    """The manifest entry of `func`, from its lowered device `kernel` and the WGSL emitted for it."""
    abi = _device_kernel_abi(kernel)
    declared = {int(i): (mode, elem) for i, mode, _var, elem in BINDING_RE.findall(wgsl)}
    originals = {p.name: p for p in func.params if isinstance(p.ty, tirx.BufferType)}
    buffers = []
    for index, handle in enumerate(abi["handles"]):
        mode, elem = declared[index]
        buf = originals[handle[: -len("_ptr")] if handle.endswith("_ptr") else handle]
        buffers.append(BufferSpec(binding=index, name=buf.name, access=mode, dtype=str(buf.dtype), wgsl_type=elem,
                                  shape=[expr_to_json(dim) for dim in buf.shape]))
    # TVM narrows 64-bit scalars (element offsets) to i32 in WGSL: the struct is the authority.
    struct = pod_struct_fields(wgsl)
    if [field for field, _ in struct] != [p["name"] for p in abi["pod"]] + ["packGridDimX"]:
        raise ValueError(f"{name}: PODArgs {struct} do not match the kernel's scalar parameters {abi['pod']}")
    return KernelSpec(
        name=name, entry=entry, wgsl=f"{name}.wgsl", buffers=buffers,
        pod=[{"name": field, "type": wgsl_type} for field, wgsl_type in struct[:-1]],
        workgroup_size=abi["workgroup_size"], grid=abi["grid"],
        workgroup_storage_bytes=workgroup_storage_bytes(wgsl), barriers=wgsl.count("workgroupBarrier()"),
        meta=dict(meta), features=wgsl_features(wgsl))
