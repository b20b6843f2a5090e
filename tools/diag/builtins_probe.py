#!/usr/bin/env python3
"""Which subgroup-matrix pattern of the matrix prefill attention goes wrong on this GPU: small kernels,
one workgroup of four subgroups each, that repeat the attention's two fragment chains with one pattern
changed at a time, run in Chromium on exact small-integer data (every sum exact in f32) and compared
with a float64 product in the page. Standard library only, on the GPU machine after gpu_page.py's
`receive` and `gl` steps:

  python3 tools/diag/builtins_probe.py [--set blog-f16]      prints a line per kernel, writes $OUT/builtins.json

S chain (S_t = Q K_t for tiles t = 0, 1; Q 64 x 64, K_t 64 x 32):
  held      Q's fragments loaded once before the tile loop (else loaded in each tile)
  arrays    "apart": Q and K in arrays of their own; "same": one array, disjoint regions;
            "overlap": Q staged where K goes, loaded, then overwritten (the attention's kv_tile)
  out       "wg": results stored to a workgroup f32 array, then copied out; "storage": stored straight out
  lead      a 4-byte atomic workgroup variable declared before the tiles (the attention's first builds had
            two): if the driver places it first, every tile starts 4 bytes off 16-byte alignment
PV chain (O = sum_t r O + P_t V_t; P_t 64 x 32, V_t 32 x 64; O's four fragments held across tiles):
  rescale   O stored to workgroup memory, halved by plain code, loaded back as a result fragment each tile
  owner     that round trip done by one subgroup at a time (under `if (subgroup == k)`), as the attention does
  arrays    P and V apart or in one array; out as above
"""

from __future__ import annotations

import argparse
import functools
import http.server
import itertools
import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / ".cr"))

HEADER = ("diagnostic(off, chromium.subgroup_matrix_uniformity);\nenable f16;\n"
          "enable chromium_experimental_subgroup_matrix;\n\n")
TILES = 2
ROWS, D, KEYS = 64, 64, 32
QS, KS, SS = 72, 40, 36  # the attention's strides at head_dim 64 (f16 halves, f16 halves, f32)
PS, VS, OS = 40, 72, 68


def left(array: str, offset: str, stride: int) -> str:
    return f"subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&{array}, {offset}, {stride}u)"


def right(array: str, offset: str, stride: int) -> str:
    return f"subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&{array}, {offset}, {stride}u)"


