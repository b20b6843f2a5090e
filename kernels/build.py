"""Compile TIR PrimFuncs to WGSL with apache-tvm and describe each one's ABI in a manifest entry.

We run TVM's own pipeline up to the host/device split (instead of `tvm.compile`) so that the
lowered device kernel is at hand: its parameters and launch extents are the ABI (see kernels.abi).
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass

import tvm
from tvm import tirx

from kernels.abi import device_kernel_abi, expr_to_json

_tir_build = importlib.import_module("tvm.tirx.build")  # the module; tvm.tirx.build is the function

WEBGPU_TARGET = tvm.target.Target("webgpu", host="llvm")
# Our own kernels stay within WebGPU's default workgroup storage. TVM's tiled decode kernel in f32
# with GQA group 1 needs ~17.5 KiB; adapters we target (lavapipe, SwiftShader, NVIDIA) offer 32 KiB
# and the device asks for what the adapter has, so the tiled nest is held to that instead.
DEFAULT_WORKGROUP_STORAGE_BYTES = 16384
MAX_INVOCATIONS = 256

_WGSL_SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2}
_BINDING_RE = re.compile(r"@binding\((\d+)\) var<storage, (read|read_write)> (\w+) : array<(\w+|vec\d<\w+>)>")
_WORKGROUP_RE = re.compile(r"var<workgroup> (\w+) : array<(?:vec(\d)<(\w+)>|(\w+)), (\d+)>")
_POD_STRUCT_RE = re.compile(r"struct PODArgs \{(.*?)\}", re.S)


@dataclass
class BuiltKernel:
    name: str
    wgsl: str
    abi: dict
    compile_seconds: float


def workgroup_storage_bytes(wgsl: str) -> int:
    """Bytes of `var<workgroup>` arrays declared in a WGSL module (read at build time only)."""
    total = 0
    for _name, lanes, vec_elem, scalar_elem, count in _WORKGROUP_RE.findall(wgsl):
        elem_bytes = _WGSL_SCALAR_BYTES[vec_elem or scalar_elem] * int(lanes or 1)
        total += elem_bytes * int(count)
    return total


def pod_struct_fields(wgsl: str) -> list[tuple[str, str]]:
    """(name, type) of the PODArgs uniform struct, as the WGSL declares it."""
    match = _POD_STRUCT_RE.search(wgsl)
    if match is None:
        return []
    fields = [line.strip().rstrip(",") for line in match.group(1).splitlines() if line.strip()]
    return [tuple(part.strip() for part in field.split(":")) for field in fields]


def _buffer_params(func: tirx.PrimFunc) -> dict:
    """The PrimFunc's buffer parameters by name (in tirx a buffer parameter is a buffer-typed Var)."""
    return {p.name: p for p in func.params if isinstance(p.ty, tirx.BufferType)}


def _shape_json(buffer) -> list:
    return [expr_to_json(dim) for dim in buffer.shape]


