"""`python -m app bench attention`: tiled vs sharded paged decode attention, per call.

Shapes (batch 1): D=64 with 8 KV / 32 query heads, D=128 with 8/32 (Llama-3.1-8B), D=256 with 4/8.
Times are GPU timestamps around each dispatch (median of --iters calls) where the adapter has
timestamp-query, else wall time over --iters back-to-back dispatches in one submit. KV GB/s counts
each KV head's context once (GQA re-reads are cache hits, not DRAM traffic).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from app.bench.harness import DecodeCall, random_paged_inputs
from model_glue.artifact import KernelLibrary
from model_glue.contract import BENCH_SHAPES, NESTS, attention_kernel_name
from model_glue.webgpu import WgpuDevice

STREAM_WORDS = 24 * 1024 * 1024  # 96 MiB of f32: far beyond any cache, within default binding limits
STREAM_GROUP_WORDS = 256 * 16


async def time_dispatches(device, dispatch, iters: int, method: str = "auto") -> tuple[float, str]:
    """Seconds per dispatch (median of GPU timestamps, or wall-clock mean), and how it was measured."""
    if method == "timestamps" or (method == "auto" and device.has_timestamps):
        stamps = device.timestamps(2 * iters)
        batch = device.batch()
        for i in range(iters):
            dispatch(batch, (stamps, 2 * i, 2 * i + 1))
        batch.resolve(stamps)
        batch.submit()
        ticks = await stamps.read_ns()
        durations = [ticks[2 * i + 1] - ticks[2 * i] for i in range(iters)]
        return statistics.median(durations) * 1e-9, "gpu-timestamps"
    batch = device.batch()
    for _ in range(iters):
        dispatch(batch, None)
    started = time.perf_counter()
    batch.submit()
    await device.read(device.storage_buffer(4), 4)  # waits for the queue to drain
    return (time.perf_counter() - started) / iters, "wall-clock"


async def stream_bandwidth(device, library, iters: int, method: str) -> float:
    kernel = await library.kernel("stream_read")
    groups = STREAM_WORDS // STREAM_GROUP_WORDS
    x = device.storage_buffer(STREAM_WORDS * 4)
    partial = device.storage_buffer(groups * 256 * 4)
    bound = kernel.bind({"x": x, "partial": partial}, {"num_groups": groups})
    await time_dispatches(device, bound.dispatch, 10, method)  # warm-up (clocks ramp up)
    seconds, _ = await time_dispatches(device, bound.dispatch, iters, method)
    return STREAM_WORDS * 4 / seconds / 1e9


async def run_attention_bench(args) -> dict:
    device = await WgpuDevice.open()
    library = await KernelLibrary.from_folder(device, args.artifact)
    dtype = args.dtype if args.dtype != "auto" else ("float16" if device.has_f16 else "float32")
    print(f"adapter: {device.adapter_name}; dtype {dtype}; timing: {args.timing} "
          f"(timestamp-query {'available' if device.has_timestamps else 'missing'})", flush=True)
    stream_gbps = await stream_bandwidth(device, library, args.iters, args.timing)
    print(f"streaming read: {stream_gbps:.1f} GB/s", flush=True)
    rows = []
    header = f"{'D':>4} {'H_kv/H_qo':>9} {'context':>7} {'tiled us':>10} {'sharded us':>10} {'ratio':>6} {'tiled GB/s':>10} {'shard GB/s':>10}"
    print(header)
    rng = np.random.default_rng(0)
    for shape in BENCH_SHAPES:
        if shape.head_dim not in args.head_dims:
            continue
        for context in args.contexts:
            inputs = random_paged_inputs(rng, [context], shape.num_kv_heads, shape.num_qo_heads, shape.head_dim)
            timing = {}
            for nest in NESTS:
                kernel = await library.kernel(attention_kernel_name(nest, shape, dtype, False))
                call = DecodeCall(device, kernel, inputs)
                await time_dispatches(device, call.dispatch, 10, args.timing)  # warm-up (clocks ramp up)
                seconds, method = await time_dispatches(device, call.dispatch, args.iters, args.timing)
                timing[nest] = (seconds, call.kv_bytes)
            (t_tiled, kv_bytes), (t_sharded, _) = timing["tiled"], timing["sharded"]
            row = {
                "head_dim": shape.head_dim, "num_kv_heads": shape.num_kv_heads, "num_qo_heads": shape.num_qo_heads,
                "context": context, "dtype": dtype,
                "tiled_us": round(t_tiled * 1e6, 2), "sharded_us": round(t_sharded * 1e6, 2),
                "ratio": round(t_tiled / t_sharded, 3),
                "tiled_gbps": round(kv_bytes / t_tiled / 1e9, 4), "sharded_gbps": round(kv_bytes / t_sharded / 1e9, 4),
                "timing": method,
            }
            rows.append(row)
            print(f"{shape.head_dim:>4} {f'{shape.num_kv_heads}/{shape.num_qo_heads}':>9} {context:>7} "
                  f"{row['tiled_us']:>10.1f} {row['sharded_us']:>10.1f} {row['ratio']:>6.2f} "
                  f"{row['tiled_gbps']:>10.3g} {row['sharded_gbps']:>10.3g}", flush=True)
    result = {"adapter": device.adapter_name, "stream_gbps": round(stream_gbps, 1), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
