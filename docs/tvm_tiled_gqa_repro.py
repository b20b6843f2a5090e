"""Reproducer: TVM's paged decode kernel `_attention_decode` skips query heads for some GQA groups.

`tvm.relax.frontend.nn.llm._decode_kernels._attention_decode` (apache-tvm 0.27.0.post1) maps the
GROUP = num_qo_heads // num_kv_heads query heads of one KV head onto threadIdx.y (bdy) times
blockIdx.y (gdz):

    bdy = GROUP
    while bdx * bdy > thread_limit and bdy > 1:   # bdx = head_dim // 4, thread_limit = 256 on webgpu
        bdy //= 2
    gdz = GROUP // bdy

When bdy does not divide GROUP, gdz * bdy < GROUP and the last GROUP - gdz * bdy query heads of every
KV head are never computed: their `output` rows and `lse` entries are left as they were (here zeros),
so the relative L2 error is ~sqrt(missing / GROUP) (0.45 for group 5, 0.38 for group 7). Affected on
webgpu (256 threads): head_dim 256 with groups 5, 7, 9, 11, 13, 14; head_dim 128 with groups 9, 11,
13, 15; head_dim 64 only above 16. It does not depend on dtype, num_kv_heads or context length.
A one-line fix (checked on the shapes above): keep bdy a divisor of GROUP, e.g.
`while (bdx * bdy > thread_limit or GROUP_SIZE % bdy) and bdy > 1: bdy -= 1`.

This script builds the kernel for webgpu with `tvm.compile`, runs the WGSL natively with wgpu-py on any
Vulkan/Metal/D3D12 adapter (Mesa lavapipe is fine), and compares with a float64 numpy reference, for a
failing group (5) and a passing one (4) at head_dim 256, float32. Needs only tvm, numpy and wgpu:

    .venv/bin/python docs/tvm_tiled_gqa_repro.py
"""

import math
import os
import re

import numpy as np
import tvm
import wgpu
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # silences Mesa's harmless "XDG_RUNTIME_DIR is invalid"
TARGET = tvm.target.Target("webgpu", host="llvm")
PAGE_SIZE = 16
HEAD_DIM = 256
CONTEXTS = [1, 17, 300]  # tokens of each sequence in the batch


def build(num_kv_heads, num_qo_heads):
    """WGSL, entry point, storage binding names, PODArgs fields and the grid's y extent."""
    func = _attention_decode(num_kv_heads, num_qo_heads, HEAD_DIM, "float32", False, {}, TARGET, PAGE_SIZE)
    grid_y = int(re.search(r'thread_binding\((\d+), thread="blockIdx.y"\)', func.script()).group(1))
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):  # no host CSE in PODArgs
        ex = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
    wgsl = ex.mod.imports[0].inspect_source()
    entry = re.search(r"@compute @workgroup_size\(([\d, ]+)\)\s*fn (\w+)", wgsl)
    bindings = re.findall(r"@binding\((\d+)\) var<storage, \w+> (\w+)_ptr", wgsl)
    pod = re.findall(r"(\w+): (i32|u32|f32)", re.search(r"struct PODArgs \{(.*?)\}", wgsl, re.S).group(1))
    assert [int(i) for i, _ in bindings] == list(range(len(bindings)))
    return wgsl, entry.group(2), entry.group(1), [n for _, n in bindings], pod, grid_y


