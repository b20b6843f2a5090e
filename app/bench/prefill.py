"""`python -m app bench prefill`: time to first token for long prompts, per prefill chunk size.

For each chunk size and prompt length P: the model is reset and `generate` prefills a P-token prompt
(random ids) in chunks and picks one token; best of --repeats. Reported: tokens/s over the wall
time to the first token, the GPU time of the prefill passes and of their attention (GPU timestamps,
summed over chunks), the rest (matmuls, RoPE/append, embedding: GPU - attention) and the achieved
TFLOP/s of each, counting 2 FLOP per multiply-add: matmuls 2 * params-per-token per token,
causal attention 4 * H_qo * D per (query, key) pair (q.k and p.V).
"""

from __future__ import annotations

import json
import random
import time

from app.bench.inputs import bench_inputs
from model_glue.gpu.artifact import folder_readers
from model_glue.model.generate import generate
from model_glue.loading import load_model
from model_glue.options import RunOptions

WARMUP_SECONDS = 3.0
FIRST_TURN = 1536  # the tokens before a follow-up turn (app.page_bench.prefill_check.prefill_benchmark)


async def follow_ups(model, lengths: list[int], decode_ms: float | None) -> list[dict]:
    """Follow-up turns of these lengths after a first turn (up to 1,536 tokens), their attention by
    the causal prefill kernel and as a decode batch (RunOptions.short_prefill_decode_attention)."""
    from app.page_bench.prefill_check import prefill_benchmark

    rows = (await prefill_benchmark(model, tokens=(), short_turns=tuple(lengths)))["rows"]
    for r in rows:
        steps = f"{r['gpu_ms'] / decode_ms:5.1f} decode steps" if decode_ms and r["gpu_ms"] else ""
        print(f"{r['turn']:>26} {r['tokens']:>3} tokens: GPU {r['gpu_ms']:8.2f} ms (attention {r['attention_ms']:7.2f}) "
              f"{steps}  [{r['kernel']}]", flush=True)
    return rows


def matmul_flops_per_token(c) -> int:
    """2 FLOP per weight of every layer matmul (the head runs for the last token only)."""
    per_layer = c.qkv_dim * c.dim + c.dim * c.n_heads * c.head_dim + 3 * c.ffn_dim * c.dim
    return 2 * per_layer * c.n_layers


def attention_flops(c, prompt: int, cached: int = 0) -> int:
    """Causal attention of `prompt` new tokens after `cached` ones: token i attends cached + i + 1 keys."""
    pairs = prompt * cached + prompt * (prompt + 1) // 2
    return 4 * pairs * c.n_heads * c.head_dim * c.n_layers


async def run_prefill_bench(args) -> dict:
    device, library, model_dir, weights = await bench_inputs(args)
    read_text, read_bytes = folder_readers(model_dir)
    longest = max(args.prompts + [FIRST_TURN + max(args.follow_ups)] if args.follow_ups else args.prompts)
    model = await load_model(device, library, read_text, read_bytes, options=RunOptions(max_context=longest + 16),
                             dtype=None if args.dtype == "auto" else args.dtype)
    c = model.config
    chunks = args.chunks or [model.options.prefill_chunk]
    matmuls = "subgroup-matrix" if model.has_prefill_matrix else f"scalar ({model.prefill_matrix_why_not})"
    print(f"adapter: {device.adapter_name}; model: {weights}; dtype {model.dtype}; GPU time: "
          f"{'timestamps' if device.has_timestamps else 'unavailable'}; default chunk {model.options.prefill_chunk}; "
          f"prefill matmuls: {matmuls}", flush=True)
    print(f"{'prompt':>6} {'chunk':>5} {'passes':>6} {'tok/s':>9} {'TTFT ms':>8} {'GPU ms':>8} {'attn ms':>8} "
          f"{'rest ms':>8} {'attn TFLOP/s':>12} {'rest TFLOP/s':>12}")
    rng = random.Random(0)
    rows = []
    for chunk in chunks:
        options = RunOptions(prefill_chunk=chunk)
        # warm-up: first dispatches compile on some drivers, and a GPU's clocks ramp up only under
        # sustained work (the H200 idles at 345 MHz): --warmup runs, and the first chunk size for
        # at least WARMUP_SECONDS
        warmup_until = time.perf_counter() + (WARMUP_SECONDS if chunk == chunks[0] else 0)
        runs = 0
        while runs < args.warmup or time.perf_counter() < warmup_until:
            model.reset()
            await generate(model, [rng.randrange(3, c.vocab_size) for _ in range(min(max(args.prompts), 2 * chunk))],
                           max_new_tokens=1, options=options)
            runs += 1
        for prompt_len in args.prompts:
            prompt = [rng.randrange(3, c.vocab_size) for _ in range(prompt_len)]
            best = None
            for _ in range(args.repeats):
                model.reset()
                run = await generate(model, prompt, max_new_tokens=1, options=options)
                passes = [s for s in run.stats if s.kind == "prefill"]
                gpu = None if any(s.gpu_ms is None for s in passes) else sum(s.gpu_ms for s in passes)
                attn = None if any(s.attention_ms is None for s in passes) else sum(s.attention_ms for s in passes)
                if best is None or run.prefill_ms < best[0]:
                    best = (run.prefill_ms, gpu, attn, len(passes))
            ttft, gpu, attn, count = best
            rest = None if gpu is None or attn is None else gpu - attn
            row = {"prompt": prompt_len, "chunk": chunk, "passes": count, "tok_s": round(prompt_len / ttft * 1e3, 1),
                   "ttft_ms": round(ttft, 2), "gpu_ms": gpu and round(gpu, 3), "attention_ms": attn and round(attn, 3),
                   "rest_ms": rest and round(rest, 3),
                   "attention_tflops": attn and round(attention_flops(c, prompt_len) / attn / 1e9, 4),
                   "rest_tflops": rest and round(matmul_flops_per_token(c) * prompt_len / rest / 1e9, 4)}
            rows.append(row)

            def show(value, digits=1):
                return "-" if value is None else f"{value:.{digits}f}"

            print(f"{prompt_len:>6} {chunk:>5} {count:>6} {row['tok_s']:>9.1f} {ttft:>8.1f} {show(gpu):>8} "
                  f"{show(attn):>8} {show(rest):>8} {show(row['attention_tflops'], 3):>12} "
                  f"{show(row['rest_tflops'], 3):>12}", flush=True)
    # a decode step's GPU time beside them: what a short prompt's prefill is measured against
    model.reset()
    run = await generate(model, [rng.randrange(3, c.vocab_size) for _ in range(min(args.prompts))], max_new_tokens=9)
    decode = sorted(s.gpu_ms for s in run.stats if s.kind == "decode" and s.gpu_ms is not None)
    decode_ms = decode[len(decode) // 2] if decode else None
    if decode_ms:
        print(f"decode step GPU ms (median of {len(decode)}): {decode_ms:.3f}; each prompt's GPU ms in decode steps: "
              + ", ".join(f"{r['prompt']}: {r['gpu_ms'] / decode_ms:.1f}" for r in rows if r["gpu_ms"]), flush=True)
    result = {"adapter": device.adapter_name, "model": weights, "dtype": model.dtype, "prefill_matmuls": matmuls,
              "decode_step_gpu_ms": decode_ms, "rows": rows}
    if args.follow_ups:
        result["follow_ups"] = await follow_ups(model, args.follow_ups, decode_ms)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
