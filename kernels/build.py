"""Compile TIR PrimFuncs to WGSL with apache-tvm and write the artifact (WGSL files + manifest).

We run TVM's own pipeline up to the host/device split (instead of `tvm.compile`) so that the
lowered device kernel is at hand: kernels.abi reads its parameters and launch extents into the
manifest entry. This module only lowers, checks the limits and writes.
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass, replace

import tvm
from tvm import tirx

from kernels.abi import (BINDING_RE, kernel_spec, pod_struct_fields, wgsl_features, workgroup_storage_bytes,
                         workgroup_variables)
from kernels.build_attrs import KEEP_WORKGROUP_BUFFERS_APART
from kernels.wgsl import MATRIX_ALIGN_BYTES, WgslKernel
from contract.artifacts import KERNEL_ARTIFACT_FORMAT, MANIFEST, BufferSpec, KernelSpec
from contract.kernels import MAX_INVOCATIONS, WORKGROUP_STORAGE_BYTES

_tir_build = importlib.import_module("tvm.tirx.build")  # the module; tvm.tirx.build is the function

WEBGPU_TARGET = tvm.target.Target("webgpu", host="llvm")
# The same with WebGPU's subgroup operations (T.webgpu.subgroup_shuffle*): the WGSL then starts with
# `enable subgroups;` and needs a device with the `subgroups` feature.
WEBGPU_SUBGROUPS_TARGET = tvm.target.Target({"kind": "webgpu", "supports_subgroups": True, "host": "llvm"})


@dataclass
class BuiltKernel:
    spec: KernelSpec
    wgsl: str


def build_kernel(name: str, func: tirx.PrimFunc, meta: dict, buffers: tuple[str, ...],
                 max_workgroup_storage: int = WORKGROUP_STORAGE_BYTES, subgroups: bool = False) -> BuiltKernel:
    """Lower `func` for WebGPU (with subgroup operations if `subgroups`) and return its WGSL and
    manifest entry; a kernel written as WGSL (`WgslKernel`) goes to `build_wgsl_kernel` instead.

    Fails when the kernel needs more than WebGPU's default invocations or `max_workgroup_storage`,
    so a kernel that would only run on generous adapters never reaches the artifact, and unless the
    kernel binds exactly the names `buffers` (its spec's: the runtime binds by them).
    """
    if isinstance(func, WgslKernel):  # its entry point takes the artifact's name, as TVM's global_symbol does
        func = replace(func, wgsl=func.wgsl.replace(f"fn {func.entry}(", f"fn {name}("), entry=name)
        return build_wgsl_kernel(name, func, meta, buffers, max_workgroup_storage)
    target = WEBGPU_SUBGROUPS_TARGET if subgroups else WEBGPU_TARGET
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"kernel name {name!r} must be an identifier (it becomes the WGSL entry point)")
    started = time.perf_counter()
    func = func.with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    # Without this, TVM hoists common subexpressions of the host side into extra PODArgs.
    config = {"tirx.disable_cse_tir": True}
    if func.attrs is not None and KEEP_WORKGROUP_BUFFERS_APART in func.attrs:
        config["tirx.disable_storage_rewrite"] = True
    with tvm.transform.PassContext(config=config):
        mod = tirx.transform.BindTarget(target)(mod)
        pipeline, _finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
        mod = pipeline(mod)
        _host_mod, device_mods = _tir_build.split_host_device_mods(mod)
        if len(device_mods) != 1:
            raise ValueError(f"{name}: expected one device module, got {len(device_mods)}")
        (device_target, device_mod), = device_mods.items()
        device_mod = finalize_device()(device_mod)
        kernels = list(device_mod.functions.items())
        if len(kernels) != 1:
            # e.g. a T.tvm_thread_invariant branch: two entry points and a host-side choice.
            raise ValueError(f"{name}: expected one device kernel, got {[gv.name_hint for gv, _ in kernels]}")
        (gvar, kernel), = kernels
        wgsl = _tir_build.codegen_build(device_mod, device_target).inspect_source()

    spec = kernel_spec(name, func, gvar.name_hint, kernel, wgsl, meta)
    spec.compile_seconds = round(time.perf_counter() - started, 3)
    return BuiltKernel(_checked(spec, buffers, max_workgroup_storage), wgsl)


_UNIFORM_RE = re.compile(r"@binding\((\d+)\) var<uniform> podArgs : PODArgs;")
_WORKGROUP_SIZE_RE = re.compile(r"@workgroup_size\((\d+), (\d+), (\d+)\)")


def build_wgsl_kernel(name: str, kernel: WgslKernel, meta: dict, buffers: tuple[str, ...],
                      max_workgroup_storage: int) -> BuiltKernel:
    """The manifest entry of a kernel written as WGSL (kernels.prefill_matmul_matrix) from the ABI it
    declares, after checking that its WGSL declares exactly that: the storage bindings in order
    with their access and element types, the uniform PODArgs after them, the workgroup size and the
    entry point. Then the same limits and buffer names as a TVM-built kernel."""
    wgsl = kernel.wgsl
    declared = [(int(i), access, buf, elem) for i, access, buf, elem in BINDING_RE.findall(wgsl)]
    expected = [(i, access, buf, elem) for i, (buf, access, _dtype, elem) in enumerate(kernel.buffers)]
    problems = []
    if declared != expected:
        problems.append(f"its storage bindings are {declared}, its ABI says {expected}")
    if pod_struct_fields(wgsl) != [*kernel.pod, ("packGridDimX", "u32")]:
        problems.append(f"its PODArgs are {pod_struct_fields(wgsl)}, its ABI says {list(kernel.pod)} + packGridDimX")
    if _UNIFORM_RE.findall(wgsl) != [str(len(kernel.buffers))]:
        problems.append(f"its PODArgs uniform is not bound once, after the {len(kernel.buffers)} storage buffers")
    if [tuple(int(v) for v in size) for size in _WORKGROUP_SIZE_RE.findall(wgsl)] != [kernel.workgroup_size]:
        problems.append(f"its workgroup size is not {kernel.workgroup_size}")
    if kernel.entry != name or not re.search(rf"\bfn {name}\(", wgsl):
        problems.append(f"it has no entry point {name}")
    if "chromium-experimental-subgroup-matrix" in wgsl_features(wgsl):
        unaligned = {var: size for var, size in workgroup_variables(wgsl).items() if size % MATRIX_ALIGN_BYTES}
        if unaligned:
            problems.append(f"its workgroup variables {unaligned} (bytes) are not multiples of {MATRIX_ALIGN_BYTES}: "
                            "the driver may place the fragments' tiles after them, off the alignment their rows need")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))
    spec = KernelSpec(
        name=name, entry=name, wgsl=f"{name}.wgsl",
        buffers=[BufferSpec(i, buf, access, dtype, elem, []) for i, (buf, access, dtype, elem) in enumerate(kernel.buffers)],
        pod=[{"name": field, "type": wgsl_type} for field, wgsl_type in kernel.pod],
        workgroup_size=list(kernel.workgroup_size), grid=list(kernel.grid),
        workgroup_storage_bytes=workgroup_storage_bytes(wgsl), barriers=wgsl.count("workgroupBarrier()"),
        meta={**meta, "source": "wgsl"}, features=wgsl_features(wgsl))
    return BuiltKernel(_checked(spec, buffers, max_workgroup_storage), wgsl)


def _checked(spec: KernelSpec, buffers: tuple[str, ...], max_workgroup_storage: int) -> KernelSpec:
    """`spec`, unless its kernel exceeds the limits it is built within or binds other names than `buffers`."""
    name = spec.name
    if spec.invocations > MAX_INVOCATIONS:
        raise ValueError(f"{name}: {spec.invocations} invocations per workgroup > {MAX_INVOCATIONS}")
    if spec.workgroup_storage_bytes > max_workgroup_storage:
        raise ValueError(f"{name}: {spec.workgroup_storage_bytes} bytes of workgroup storage > {max_workgroup_storage}")
    if sorted(spec.buffer_names) != sorted(buffers):
        raise ValueError(f"{name}: the kernel binds {spec.buffer_names}, but its spec says the runtime binds "
                         f"{list(buffers)} (contract.kernels)")
    return spec


def _build_recipe(recipe):
    built = build_kernel(recipe.name, recipe.make(), recipe.meta, recipe.buffers, recipe.max_workgroup_storage,
                         recipe.subgroups)
    meta = built.spec.meta
    if meta.get("kind") == "decode_attention" and meta["nest"] == "tiled":
        from kernels.decode_attention_tiled import tiled_query_heads_computed

        group = meta["num_qo_heads"] // meta["num_kv_heads"]
        computed = tiled_query_heads_computed(built.spec, meta["num_kv_heads"])
        if computed < group:  # the runtime refuses to run it (model_glue.model.attention.tiled_defect)
            meta["defect"] = (f"TVM's tiled kernel computes only {computed} of the {group} query heads "
                              "of each KV head; the others are never written")
    return built


def build_artifact(out_dir, recipes, *, jobs: int = 2, log=print, reuse=None) -> dict:
    """Build `recipes` (e.g. kernels.catalog.all_recipes(), the served artifact) into `out_dir` (WGSL
    files + manifest.json). The caller passes them: the catalog imports every kernel module, so the
    build importing it would close an import cycle. `reuse`: a folder built by this apache-tvm and
    artifact format (the served artifact, for the tests' set) whose kernels of the same name are copied,
    not compiled again: a kernel's name is derived from everything it is compiled for."""
    import json
    import os
    from concurrent.futures import ProcessPoolExecutor
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    copied = {}
    if reuse is not None and (Path(reuse) / MANIFEST).exists():
        old = json.loads((Path(reuse) / MANIFEST).read_text())
        if (old.get("format"), old.get("tvm")) == (KERNEL_ARTIFACT_FORMAT, tvm.__version__):
            copied = {r.name: old["kernels"][r.name] for r in recipes if r.name in old["kernels"]}
    recipes = [r for r in recipes if r.name not in copied]
    log(f"building {len(recipes)} kernels with apache-tvm {tvm.__version__} ({jobs} processes)"
        + (f", {len(copied)} more copied from {reuse}" if copied else ""))
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            built = list(pool.map(_build_recipe, recipes, chunksize=4))
    else:
        built = [_build_recipe(r) for r in recipes]
    manifest = {"format": KERNEL_ARTIFACT_FORMAT, "tvm": tvm.__version__, "kernels": {}}
    for kernel in built:
        (out / kernel.spec.wgsl).write_text(kernel.wgsl)
        manifest["kernels"][kernel.spec.name] = kernel.spec.to_json()
    for name, entry in copied.items():
        (out / entry["wgsl"]).write_text((Path(reuse) / entry["wgsl"]).read_text())
        manifest["kernels"][name] = entry
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)  # the manifest appears last: its presence means complete
    for stale in set(out.glob("*.wgsl")) - {out / k.spec.wgsl for k in built} - {out / e["wgsl"] for e in copied.values()}:
        stale.unlink()  # kernels renamed or dropped since the last build
    total = sum(k.spec.compile_seconds for k in built)
    log(f"built {len(built)} kernels in {time.perf_counter() - started:.1f} s "
        f"(sum of per-kernel compile times {total:.1f} s) -> {out}")
    return manifest
