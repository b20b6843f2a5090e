"""`python -m app bench attention`: paged decode attention per call, every nest and split variant.

Shapes (batch 1): D=64 with 8 KV / 32 query heads, D=128 with 8/32 (Llama-3.1-8B), D=256 with 4/8,
and SmolLM2's D=64 with 3/9. Times are GPU timestamps around each call (a split's partial and
merge kernels in one timed pass; median of --iters calls) where the adapter has timestamp-query,
else wall time over --iters back-to-back calls in one submit. KV GB/s counts each KV head's context
once (GQA re-reads are cache hits, not DRAM traffic); "of stream" divides it by the streaming-read
bandwidth measured in the same run.

Per row: tiled, sharded, the best split of the sweep (--splits, both split variants), and `auto`:
what model_glue.attention.pick_sharded_variant picks on this adapter, timed as picked.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from app.bench.harness import DecodeCall, random_paged_inputs
from model_glue.artifact import KernelLibrary
from model_glue.attention import AttentionChoice, pick_sharded_variant
from model_glue.contract import (BENCH_SHAPES, MODEL_CONFIGS, SPLIT_VARIANTS, attention_kernel_name,
                                 split_merge_kernel_name)
from model_glue.webgpu import WgpuDevice

STREAM_WORDS = 24 * 1024 * 1024  # 96 MiB of f32: far beyond any cache, within default binding limits
STREAM_GROUP_WORDS = 256 * 16
SHAPES = BENCH_SHAPES + [MODEL_CONFIGS["smollm2_135m"].attention_shape]


async def time_dispatches(device, dispatch, iters: int, method: str = "auto") -> tuple[float, str]:
    """Seconds per call (median of GPU timestamps, or wall-clock mean), and how it was measured."""
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


async def _kernels(library, variant: str, shape, dtype: str):
    """The kernel(s) of one variant: one for tiled/sharded, (partial, merge) for a split."""
    kernel = await library.kernel(attention_kernel_name(variant, shape, dtype, False))
    if variant in SPLIT_VARIANTS:
        return (kernel, await library.kernel(split_merge_kernel_name(shape, dtype)))
    return kernel


async def run_attention_bench(args) -> dict:
    device = await WgpuDevice.open()
    library = await KernelLibrary.from_folder(device, args.artifact)
    dtype = args.dtype if args.dtype != "auto" else ("float16" if device.has_f16 else "float32")
    print(f"adapter: {device.adapter_name} ({'CPU' if device.is_cpu else 'GPU'}); dtype {dtype}; timing: "
          f"{args.timing} (timestamp-query {'available' if device.has_timestamps else 'missing'})", flush=True)
    stream_gbps = await stream_bandwidth(device, library, args.iters, args.timing)
    print(f"streaming read: {stream_gbps:.1f} GB/s", flush=True)
    print(f"{'D':>4} {'H_kv/H_qo':>9} {'context':>7} {'tiled us':>9} {'sharded us':>10} {'best split':>18} "
          f"{'auto':>16} {'auto us':>9} {'tiled/auto':>10} {'auto GB/s':>9} {'of stream':>9}")
    rows = []
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        if shape.head_dim not in args.head_dims:
            continue
        for context in args.contexts:
            inputs = random_paged_inputs(rng, [context], shape.num_kv_heads, shape.num_qo_heads, shape.head_dim)
            method = "?"

            async def timed(variant: str, splits: int = 1) -> float:
                nonlocal method
                call = calls[variant]
                if variant in SPLIT_VARIANTS:
                    call.set_splits(splits)
                await time_dispatches(device, call.dispatch, 10, args.timing)  # warm-up (clocks ramp up)
                seconds, method = await time_dispatches(device, call.dispatch, args.iters, args.timing)
                return seconds

            calls = {v: DecodeCall(device, await _kernels(library, v, shape, dtype), inputs)
                     for v in ("tiled", "sharded") + SPLIT_VARIANTS}
            t_tiled, t_sharded = await timed("tiled"), await timed("sharded")
            sweep = {f"{v}:{s}": await timed(v, s) for v in SPLIT_VARIANTS for s in args.splits}
            best = min(sweep, key=sweep.get)
            choice: AttentionChoice = pick_sharded_variant([context], shape, is_cpu=device.is_cpu)
            t_auto = await timed(choice.variant, choice.num_splits)
            kv_bytes = calls["sharded"].kv_bytes
            row = {
                "head_dim": shape.head_dim, "num_kv_heads": shape.num_kv_heads, "num_qo_heads": shape.num_qo_heads,
                "context": context, "dtype": dtype, "timing": method,
                "tiled_us": round(t_tiled * 1e6, 2), "sharded_us": round(t_sharded * 1e6, 2),
                "best_split": best, "best_split_us": round(sweep[best] * 1e6, 2),
                "auto": str(choice), "auto_variant": choice.variant, "auto_splits": choice.num_splits,
                "auto_us": round(t_auto * 1e6, 2), "tiled_over_auto": round(t_tiled / t_auto, 3),
                "sharded_over_auto": round(t_sharded / t_auto, 3),
                "auto_gbps": round(kv_bytes / t_auto / 1e9, 2),
                "auto_of_stream": round(kv_bytes / t_auto / 1e9 / stream_gbps, 4),
                "tiled_gbps": round(kv_bytes / t_tiled / 1e9, 3), "sharded_gbps": round(kv_bytes / t_sharded / 1e9, 3),
                "sweep_us": {k: round(v * 1e6, 2) for k, v in sweep.items()},
            }
            rows.append(row)
            print(f"{shape.head_dim:>4} {f'{shape.num_kv_heads}/{shape.num_qo_heads}':>9} {context:>7} "
                  f"{row['tiled_us']:>9.1f} {row['sharded_us']:>10.1f} "
                  f"{f'{best} {row['best_split_us']:.1f}':>18} {str(choice):>16} {row['auto_us']:>9.1f} "
                  f"{row['tiled_over_auto']:>10.2f} {row['auto_gbps']:>9.1f} {100 * row['auto_of_stream']:>8.1f}%",
                  flush=True)
            if args.show_sweep:
                print("      sweep (us): " + "  ".join(f"{k} {v * 1e6:.1f}" for k, v in sweep.items()), flush=True)
    result = {"adapter": device.adapter_name, "is_cpu": device.is_cpu, "stream_gbps": round(stream_gbps, 1),
              "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
