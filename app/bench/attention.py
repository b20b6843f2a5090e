"""`python -m app bench attention`: paged decode attention per call, every kernel of the artifact.

Shapes (batch 1): D=64 with 8 KV / 32 query heads, D=128 with 8/32 (Llama-3.1-8B), D=256 with 4/8,
and SmolLM2's D=64 with 3/9. Per (shape, context) it times TVM's tiled kernel and every
sharded-family kernel set the artifact holds for the shape (the served artifact's `shards`,
`shards_group` and `subgroup`; a `--set sweep` build adds subgroup kernels of other row lanes and
unrolls), each over the whole context (S = 1, one dispatch) and split into each S of --splits
(split kernel + merge, timed together), then `auto`: what model_glue.model.attention.pick_layout
picks on this adapter.

Times are GPU timestamps around each call where the adapter has timestamp-query: the fastest of 3
medians of --iters calls, each round queued right behind 10 untimed calls, after ~0.2 s of
streaming reads that bring the clocks up (an H200 idles at 345 MHz). Without timestamps, wall time
over --iters back-to-back calls in one submit. Before any configuration of a (shape, context) is
timed, each one's output is checked against a float64 reference of the same inputs (f16 within
2.5e-4 relative L2, f32 within 1e-5): a wrong configuration is reported as wrong and never timed. KV GB/s counts each KV head's context once (GQA re-reads are cache hits, not
DRAM traffic); "of stream" divides it by the streaming-read bandwidth measured in the same run.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import numpy as np

from app.bench.harness import DecodeCall, as_dtype, random_paged_inputs
from app.bench.reference import decode_attention_f64, relative_l2
from model_glue.gpu.artifact import KernelLibrary
from model_glue.model.attention import AttentionKernels, resolve_attention_kernels, runnable_builds
from model_glue.policy import pick_layout
from app.bench.clock_warmer import STREAM_GROUP_WORDS, STREAM_WORDS as CLOCK_STREAM_WORDS, ClockWarmer
from contract.model import BENCH_SHAPES, MODEL_CONFIGS
from model_glue.gpu.webgpu_native import WgpuDevice

STREAM_WORDS = CLOCK_STREAM_WORDS  # 96 MiB of f32: far beyond any cache, within default binding limits
SHAPES = BENCH_SHAPES + [MODEL_CONFIGS["smollm2_135m"].attention_shape]
TOLERANCE = {"float16": 2.5e-4, "float32": 1e-5}
WARMUP_CALLS = 10
ROUNDS = 3


async def time_dispatches(device, dispatch, iters: int, method: str = "auto", rounds: int = ROUNDS) -> tuple[float, str]:
    """Seconds per call and how it was measured: the fastest of `rounds` medians of GPU timestamps
    (each round queued right behind WARMUP_CALLS untimed calls, so the GPU never idles between
    them), or the wall-clock mean of `iters` back-to-back calls."""
    if method == "timestamps" or (method == "auto" and device.has_timestamps):
        medians = []
        for _ in range(rounds):
            warm = device.batch()
            for _ in range(WARMUP_CALLS):
                dispatch(warm, None)
            warm.submit()  # not waited for: the timed calls queue behind it
            stamps = device.timestamps(2 * iters)
            batch = device.batch()
            for i in range(iters):
                dispatch(batch, (stamps, 2 * i, 2 * i + 1))
            batch.resolve(stamps)
            batch.submit()
            ticks = await stamps.read_ns()
            medians.append(statistics.median(ticks[2 * i + 1] - ticks[2 * i] for i in range(iters)))
        return min(medians) * 1e-9, "gpu-timestamps"
    batch = device.batch()
    for _ in range(iters):
        dispatch(batch, None)
    started = time.perf_counter()
    batch.submit()
    await device.read(device.storage_buffer(4), 4)  # waits for the queue to drain
    return (time.perf_counter() - started) / iters, "wall-clock"


async def ramp_clocks(device, library, seconds: float = 0.2) -> None:
    """Keep the GPU streaming memory for about `seconds` (app.bench.clock_warmer: its clocks idle low)."""
    warmer = ClockWarmer(device, library, STREAM_WORDS)
    await warmer.warm(seconds)
    warmer.release()


async def dispatch_floor(device, library, iters: int, method: str) -> tuple[float, float]:
    """Seconds of a timed pass holding one, and two, dispatches of one workgroup that reads 16 KiB:
    what any decode-attention call costs at least (a split call makes two dispatches)."""
    kernel = await library.kernel("stream_read")
    x, partial = device.storage_buffer(STREAM_GROUP_WORDS * 4), device.storage_buffer(256 * 4)
    bound = kernel.bind({"x": x, "partial": partial}, {"num_groups": 1})

    def twice(batch, timestamps=None):
        with batch.timed(timestamps) if timestamps is not None else contextlib.nullcontext():
            bound.dispatch(batch)
            bound.dispatch(batch)

    one, _ = await time_dispatches(device, bound.dispatch, iters, method)
    two, _ = await time_dispatches(device, twice, iters, method)
    bound.release()
    device.destroy(x)
    device.destroy(partial)
    return one, two


async def stream_bandwidth(device, library, iters: int, method: str) -> float:
    kernel = await library.kernel("stream_read")
    groups = STREAM_WORDS // STREAM_GROUP_WORDS
    x = device.storage_buffer(STREAM_WORDS * 4)
    partial = device.storage_buffer(groups * 256 * 4)
    bound = kernel.bind({"x": x, "partial": partial}, {"num_groups": groups})
    await ramp_clocks(device, library)
    seconds, _ = await time_dispatches(device, bound.dispatch, iters, method)
    return STREAM_WORDS * 4 / seconds / 1e9


def family_kernel_sets(library, shape, dtype: str, device) -> tuple[dict[str, tuple[str, str]], AttentionKernels]:
    """label -> (whole-context kernel, split kernel) of every sharded-layout build for the shape that
    this device runs, served or from the sweep (labels are the manifest's build names, e.g.
    subgroup_l16s32 or subgroup_l8s32_u4_i128); and what the runtime runs (resolve_attention_kernels)."""
    sets = {b.build: (b.whole, b.split) for b in runnable_builds(library, shape, dtype, device, sweep=True)}
    return sets, resolve_attention_kernels(library, shape, dtype, device)


async def _configs(library, sets: dict, served, choice, splits: list[int]) -> list:
    """Every configuration a row times, as (label, kernels, S): tiled, each kernel set whole and at
    each S, and the runtime's own choice (`choice`, by its build's name) where --splits lacks its S."""
    merge = await library.kernel(served.merge)
    configs = [("tiled", await library.kernel(served.tiled), 1)]
    for label, (whole, split) in sets.items():
        configs.append((label, await library.kernel(whole), 1))
        configs += [(label, (await library.kernel(split), merge), n) for n in splits if n > 1]
    auto_label = served.layouts[choice.layout].build
    if not any(label == auto_label and n == choice.num_splits for label, _, n in configs):
        whole, split = sets[auto_label]
        configs.append((auto_label, (await library.kernel(split), merge) if choice.split
                        else await library.kernel(whole), choice.num_splits))
    return configs


async def _check_then_time(device, library, configs, inputs, ref_out, dtype, args) -> tuple[dict, str, list]:
    """Each configuration checked against the float64 reference first (readbacks leave the GPU idle),
    then every right one timed back to back on ramped-up clocks: ({"label:S": seconds or None (wrong)},
    the timing method, the wrong ones)."""
    calls, wrong, good = {}, [], []
    for label, kernels, splits in configs:
        key = (label, splits > 1)
        if key not in calls:
            calls[key] = DecodeCall(device, kernels, inputs)
        if splits > 1:
            calls[key].set_splits(splits)
        out, _ = await calls[key].run()
        error = relative_l2(out, ref_out)
        if error <= TOLERANCE[dtype]:
            good.append((label, splits))
        else:
            wrong.append(f"{label}:{splits} (rel L2 {error:.2e})")
    await ramp_clocks(device, library)
    sweep, method = {}, "?"
    for label, splits in good:
        call = calls[label, splits > 1]
        if splits > 1:
            call.set_splits(splits)
        sweep[f"{label}:{splits}"], method = await time_dispatches(device, call.dispatch, args.iters, args.timing)
    for label, _, splits in configs:
        sweep.setdefault(f"{label}:{splits}", None)  # wrong: not timed
    for call in calls.values():
        call.release()
    return sweep, method, wrong


def _row(shape, context, dtype, method, sweep, wrong, choice, auto_label, kv_bytes, stream_gbps) -> dict:
    def us(seconds):
        return None if seconds is None else round(seconds * 1e6, 2)

    def ratio(a, b):
        return None if a is None or b is None else round(a / b, 3)

    sweep = dict(sweep)
    t_tiled = sweep.pop("tiled:1")
    timed_sweep = {k: v for k, v in sweep.items() if v is not None}
    best = min(timed_sweep, key=timed_sweep.get) if timed_sweep else None
    t_auto = sweep.get(f"{auto_label}:{choice.num_splits}")
    return {
        "head_dim": shape.head_dim, "num_kv_heads": shape.num_kv_heads, "num_qo_heads": shape.num_qo_heads,
        "context": context, "dtype": dtype, "timing": method,
        "tiled_us": us(t_tiled), "shards_us": us(sweep.get("shards:1")),
        "best": best, "best_us": us(timed_sweep.get(best)),
        "auto": str(choice), "auto_kernels": auto_label, "auto_splits": choice.num_splits,
        "auto_us": us(t_auto), "tiled_over_auto": ratio(t_tiled, t_auto),
        "shards_over_auto": ratio(sweep.get("shards:1"), t_auto),
        "auto_gbps": None if t_auto is None else round(kv_bytes / t_auto / 1e9, 2),
        "auto_of_stream": None if t_auto is None else round(kv_bytes / t_auto / 1e9 / stream_gbps, 4),
        "tiled_gbps": None if t_tiled is None else round(kv_bytes / t_tiled / 1e9, 3),
        "sweep_us": {k: us(v) for k, v in sweep.items()}, "wrong": wrong,
    }


def _print_row(row: dict, show_sweep: bool) -> None:
    def show(value, width, digits=1):
        return f"{'wrong' if value is None else f'{value:.{digits}f}':>{width}}"

    best = f"{row['best']} {row['best_us']:.1f}" if row["best"] else "none"
    print(f"{row['head_dim']:>4} {f'{row['num_kv_heads']}/{row['num_qo_heads']}':>9} {row['context']:>7} "
          f"{show(row['tiled_us'], 9)} {show(row['shards_us'], 9)} {best:>22} {row['auto']:>16} "
          f"{show(row['auto_us'], 8)} {show(row['tiled_over_auto'], 10, 2)} {show(row['auto_gbps'], 9)} "
          f"{show(None if row['auto_of_stream'] is None else 100 * row['auto_of_stream'], 8)}%", flush=True)
    if row["wrong"]:
        print(f"      WRONG (not timed): {', '.join(row['wrong'])}", flush=True)
    if show_sweep:
        print("      sweep (us): " + "  ".join(f"{k} {'wrong' if v is None else f'{v:.1f}'}"
                                              for k, v in row["sweep_us"].items()), flush=True)


async def run_attention_bench(args) -> dict:
    device = await WgpuDevice.open()
    library = await KernelLibrary.from_folder(device, args.artifact)
    dtype = args.dtype if args.dtype != "auto" else ("float16" if device.has_f16 else "float32")
    print(f"adapter: {device.adapter_name} ({'CPU' if device.is_cpu else 'GPU'}); dtype {dtype}; subgroups: "
          f"{device.subgroup_min_size or 'no'}-{device.subgroup_max_size or 'no'}; timing: {args.timing} "
          f"(timestamp-query {'available' if device.has_timestamps else 'missing'})", flush=True)
    stream_gbps = await stream_bandwidth(device, library, args.iters, args.timing)
    floor = await dispatch_floor(device, library, args.iters, args.timing)
    print(f"streaming read: {stream_gbps:.1f} GB/s; a pass with one tiny dispatch {floor[0] * 1e6:.1f} us, "
          f"with two {floor[1] * 1e6:.1f} us", flush=True)
    print(f"{'D':>4} {'H_kv/H_qo':>9} {'context':>7} {'tiled us':>9} {'shards us':>9} {'best':>22} "
          f"{'auto':>16} {'auto us':>8} {'tiled/auto':>10} {'auto GB/s':>9} {'of stream':>9}")
    rows = []
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        if shape.head_dim not in args.head_dims:
            continue
        sets, served = family_kernel_sets(library, shape, dtype, device)
        for context in args.contexts:
            inputs = random_paged_inputs(rng, [context], shape.num_kv_heads, shape.num_qo_heads, shape.head_dim)
            inputs.update(q=as_dtype(inputs["q"], dtype), pages=as_dtype(inputs["pages"], dtype))  # what the kernels read
            ref_out, _ = decode_attention_f64(inputs)
            choice = pick_layout([context], shape, available=served.layouts, is_cpu=device.is_cpu)
            configs = await _configs(library, sets, served, choice, args.splits)
            sweep, method, wrong = await _check_then_time(device, library, configs, inputs, ref_out, dtype, args)
            kv_bytes = DecodeCall.kv_bytes_of(inputs, shape.head_dim, 2 if dtype == "float16" else 4)
            row = _row(shape, context, dtype, method, sweep, wrong, choice, served.layouts[choice.layout].build,
                       kv_bytes, stream_gbps)
            rows.append(row)
            _print_row(row, args.show_sweep)
    result = {"adapter": device.adapter_name, "is_cpu": device.is_cpu, "subgroup_min_size": device.subgroup_min_size,
              "subgroup_max_size": device.subgroup_max_size,
              "stream_gbps": round(stream_gbps, 1), "one_dispatch_us": round(floor[0] * 1e6, 2),
              "two_dispatches_us": round(floor[1] * 1e6, 2), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
