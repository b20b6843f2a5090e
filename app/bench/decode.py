"""`python -m app bench decode`: prefill and decode throughput of the whole model: auto, auto with the
sharded family held to the unsplit sharded nest, and tiled forced.

For each context C: the model is reset, a C-token prompt is prefilled (tokens/s), then --steps
greedy decode steps run (tokens/s, and attention's share of the step from GPU timestamps).
The prompt is random token ids: throughput does not depend on the text. `--synthetic` writes
random weights of SmolLM2's shape (for machines without the converted model).
"""

from __future__ import annotations

import json
import random
import tempfile
import time

from model_glue.artifact import KernelLibrary, folder_readers
from model_glue.model import GREEDY, MAX_PREFILL_CHUNK, LlamaModel, Sampling
from model_glue.webgpu import WgpuDevice


async def run_decode_bench(args) -> dict:
    device = await WgpuDevice.open()
    library = await KernelLibrary.from_folder(device, args.kernels)
    model_dir = args.model
    if args.synthetic:
        from convert.weights import write_random_artifact

        model_dir = tempfile.mkdtemp(prefix="smollm2-synthetic-")
        write_random_artifact("smollm2_135m", model_dir, seed=0)
    read_text, read_bytes = folder_readers(model_dir)
    max_context = max(args.contexts) + args.steps + 1
    model = await LlamaModel.load(device, library, read_text, read_bytes, max_context=max_context,
                                  dtype=None if args.dtype == "auto" else args.dtype)
    weights = "synthetic SmolLM2-shaped" if args.synthetic else str(model_dir)
    print(f"adapter: {device.adapter_name}; model: {weights}; dtype {model.dtype}; "
          f"attention time: {'GPU timestamps' if device.has_timestamps else 'unavailable'}", flush=True)
    print(f"{'context':>7} {'attention':>12} {'prefill tok/s':>13} {'decode tok/s':>12} {'step ms':>8} "
          f"{'attn ms':>8} {'attn share':>10} {'ran':>16}")
    rng = random.Random(0)
    # auto; auto with the sharded family held to the unsplit sharded nest; tiled forced; with --sample
    # also auto drawing each token on the GPU (top-k 40, top-p 0.95) instead of the argmax.
    modes = [("auto", None), ("auto", "sharded"), ("tiled", None)] + ([("auto", "sample")] if args.sample else [])
    sampled = Sampling(temperature=1.0, top_k=40, top_p=0.95, seed=0)
    # Warm-up: first use of each pipeline and buffer costs extra on some drivers.
    for attention, override in modes:
        model.reset()
        model.sharded_override = None if override == "sample" else override
        sampling = sampled if override == "sample" else GREEDY
        token = await model.forward([rng.randrange(3, model.config.vocab_size) for _ in range(300)], attention)
        for _ in range(3):
            token = await model.forward([token], attention, sampling, rng.random())
    rows = []
    for context in args.contexts:
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(context)]
        for attention, override in modes:
            label = attention if override is None else f"{attention}:{override}"
            model.sharded_override = None if override == "sample" else override
            sampling = sampled if override == "sample" else GREEDY
            model.reset()
            started = time.perf_counter()
            token = None
            for i in range(0, context, MAX_PREFILL_CHUNK):
                token = await model.forward(prompt[i:i + MAX_PREFILL_CHUNK], attention)
            prefill_s = time.perf_counter() - started
            steps = []
            for _ in range(args.steps):
                token = await model.forward([token], attention, sampling, rng.random())
                steps.append(model.stats[-1])
            step_ms = sum(s.step_ms for s in steps) / len(steps)
            attn = [s.attention_ms for s in steps if s.attention_ms is not None]
            attn_ms = sum(attn) / len(attn) if attn else None
            row = {"context": context, "attention": label, "prefill_tok_s": round(context / prefill_s, 2),
                   "decode_tok_s": round(1000 / step_ms, 2), "step_ms": round(step_ms, 3),
                   "attention_ms": None if attn_ms is None else round(attn_ms, 4),
                   "attention_share": None if attn_ms is None else round(attn_ms / step_ms, 4),
                   "nests": sorted({s.variant for s in steps})}
            rows.append(row)
            share = "-" if attn_ms is None else f"{100 * attn_ms / step_ms:.1f}%"
            print(f"{context:>7} {label:>12} {row['prefill_tok_s']:>13.1f} {row['decode_tok_s']:>12.2f} "
                  f"{step_ms:>8.2f} {('-' if attn_ms is None else f'{attn_ms:.3f}'):>8} {share:>10} "
                  f"{','.join(row['nests']):>16}", flush=True)
    model.sharded_override = None
    result = {"adapter": device.adapter_name, "model": weights, "dtype": model.dtype, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
