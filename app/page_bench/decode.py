"""The page's decode step timed from the host's side (`python -m app bench page`): how long Python or
the JS replay takes to encode a step, against the step's wall and GPU time."""

from __future__ import annotations

from model_glue.model.generate import generate
from model_glue.options import RunOptions


async def decode_encode_benchmark(chat, steps: int, replay: bool, context: int = 1, pipeline_depth=None) -> dict:
    """`steps` greedy decode steps after a prompt of `context` tokens; per step the host's encode
    time, the step's wall time and its GPU time, and decode tokens per second.

    With `replay` false every pass is encoded in Python, the way the native path's first step is;
    with it true, decode steps replay the recorded passes in one call into JS (static/replay.js).
    `pipeline_depth` (None: the default) is how many steps are in flight. The prompt past its first
    token is arbitrary ids (attention's cost does not depend on them). The chat's KV cache is
    emptied (its next reply prefills the conversation again).
    """
    model = chat.model
    vocab = model.config.vocab_size
    prompt = [chat.tokenizer.bos_id or 1] + [(7919 * i) % (vocab - 256) + 256 for i in range(1, int(context))]
    depth = None if pipeline_depth in (None, "") else int(pipeline_depth)
    model.reset()
    try:
        run = await generate(model, prompt, max_new_tokens=int(steps) + 1,
                             options=RunOptions(replay=bool(replay), pipeline_depth=depth))
    finally:
        model.reset()
    decode = [s for s in run.stats if s.kind == "decode"]
    return {"replay": bool(replay), "context": len(prompt), "pipeline_depth": model.run.pipeline_depth,
                       "token_ids": run.token_ids, "decode_tok_s": run.decode_steps / (run.decode_ms / 1e3),
                       "encode_ms": [s.encode_ms for s in decode], "step_ms": [s.step_ms for s in decode],
                       "gpu_ms": [s.gpu_ms for s in decode], "wait_ms": [s.wait_ms for s in decode],
                       "gpu_gap_ms": [s.gpu_gap_ms for s in decode], "attention_ms": [s.attention_ms for s in decode],
                       "dispatches": [s.dispatches for s in decode],
                       "replayed_by": model.replayed_by if replay else None}
