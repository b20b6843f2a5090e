"""`python -m app bench chat`: a multi-turn conversation with and without KV-cache reuse.

The conversation pastes a document of about 1,500 tokens (the page's Long document) and asks
follow-ups, the case where re-prefilling the whole history each turn hurts most. Each turn is
greedy with a fixed token budget, so both modes generate the same ids (checked) and differ only in
what they prefill. Reported per turn: time to first token, tokens prefilled (and reused), prefill
and decode tokens/s. Wall-clock times of whole passes (GPU work waited for), as a user sees them.
`--synthetic` writes random weights of SmolLM2's shape behind its tokenizer (for machines without
the converted model; the speed does not depend on the weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from app.bench.inputs import bench_inputs
from chat.session import ChatSession
from model_glue.sources import Artifact, open_model
from model_glue.gpu.artifact import folder_readers

LONG_DOCUMENT = Path(__file__).resolve().parents[2] / "static" / "long_document.txt"
FOLLOW_UPS = ["Who kept the ledger after Edda Voss died?", "Why did the flood in the quarry year break the pattern?",
              "What did the clerks add to the ledger after that?", "Summarize the whole story in one sentence."]


def conversation(turns: int) -> list[str]:
    document = LONG_DOCUMENT.read_text().strip()
    return [f"{document}\n\nWhat is this document about?"] + FOLLOW_UPS[:turns - 1]


async def run_chat_bench(args) -> dict:
    device, library, model_dir, weights = await bench_inputs(args, tokenizer=True)
    chat = ChatSession(await open_model(device, library, Artifact(folder_readers(model_dir)),
                                        dtype=None if args.dtype == "auto" else args.dtype))
    print(f"adapter: {device.adapter_name}; model: {weights}; dtype {chat.model.dtype}; attention auto; "
          f"{args.turns} turns of up to {args.max_tokens} tokens; wall-clock times", flush=True)
    turns = conversation(args.turns)
    # Warm-up: the first turn once (first use of every pipeline, the largest scratch buffers).
    await chat.reply(turns[0], max_new_tokens=4, reuse_cache=False)
    rows, ids = [], {}
    print(f"{'cache':>8} {'turn':>4} {'prompt':>6} {'reused':>6} {'prefilled':>9} {'TTFT ms':>8} "
          f"{'prefill tok/s':>13} {'decode tok/s':>12} {'tokens':>6}")
    for reuse in (True, False):
        mode = "reuse" if reuse else "no reuse"
        chat.reset()
        ids[mode] = []
        for turn, text in enumerate(turns, 1):
            result = await chat.reply(text, max_new_tokens=args.max_tokens, reuse_cache=reuse)
            speed = result["speed"]
            ids[mode].append(result["token_ids"])
            row = {"cache": mode, "turn": turn, "prompt_tokens": result["prompt_tokens"], **speed,
                   "generated": len(result["token_ids"])}
            rows.append(row)
            print(f"{mode:>8} {turn:>4} {result['prompt_tokens']:>6} {speed['reused_tokens']:>6} "
                  f"{speed['prefill_tokens']:>9} {speed['ttft_ms']:>8.1f} {speed['prefill_tok_s'] or 0:>13.1f} "
                  f"{speed['decode_tok_s'] or 0:>12.1f} {len(result['token_ids']):>6}", flush=True)
    same = ids["reuse"] == ids["no reuse"]
    print(f"generated ids identical with and without reuse: {same}")
    for mode in ("reuse", "no reuse"):
        total = sum(r["ttft_ms"] for r in rows if r["cache"] == mode)
        print(f"{mode:>8}: total time to first token over {len(turns)} turns {total:.0f} ms")
    result = {"adapter": device.adapter_name, "model": weights, "dtype": chat.model.dtype, "rows": rows,
              "identical_ids": same}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