def s_chain(held: bool, arrays: str, out: str) -> str:
    """a: Q [64][64], b: K_t [64 d][32 keys] per tile, c: S_t [64][32] per tile."""
    if arrays == "apart":
        decl = f"var<workgroup> q_tile : array<f16, {ROWS * QS}>;\nvar<workgroup> k_tile : array<f16, {D * KS}>;\n"
        q_arr, q_off, k_arr = "q_tile", 0, "k_tile"
    elif arrays == "same":
        decl = f"var<workgroup> k_tile : array<f16, {D * KS + ROWS * QS}>;\n"
        q_arr, q_off, k_arr = "k_tile", D * KS, "k_tile"
    else:
        decl = f"var<workgroup> k_tile : array<f16, {max(D * KS, ROWS * QS)}>;\n"
        q_arr, q_off, k_arr = "k_tile", 0, "k_tile"
    decl += f"var<workgroup> out_tile : array<f32, {ROWS * SS}>;\n"
    loads = [f"{'var' if held else 'let'} q{kk} = " + left(q_arr, f"{q_off}u + subgroup * {16 * QS}u + {kk * 16}u", QS) + ";"
             for kk in range(D // 16)]
    body = []
    for j in range(KEYS // 16):
        chain = [f"      s = subgroupMatrixMultiplyAccumulate(q{kk}, {right(k_arr, f'{kk * 16 * KS + j * 16}u', KS)}, s);"
                 for kk in range(D // 16)]
        store = (f"      subgroupMatrixStore<row_major>(&out_tile, subgroup * {16 * SS}u + {j * 16}u, s, {SS}u);"
                 if out == "wg" else
                 f"      subgroupMatrixStore<row_major>(&c, u32(t) * {ROWS * KEYS}u + subgroup * {16 * KEYS}u + {j * 16}u, s, {KEYS}u);")
        body += ["    { var s = subgroup_matrix_result<f32, 16, 16>();", *chain, store, "    }"]
    copy = ["    workgroupBarrier();",
            f"    for (var e = tid; e < {ROWS * KEYS}u; e = e + 128u) {{",
            f"      c[u32(t) * {ROWS * KEYS}u + e] = out_tile[(e / {KEYS}u) * {SS}u + e % {KEYS}u];", "    }"] if out == "wg" else []
    return "\n".join([
        *kernel_start(decl),
        f"  for (var e = tid; e < {ROWS * D}u; e = e + 128u) {{ {q_arr}[{q_off}u + (e / {D}u) * {QS}u + e % {D}u] = f16(a[e]); }}",
        "  workgroupBarrier();",
        *(["  " + x for x in loads] if held else []),
        f"  for (var t = 0; t < {TILES}; t = t + 1) {{",
        "    workgroupBarrier();",
        f"    for (var e = tid; e < {D * KEYS}u; e = e + 128u) {{ {k_arr}[(e / {KEYS}u) * {KS}u + e % {KEYS}u] = f16(b[u32(t) * {D * KEYS}u + e]); }}",
        "    workgroupBarrier();",
        *([] if held else ["    " + x for x in loads]),
        *body, *copy, "  }", "}", ""])


def kernel_start(decl: str) -> list[str]:
    """Every probe kernel's first lines: a, b in and c out (f32 storage), its workgroup arrays, the entry point."""
    return [HEADER + "@group(0) @binding(0) var<storage, read> a : array<f32>;",
            "@group(0) @binding(1) var<storage, read> b : array<f32>;",
            "@group(0) @binding(2) var<storage, read_write> c : array<f32>;", decl,
            "@compute @workgroup_size(128, 1, 1)",
            "fn main(@builtin(local_invocation_index) tid : u32) {",
            "  let subgroup = tid / 32u;"]


def pv_chain(rescale: bool, owner: bool, arrays: str, out: str) -> str:
    """a: P_t [64][32] per tile, b: V_t [32 keys][64 d] per tile, c: O [64][64]."""
    p_off = KEYS * VS if arrays == "same" else 0
    decl = (f"var<workgroup> v_tile : array<f16, {KEYS * VS + ROWS * PS}>;\n" if arrays == "same" else
            f"var<workgroup> p_tile : array<f16, {ROWS * PS}>;\nvar<workgroup> v_tile : array<f16, {KEYS * VS}>;\n")
    p_arr = "v_tile" if arrays == "same" else "p_tile"
    o_rows = 16 if owner else ROWS  # one subgroup's O at a time, or all four in their own regions
    decl += f"var<workgroup> o_tile : array<f32, {o_rows * OS}>;\n"
    frags = D // 16
    base = "0u" if owner else f"subgroup * {16 * OS}u"

    def round_trip() -> list[str]:
        stores = [f"subgroupMatrixStore<row_major>(&o_tile, {base} + {j * 16}u, o{j}, {OS}u);" for j in range(frags)]
        loads = [f"o{j} = subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>, row_major>(&o_tile, {base} + {j * 16}u, {OS}u);"
                 for j in range(frags)]
        halve = [f"for (var e = tid; e < {o_rows * D}u; e = e + 128u) {{ let at = (e / {D}u) * {OS}u + e % {D}u; "
                 "o_tile[at] = o_tile[at] * 0.5f; }"]
        if not owner:
            return [*stores, "workgroupBarrier();", *halve, "workgroupBarrier();", *loads, "workgroupBarrier();"]
        lines = []
        for k in range(4):
            lines += [f"if (subgroup == {k}u) {{", *["  " + s for s in stores], "}", "workgroupBarrier();", *halve,
                      "workgroupBarrier();", f"if (subgroup == {k}u) {{", *["  " + s for s in loads], "}", "workgroupBarrier();"]
        return lines

    mma = []
    for j in range(frags):
        for kk in range(KEYS // 16):
            mma.append(f"    o{j} = subgroupMatrixMultiplyAccumulate(p{kk}, {right('v_tile', f'{kk * 16 * VS + j * 16}u', VS)}, o{j});")
    if out == "wg":
        end = []
        stores = [f"subgroupMatrixStore<row_major>(&o_tile, {base} + {j * 16}u, o{j}, {OS}u);" for j in range(frags)]
        for k in (range(4) if owner else [None]):
            end += ([f"  if (subgroup == {k}u) {{", *["    " + s for s in stores], "  }"] if owner else ["  " + s for s in stores])
            end += ["  workgroupBarrier();",
                    f"  for (var e = tid; e < {o_rows * D}u; e = e + 128u) {{",
                    f"    c[{f'{16 * k * D}u + ' if owner else ''}e] = o_tile[(e / {D}u) * {OS}u + e % {D}u];", "  }",
                    "  workgroupBarrier();"]
    else:
        end = [f"  subgroupMatrixStore<row_major>(&c, subgroup * {16 * D}u + {j * 16}u, o{j}, {D}u);" for j in range(frags)]
    return "\n".join([
        *kernel_start(decl),
        *[f"  var o{j} = subgroup_matrix_result<f32, 16, 16>();" for j in range(frags)],
        f"  for (var t = 0; t < {TILES}; t = t + 1) {{",
        "    workgroupBarrier();",
        f"    for (var e = tid; e < {ROWS * KEYS}u; e = e + 128u) {{ {p_arr}[{p_off}u + (e / {KEYS}u) * {PS}u + e % {KEYS}u] = f16(a[u32(t) * {ROWS * KEYS}u + e]); }}",
        f"    for (var e = tid; e < {KEYS * D}u; e = e + 128u) {{ v_tile[(e / {D}u) * {VS}u + e % {D}u] = f16(b[u32(t) * {KEYS * D}u + e]); }}",
        "    workgroupBarrier();",
        *(["    if (t > 0) {", *["      " + x for x in round_trip()], "    }"] if rescale else []),
        *[f"    let p{kk} = " + left(p_arr, f"{p_off}u + subgroup * {16 * PS}u + {kk * 16}u", PS) + ";" for kk in range(KEYS // 16)],
        *mma, "  }", *end, "}", ""])


def with_leading_scalar(wgsl: str) -> str:
    """`wgsl` with a 4-byte atomic declared before its workgroup arrays and touched by every invocation."""
    at = wgsl.index("var<workgroup>")
    wgsl = wgsl[:at] + "var<workgroup> flag : atomic<u32>;\n" + wgsl[at:]
    return wgsl.replace("  let subgroup = tid / 32u;", "  let subgroup = tid / 32u;\n  atomicAdd(&flag, 1u);", 1)


def kernels() -> list[dict]:
    out = []
    for held, arrays, where in itertools.product((True, False), ("apart", "same", "overlap"), ("wg", "storage")):
        if arrays == "overlap" and not held:
            continue
        out.append({"name": f"S held={held:d} arrays={arrays} out={where}", "chain": "S",
                    "wgsl": s_chain(held, arrays, where), "c_size": TILES * ROWS * KEYS})
    for rescale, owner, arrays, where in itertools.product((False, True), (False, True), ("apart", "same"), ("wg", "storage")):
        if owner and not rescale:
            continue
        out.append({"name": f"PV rescale={rescale:d} owner={owner:d} arrays={arrays} out={where}", "chain": "PV",
                    "wgsl": pv_chain(rescale, owner, arrays, where), "c_size": ROWS * D})
    for k in [k for k in out if k["name"] in ("S held=1 arrays=overlap out=wg", "PV rescale=1 owner=1 arrays=same out=wg")]:
        out.append(dict(k, name=k["name"] + " lead=1", wgsl=with_leading_scalar(k["wgsl"])))
    return out


PAGE_JS = r"""
window.probe = async (kernels, dims) => {
  let adapter = null;  // the first Chromium launch on a fresh machine has given none at once: try again
  for (let i = 0; i < 10 && !adapter; i++) {
    adapter = await navigator.gpu.requestAdapter({powerPreference: "high-performance"});
    if (!adapter) await new Promise((resolve) => setTimeout(resolve, 1000));
  }
  if (!adapter) throw new Error("navigator.gpu.requestAdapter() gave no adapter in 10 tries");
  const want = ["shader-f16", "chromium-experimental-subgroup-matrix"].filter((f) => adapter.features.has(f));
  const device = await adapter.requestDevice({requiredFeatures: want,
    requiredLimits: {maxComputeWorkgroupStorageSize: adapter.limits.maxComputeWorkgroupStorageSize}});
  const info = adapter.info || {};
  const report = {adapter: `${info.vendor} ${info.architecture} ${info.description}`, features: want, results: []};
  let seed = 12345;
  const rnd = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return (seed % 9) - 4; };  // integers -4..4
  const {TILES, ROWS, D, KEYS} = dims;
  for (const k of kernels) {
    const [na, nb] = k.chain === "S" ? [ROWS * D, TILES * D * KEYS] : [TILES * ROWS * KEYS, TILES * KEYS * D];
    const A = Float32Array.from({length: na}, rnd), B = Float32Array.from({length: nb}, rnd);
    const want = new Float64Array(k.c_size);
    if (k.chain === "S") {
      for (let t = 0; t < TILES; t++) for (let r = 0; r < ROWS; r++) for (let n = 0; n < KEYS; n++) {
        let s = 0; for (let d = 0; d < D; d++) s += A[r * D + d] * B[t * D * KEYS + d * KEYS + n];
        want[t * ROWS * KEYS + r * KEYS + n] = s; }
    } else {
      const rescale = k.name.includes("rescale=1");
      for (let t = 0; t < TILES; t++) for (let r = 0; r < ROWS; r++) for (let d = 0; d < D; d++) {
        let s = 0; for (let n = 0; n < KEYS; n++) s += A[t * ROWS * KEYS + r * KEYS + n] * B[t * KEYS * D + n * D + d];
        const o = r * D + d; want[o] = (rescale && t > 0 ? 0.5 * want[o] : want[o]) + s; }
    }
    const row = {name: k.name};
    try {
      device.pushErrorScope("validation");
      const module = device.createShaderModule({code: k.wgsl});
      const messages = (await module.getCompilationInfo()).messages.filter((m) => m.type === "error");
      if (messages.length) { row.error = messages.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("; "); }
      const pipeline = device.createComputePipeline({layout: "auto", compute: {module, entryPoint: "main"}});
      const buf = (data, usage) => { const b = device.createBuffer({size: data.byteLength, usage, mappedAtCreation: true});
        new Float32Array(b.getMappedRange()).set(data); b.unmap(); return b; };
      const S = GPUBufferUsage.STORAGE;
      const a = buf(A, S), b = buf(B, S);
      const c = device.createBuffer({size: k.c_size * 4, usage: S | GPUBufferUsage.COPY_SRC});
      const read = device.createBuffer({size: k.c_size * 4, usage: GPUBufferUsage.COPY_DST | GPUBufferUsage.MAP_READ});
      const bind = device.createBindGroup({layout: pipeline.getBindGroupLayout(0), entries: [a, b, c].map((buffer, i) => ({binding: i, resource: {buffer}}))});
      const enc = device.createCommandEncoder(); const pass = enc.beginComputePass();
      pass.setPipeline(pipeline); pass.setBindGroup(0, bind); pass.dispatchWorkgroups(1); pass.end();
      enc.copyBufferToBuffer(c, 0, read, 0, k.c_size * 4); device.queue.submit([enc.finish()]);
      const err = await device.popErrorScope(); if (err) row.error = (row.error || "") + err.message;
      await read.mapAsync(GPUMapMode.READ); const got = new Float32Array(read.getMappedRange()).slice(); read.unmap();
      let wrong = 0, maxErr = 0; const rows = new Set(), cols = new Set();
      const width = k.chain === "S" ? KEYS : D;
      for (let i = 0; i < got.length; i++) { const e = Math.abs(got[i] - want[i]); maxErr = Math.max(maxErr, e);
        if (e > 1e-3) { wrong++; rows.add(Math.floor(i / width) % ROWS); cols.add(i % width); } }
      Object.assign(row, {wrong, of: got.length, maxErr, rows: [...rows].sort((x, y) => x - y).slice(0, 16),
        cols: [...cols].sort((x, y) => x - y).slice(0, 16), sample: [...got.slice(0, 4)], want: [...want.slice(0, 4)]});
    } catch (e) { row.error = String(e); }
    report.results.push(row);
  }
  return report;
};
window.probeReady = true;
"""


def main() -> int:
    import gpu_page  # noqa: E402 (the driver bundle.sh copies to .cr/)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="blog-f16")
    parser.add_argument("--write", help="only write the kernels' WGSL to this folder")
    parser.add_argument("--emulate", action="store_true", help="only the builtins emulated (tests/matrix_emulation)")
    parser.add_argument("--controls", action="store_true",
                        help="each kernel also with its builtins emulated: a control for the probe itself")
    parser.add_argument("--only", default="", help="the kernels whose name holds this text")
    parser.add_argument("--extra", default="", help="extra Chromium flags, space separated")
    args = parser.parse_args()
    if args.write:
        Path(args.write).mkdir(parents=True, exist_ok=True)
        for k in kernels():
            (Path(args.write) / (k["name"].replace(" ", "_").replace("=", "") + ".wgsl")).write_text(k["wgsl"])
        return 0
    chosen = [k for k in kernels() if args.only in k["name"]]
    if args.emulate:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.matrix_emulation import emulated
        chosen = [dict(k, wgsl=emulated(k["wgsl"])) for k in chosen]
    elif args.controls:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.matrix_emulation import emulated
        chosen += [dict(k, name=k["name"] + " [emulated]", wgsl=emulated(k["wgsl"])) for k in chosen]
    root = Path(tempfile.mkdtemp())
    (root / "index.html").write_text("<!doctype html><title>probe</title><script src='probe.js'></script>")
    (root / "probe.js").write_text(PAGE_JS)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *_):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    gpu_page.OUT.mkdir(parents=True, exist_ok=True)
    gpu_page.ensure_wrapper()
    browser = gpu_page.Browser(gpu_page.flags_for(args.set) + args.extra.split(), gpu_page.OUT / "chromium-builtins.log", gpu_page.chromium_env())
    try:
        tab = browser.new_tab()
        tab.goto(f"http://127.0.0.1:{httpd.server_address[1]}/index.html")
        tab.wait("window.probeReady === true", 30)
        dims = {"TILES": TILES, "ROWS": ROWS, "D": D, "KEYS": KEYS}
        report = tab.eval(f"probe({json.dumps(chosen)}, {json.dumps(dims)})", timeout=240)
    finally:
        browser.close()
        httpd.shutdown()
    print(report["adapter"], report["features"])
    for r in report["results"]:
        if r.get("error") and "wrong" not in r:
            print(f"{r['name']:>48}: ERROR {r['error'][:300]}")
        else:
            print(f"{r['name']:>48}: {'ok   ' if r['wrong'] == 0 else 'WRONG'} {r['wrong']:>5}/{r['of']} max err {r['maxErr']:.3g}"
                  + (f" rows {r['rows']} cols {r['cols']} got {r['sample']} want {r['want']}" if r['wrong'] else "")
                  + (f" [{r['error'][:200]}]" if r.get("error") else ""))
    (gpu_page.OUT / "builtins.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
