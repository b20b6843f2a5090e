"""Generation over a loaded model: how the next token is chosen (`Sampling`), the result
(`Generation`), and `generate` itself (prefill in chunks, then pipelined decode steps)."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from contract.kernels import MAX_TOP_K
from model_glue.errors import ModelError
from model_glue.model.llama import LlamaModel
from model_glue.model.step_stats import StepStats
from model_glue.options import RunOptions

STOPPED_BY_USER = "stopped by user"
STOPPED_IN_PREFILL = "stopped during prefill"


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (temperature 0, the default), or drawn on the GPU from
    the top_k most likely tokens, cut to the smallest set holding top_p of their probability."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed, reported in the result so the text can be redrawn

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ModelError(f"temperature must be between 0 (greedy) and 100, not {self.temperature}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ModelError(f"top-k must be between 1 and {MAX_TOP_K}, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"top-p must be in (0, 1], not {self.top_p}")

    def kernel_values(self, draw: float) -> dict:
        """The sampler kernel's scalars for one draw (uniform in [0, 1))."""
        return {"top_k": self.top_k, "temperature": self.temperature, "top_p": self.top_p, "draw": draw}


GREEDY = Sampling()


@dataclass
class Generation:
    """The result of `generate`: ids, why it stopped, and the per-pass statistics."""

    token_ids: list[int] = field(default_factory=list)
    stop_reason: str = ""
    stats: list[StepStats] = field(default_factory=list)
    seed: int | None = None  # the sampling seed used (None: greedy)
    reused_tokens: int = 0  # prompt tokens whose K/V were already in the cache (not prefilled again)
    prefill_tokens: int = 0  # prompt tokens prefilled by this call
    prefill_ms: float = 0.0  # wall time from the call to the first token (prefill passes and their readback)
    decode_ms: float = 0.0  # wall time of the decode steps (one per generated token after the first)

    @property
    def decode_steps(self) -> int:
        return max(len(self.token_ids) - 1, 0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def generate(model: LlamaModel, prompt_ids: list[int], *, max_new_tokens: int, stop_ids=(),
                   options: RunOptions | None = None, sampling: Sampling = GREEDY, reuse_cache: bool = False,
                   forced_ids=None, on_token=None, on_prefill=None, on_logits=None,
                   should_stop=lambda: False) -> Generation:
    """Prefill the prompt (in chunks), then one decode step per token, each token chosen by
    `sampling` (greedy by default; a seeded sampling run is reproducible). `options` (default: the
    model's) say how the passes run: the attention nest, a forced layout, replay, chunk size.

    With `reuse_cache`, the cache keeps its longest prefix shared with `prompt_ids` and only the
    rest is prefilled (a chat's next turn); at least the last prompt token always runs, since its
    logits give the first new token. `should_stop` is asked between prefill chunks and after
    every token: a stop during prefill ends with no tokens and stop_reason STOPPED_IN_PREFILL.
    `on_prefill(done, total)` reports prompt tokens prefilled so far. With `forced_ids`
    (teacher forcing) step i is fed forced_ids[i - 1] instead of its own prediction, and the run
    makes exactly len(forced_ids) predictions; `token_ids` holds the predictions.
    `on_logits(index, token_id)` is awaited after each prediction while the model's logits buffer
    (LlamaModel.read_logits) still holds the logits it came from; decode steps then run one at a
    time, not pipelined (the next step would overwrite them).
    """
    started = time.perf_counter()
    result = Generation()
    model.stats.clear()
    if not prompt_ids:
        raise ModelError("the prompt is empty")
    sampling.check()
    try:
        model.kv.check_fits(len(prompt_ids), max_new_tokens)
        await model.use(options, sampling)
    except ModelError:
        model.reset()  # the next request starts from an empty cache
        raise
    draws = None
    if not sampling.greedy:
        result.seed = random.randrange(2**31) if sampling.seed is None else sampling.seed
        draws = random.Random(result.seed)
    keep = min(common_prefix(model.cached_ids, prompt_ids), len(prompt_ids) - 1) if reuse_cache else 0
    model.rollback(keep)
    result.reused_tokens, result.prefill_tokens = keep, len(prompt_ids) - keep
    try:
        await _run_generation(model, prompt_ids[keep:], result, max_new_tokens, stop_ids, sampling, draws,
                              forced_ids, on_token, on_prefill, on_logits, should_stop, started)
    except BaseException:
        model.reset()  # a pass that failed midway leaves the cache's contents unknown
        raise
    result.stats = list(model.stats)
    return result


async def _run_generation(model, new_ids, result, max_new_tokens, stop_ids, sampling, draws, forced_ids,
                          on_token, on_prefill, on_logits, should_stop, started) -> None:
    def draw() -> float:
        return 0.0 if draws is None else draws.random()

    # Prefill chunks are pipelined too: chunk i+1 is submitted before chunk i is read back.
    pending = None

    async def finish_chunk(step):
        token = await model.finish(step)
        if on_prefill is not None:
            on_prefill(min(step.start - start_length + step.tokens, len(new_ids)), len(new_ids))
        return token

    start_length = model.kv.length
    chunk = model.prefill_chunk
    for chunk_start in range(0, len(new_ids), chunk):
        if should_stop():
            if pending is not None:
                await finish_chunk(pending)  # what was submitted stays in the cache, as before
            result.stop_reason = STOPPED_IN_PREFILL
            return
        last_chunk = chunk_start + chunk >= len(new_ids)  # only its token is kept, and drawn
        step = model.submit(new_ids[chunk_start:chunk_start + chunk], sampling if last_chunk else GREEDY,
                            draw() if last_chunk else 0.0, kind="prefill")
        if pending is not None:
            await finish_chunk(pending)
        pending = step
    next_id = await finish_chunk(pending)
    decode_started = time.perf_counter()
    result.prefill_ms = (decode_started - started) * 1e3
    limit = max_new_tokens if forced_ids is None else len(forced_ids)

    def submit_step(predicted: int, known_id: int | None = None):
        """The decode step that predicts token `predicted + 1`. Its input, token `predicted`, is
        the id the host knows, or else still on the GPU (the previous step chose it), unless
        teacher forcing feeds another."""
        fed = [known_id] if known_id is not None else None
        if forced_ids is not None:
            fed = [forced_ids[predicted - 1]]
        return model.submit(fed, sampling, draw())

    # Pipelined: up to `pipeline_depth` steps are in flight, so the GPU works through the next ones
    # while the host waits for an id, reports it and encodes another step. A stop found in an id
    # read back discards the steps already submitted after it; nothing of them remains.
    depth = 1 if on_logits is not None else model.run.pipeline_depth
    in_flight: deque = deque()
    while True:
        result.token_ids.append(next_id)
        result.decode_ms = (time.perf_counter() - decode_started) * 1e3
        if on_logits is not None:  # nothing is in flight: the logits buffer is this prediction's
            await on_logits(len(result.token_ids) - 1, next_id)
        if on_token is not None:
            await on_token(next_id)
        if forced_ids is None and next_id in stop_ids:
            result.stop_reason = "stop token"
        elif len(result.token_ids) >= limit:
            result.stop_reason = "max tokens"
        elif should_stop():
            result.stop_reason = STOPPED_BY_USER
        if result.stop_reason:
            await model.discard(list(in_flight))
            return
        known = len(result.token_ids)
        if not in_flight:  # the first step after the prefill, whose id the host has
            in_flight.append(submit_step(known, next_id))
        while len(in_flight) < depth and known + len(in_flight) < limit:  # steps that may be wanted
            in_flight.append(submit_step(known + len(in_flight)))
        next_id = await model.finish(in_flight.popleft())
