"""`python -m app bench decode`: prefill and decode throughput of the whole model, per mode (RunOptions
fields: by default the adapter's defaults, the sharded family held to the seed's layout over the whole
context (layout=shards, S = 1), and tiled forced).

For each context C: the model is reset and `generate` runs a C-token prompt: the prefill (tokens/s),
then --steps pipelined greedy decode steps (tokens/s from their wall time; per step the host's
encode time, the GPU time of the whole pass and of attention from GPU timestamps, dispatches).
The prompt is random token ids: throughput does not depend on the text. `--synthetic` writes
random weights of SmolLM2's shape (for machines without the converted model); `--shape llama-3.1-8b`
(or llama-3.2-1b) runs a synthetic model of that shape, its weights filled on the GPU. `--profile` adds,
per context, where one decode step's GPU time goes by kernel role (app/bench/profile.py).
"""

from __future__ import annotations

import json
import random
import time

from app.bench.inputs import bench_model
from app.bench.profile import print_profile, profile_contexts
from model_glue.model.generate import GREEDY, Sampling, generate
from model_glue.options import RunOptions
from app.run_options_cli import given_options

WARMUP_SECONDS = 3.0
WARMUP_PROMPT = 300  # tokens: the warm-up crosses the switch to the sharded family
WARMUP_NEW_TOKENS = 16


def mode_label(mode: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in mode.items()) or "default"


async def run_decode_bench(args) -> dict:
    # The KV cache holds the longest of: each context's prompt and the steps + 1 tokens it generates
    # (the run asks for steps + 1: the first comes from the prefill), and the warm-up's own run.
    max_context = max(max(args.contexts) + args.steps + 1, WARMUP_PROMPT + WARMUP_NEW_TOKENS)
    base = given_options(args)
    device, library, model, weights = await bench_model(args, RunOptions.from_dict({**base, "max_context": max_context}))
    rng = random.Random(0)
    # Each mode is RunOptions fields over the command line's (app.run_options_cli.parse_mode); with
    # --sample also the default drawing each token on the GPU (top-k 40, top-p 0.95) instead of the argmax.
    modes = [(mode_label(mode), RunOptions.from_dict({**base, **mode}), GREEDY) for mode in args.modes]
    if args.sample:
        modes.append(("sample", RunOptions.from_dict(base), Sampling(temperature=1.0, top_k=40, top_p=0.95, seed=0)))
    lanes = model.matmul_subgroup_lanes
    print(f"adapter: {device.adapter_name}; model: {weights}; dtype {model.dtype}; "
          f"GPU time: {'timestamps' if device.has_timestamps else 'unavailable'}; {model.config.n_layers} layers, "
          f"norms and SwiGLU {'folded' if model.options.fold_norms else 'apart'}; decode matmuls' lanes "
          f"{f'reduced by subgroup shuffles, {lanes} at a time' if lanes else 'meet in workgroup memory'}"
          f"{', x as int8 codes' if model.int8_x else ''}", flush=True)
    width = max(len(label) for label, _, _ in modes)
    print(f"{'context':>7} {'mode':>{width}} {'prefill tok/s':>13} {'decode tok/s':>12} {'step ms':>8} "
          f"{'encode ms':>9} {'GPU ms':>7} {'attn ms':>8} {'dispatches':>10} {'ran':>16} {'prefill GPU/attn ms':>19}")
    # Warm-up: first use of each pipeline and buffer costs extra on some drivers, and a GPU's clocks
    # ramp up only under sustained work (the H200 idles at 345 MHz): at least WARMUP_SECONDS of runs.
    warmup_until = time.perf_counter() + WARMUP_SECONDS
    while True:
        for _, options, sampling in modes:
            model.reset()
            await generate(model, [rng.randrange(3, model.config.vocab_size) for _ in range(WARMUP_PROMPT)],
                           max_new_tokens=WARMUP_NEW_TOKENS, options=options, sampling=sampling)
        if time.perf_counter() >= warmup_until:
            break
    rows = []
    for context in args.contexts:
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(context)]
        for label, options, sampling in modes:
            model.reset()
            # generate's own loop (prefill in chunks, then pipelined decode steps), no stop token
            run = await generate(model, prompt, max_new_tokens=args.steps + 1, options=options, sampling=sampling)
            steps = [s for s in run.stats if s.kind == "decode"]
            step_ms = run.decode_ms / run.decode_steps

            def mean(values):
                values = [v for v in values if v is not None]
                return sum(values) / len(values) if values else None

            attn_ms, gpu_ms = mean(s.attention_ms for s in steps), mean(s.gpu_ms for s in steps)
            encode_ms = mean(s.encode_ms for s in steps)
            prefill = [s for s in run.stats if s.kind == "prefill"]
            prefill_gpu = None if any(s.gpu_ms is None for s in prefill) else sum(s.gpu_ms for s in prefill)
            prefill_attn = None if any(s.attention_ms is None for s in prefill) else sum(s.attention_ms for s in prefill)
            row = {"context": context, "mode": label,
                   "prefill_tok_s": round(context / (run.prefill_ms / 1e3), 2),
                   "decode_tok_s": round(1000 / step_ms, 2), "step_ms": round(step_ms, 3),
                   "encode_ms": round(encode_ms, 3), "gpu_ms": None if gpu_ms is None else round(gpu_ms, 3),
                   "attention_ms": None if attn_ms is None else round(attn_ms, 4),
                   "dispatches": sorted({s.dispatches for s in steps}),
                   "prefill_gpu_ms": prefill_gpu, "prefill_attention_ms": prefill_attn,
                   "nests": sorted({s.kernel for s in steps})}
            rows.append(row)

            def ms(value, digits):
                return "-" if value is None else f"{value:.{digits}f}"

            print(f"{context:>7} {label:>{width}} {row['prefill_tok_s']:>13.1f} {row['decode_tok_s']:>12.2f} "
                  f"{step_ms:>8.2f} {encode_ms:>9.3f} {ms(gpu_ms, 3):>7} {ms(attn_ms, 3):>8} "
                  f"{','.join(map(str, row['dispatches'])):>10} {','.join(row['nests']):>16} "
                  f"{ms(prefill_gpu, 1):>9}/{ms(prefill_attn, 1):<9}", flush=True)
    result = {"adapter": device.adapter_name, "model": weights, "dtype": model.dtype, "matmul_subgroup_lanes": lanes,
              "rows": rows}
    if getattr(args, "profile", False):
        if not device.has_timestamps:
            raise SystemExit("--profile needs an adapter with timestamp-query")
        in_pass = getattr(args, "profile_in_pass", False)
        if in_pass and not device.timestamps_inside_passes:
            raise SystemExit("--profile-in-pass needs an adapter that writes timestamps inside passes")
        result["profile"] = await profile_contexts(model, device, library, args.contexts, args.profile_repeats,
                                                   in_pass=in_pass)
        print_profile(result["profile"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