def make_inputs(rng, num_kv_heads, num_qo_heads):
    """Random q/K/V (N(0,1)); each sequence on its own pages, physical page ids shuffled."""
    pages_per_seq = [-(-n // PAGE_SIZE) for n in CONTEXTS]
    num_pages = sum(pages_per_seq)
    return {
        "Q": rng.standard_normal((len(CONTEXTS), num_qo_heads, HEAD_DIM)).astype(np.float32),
        "pages": rng.standard_normal((num_pages, 2, num_kv_heads, PAGE_SIZE, HEAD_DIM)).astype(np.float32),
        "page_table_indptr": np.concatenate([[0], np.cumsum(pages_per_seq)]).astype(np.int32),
        "page_table_values": rng.permutation(num_pages).astype(np.int32),
        "length_info": np.array([n - (p - 1) * PAGE_SIZE for n, p in zip(CONTEXTS, pages_per_seq)], np.int32),
        "k_rope_pos_offset": np.zeros(len(CONTEXTS), np.int32),
        "q_rope_position": np.zeros(len(CONTEXTS), np.int32),
    }


def reference(inp, sm_scale):
    """float64 attention; query head h reads KV head h // group."""
    q, pages = inp["Q"].astype(np.float64), inp["pages"].astype(np.float64)
    group = q.shape[1] // pages.shape[2]
    out = np.zeros_like(q)
    for b, n in enumerate(CONTEXTS):
        slots = np.arange(n)
        phys = inp["page_table_values"][inp["page_table_indptr"][b] + slots // PAGE_SIZE]
        k = pages[phys, 0, :, slots % PAGE_SIZE]  # [n, H_kv, D]
        v = pages[phys, 1, :, slots % PAGE_SIZE]
        for h in range(q.shape[1]):
            s = k[:, h // group] @ q[b, h] * sm_scale
            p = np.exp(s - s.max())
            out[b, h] = p @ v[:, h // group] / p.sum()
    return out


def run_on_gpu(device, wgsl, entry, names, pod, grid_y, inp, sm_scale):
    batch, num_qo_heads, _ = inp["Q"].shape
    out_bytes = inp["Q"].nbytes
    storage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
    bufs = {k: device.create_buffer_with_data(data=v.tobytes(), usage=storage) for k, v in inp.items()}
    bufs["output"] = device.create_buffer(size=out_bytes, usage=storage)
    bufs["lse"] = device.create_buffer(size=batch * num_qo_heads * 4, usage=storage)
    values = {"B": batch, "rotary_mode": 0, "rope_scale": 1.0, "rope_theta": 1e4, "sm_scale": sm_scale,
              "packGridDimX": batch}  # *_elem_offset: 0 (whole buffers are bound)
    fmt = {"i32": "<i4", "u32": "<u4", "f32": "<f4"}
    pod_bytes = b"".join(np.array(values.get(n, 0), fmt[t]).tobytes() for n, t in pod)
    uniform = device.create_buffer_with_data(data=pod_bytes, usage=wgpu.BufferUsage.UNIFORM)

    module = device.create_shader_module(code=wgsl)
    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry})
    resources = [bufs[n] for n in names] + [uniform]
    bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate(resources)])
    encoder = device.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipeline)
    compute.set_bind_group(0, bind_group)
    compute.dispatch_workgroups(batch, grid_y, 1)  # grid (B, blockIdx.y extent), as the kernel declares
    compute.end()
    device.queue.submit([encoder.finish()])
    return np.frombuffer(device.queue.read_buffer(bufs["output"]), np.float32).reshape(inp["Q"].shape)


def main():
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    limits = adapter.limits
    device = adapter.request_device_sync(required_limits={
        "max-storage-buffers-per-shader-stage": limits["max-storage-buffers-per-shader-stage"],  # kernel binds 9
        "max-compute-workgroup-storage-size": limits["max-compute-workgroup-storage-size"],
    })
    print(f"tvm {tvm.__version__}, adapter: {adapter.info['device']} ({adapter.info['backend_type']})")
    print(f"head_dim {HEAD_DIM}, float32, contexts {CONTEXTS}, num_kv_heads 1")
    rng = np.random.default_rng(0)
    for group in (4, 5):
        wgsl, entry, wg_size, names, pod, grid_y = build(1, group)
        inp = make_inputs(rng, 1, group)
        sm_scale = 1.0 / math.sqrt(HEAD_DIM)
        out = run_on_gpu(device, wgsl, entry, names, pod, grid_y, inp, sm_scale)
        ref = reference(inp, sm_scale)
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        per_head = [np.linalg.norm(out[:, h] - ref[:, h]) / np.linalg.norm(ref[:, h]) for h in range(group)]
        bdx, bdy, bdz = (int(x) for x in wg_size.split(","))
        print(f"\ngroup {group}: workgroup (bdx, bdy, bdz) = ({bdx}, {bdy}, {bdz}), grid y = {grid_y} "
              f"-> {grid_y * bdy} of {group} query heads computed per KV head")
        print(f"  relative L2 vs f64 reference: {rel:.3e}  ({'FAIL' if rel > 1e-3 else 'ok'})")
        print("  per query head: " + ", ".join(f"{h}: {e:.1e}" for h, e in enumerate(per_head)))
        for h in range(group):
            if per_head[h] > 1e-3:
                print(f"  head {h}: max |output| = {np.abs(out[:, h]).max():.1f} (never written)")


if __name__ == "__main__":
    main()