def build_kernel(name: str, func: tirx.PrimFunc, meta: dict | None = None,
                 max_workgroup_storage: int = DEFAULT_WORKGROUP_STORAGE_BYTES) -> BuiltKernel:
    """Lower `func` for WebGPU and return its WGSL and manifest entry.

    Fails when the kernel needs more than WebGPU's default workgroup storage or invocations, so a
    kernel that would only run on generous adapters never reaches the artifact.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"kernel name {name!r} must be an identifier (it becomes the WGSL entry point)")
    started = time.perf_counter()
    func = func.with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    # Without this, TVM hoists common subexpressions of the host side into extra PODArgs.
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        mod = tirx.transform.BindTarget(WEBGPU_TARGET)(mod)
        pipeline, _finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(WEBGPU_TARGET)
        mod = pipeline(mod)
        _host_mod, device_mods = _tir_build.split_host_device_mods(mod)
        if len(device_mods) != 1:
            raise ValueError(f"{name}: expected one device module, got {len(device_mods)}")
        (target, device_mod), = device_mods.items()
        device_mod = finalize_device()(device_mod)
        kernels = list(device_mod.functions.items())
        if len(kernels) != 1:
            # e.g. a T.tvm_thread_invariant branch: two entry points and a host-side choice.
            raise ValueError(f"{name}: expected one device kernel, got {[gv.name_hint for gv, _ in kernels]}")
        (gvar, kernel), = kernels
        wgsl = _tir_build.codegen_build(device_mod, target).inspect_source()

    abi = device_kernel_abi(kernel)
    declared = {int(i): (mode, var, elem) for i, mode, var, elem in _BINDING_RE.findall(wgsl)}
    originals = _buffer_params(func)
    buffers = []
    for index, handle in enumerate(abi.pop("handles")):
        mode, var, elem = declared[index]
        data_name = handle[: -len("_ptr")] if handle.endswith("_ptr") else handle
        buf = originals[data_name]
        buffers.append({
            "binding": index,
            "name": buf.name,
            "access": mode,
            "dtype": str(buf.dtype),
            "wgsl_type": elem,
            "shape": _shape_json(buf),
        })
    # TVM narrows 64-bit scalars (element offsets) to i32 in WGSL: the struct is the authority.
    struct = pod_struct_fields(wgsl)
    if [name for name, _ in struct] != [p["name"] for p in abi["pod"]] + ["packGridDimX"]:
        raise ValueError(f"{name}: PODArgs {struct} do not match the kernel's scalar parameters {abi['pod']}")
    abi["pod"] = [{"name": field, "type": wgsl_type} for field, wgsl_type in struct[:-1]]
    invocations = abi["workgroup_size"][0] * abi["workgroup_size"][1] * abi["workgroup_size"][2]
    storage = workgroup_storage_bytes(wgsl)
    if invocations > MAX_INVOCATIONS:
        raise ValueError(f"{name}: {invocations} invocations per workgroup > {MAX_INVOCATIONS}")
    if storage > max_workgroup_storage:
        raise ValueError(f"{name}: {storage} bytes of workgroup storage > {max_workgroup_storage}")
    scalars = [p.name for p in func.params if p.name not in originals]
    manifest = {
        "name": name,
        "entry": gvar.name_hint,
        "wgsl": f"{name}.wgsl",
        "buffers": buffers,
        "pod": abi["pod"],
        "scalars": scalars,
        "workgroup_size": abi["workgroup_size"],
        "grid": abi["grid"],
        "workgroup_storage_bytes": storage,
        "barriers": wgsl.count("workgroupBarrier()"),
        "meta": meta or {},
    }
    return BuiltKernel(name, wgsl, manifest, time.perf_counter() - started)


def _build_recipe(recipe):
    built = build_kernel(recipe.name, recipe.make(), recipe.meta, recipe.max_workgroup_storage)
    meta = built.abi["meta"]
    if meta.get("kind") == "decode_attention" and meta["nest"] == "tiled":
        from kernels.decode_attention import tiled_query_heads_computed

        group = meta["num_qo_heads"] // meta["num_kv_heads"]
        computed = tiled_query_heads_computed(built.abi, meta["num_kv_heads"])
        if computed < group:  # the runtime refuses to run it (model_glue.attention.tiled_defect)
            meta["defect"] = (f"TVM's tiled kernel computes only {computed} of the {group} query heads "
                              "of each KV head; the others are never written")
    return built


def build_artifact(out_dir, *, jobs: int = 2, log=print) -> dict:
    """Build every kernel of the catalog into `out_dir` (WGSL files + manifest.json)."""
    import json
    import os
    from concurrent.futures import ProcessPoolExecutor
    from pathlib import Path

    from kernels.catalog import all_recipes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipes = all_recipes()
    started = time.perf_counter()
    log(f"building {len(recipes)} kernels with apache-tvm {tvm.__version__} ({jobs} processes)")
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            built = list(pool.map(_build_recipe, recipes, chunksize=4))
    else:
        built = [_build_recipe(r) for r in recipes]
    manifest = {"format": 1, "tvm": tvm.__version__, "kernels": {}}
    for kernel in built:
        (out / f"{kernel.name}.wgsl").write_text(kernel.wgsl)
        kernel.abi["compile_seconds"] = round(kernel.compile_seconds, 3)
        manifest["kernels"][kernel.name] = kernel.abi
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")  # the manifest appears last: its presence means complete
    for stale in set(out.glob("*.wgsl")) - {out / f"{k.name}.wgsl" for k in built}:
        stale.unlink()  # kernels renamed or dropped since the last build
    total = sum(k.compile_seconds for k in built)
    log(f"built {len(built)} kernels in {time.perf_counter() - started:.1f} s "
        f"(sum of per-kernel compile times {total:.1f} s) -> {out}")
    return manifest
