"""A chat session over the model: prompt formatting, streaming text, stop, comparison mode.

Runs unchanged in the page (Pyodide, through chat.page) and in the native CLI (`python -m app generate`).
"""

from __future__ import annotations

import math
import statistics
import time
from array import array
from dataclasses import replace

from contract.attention import NESTS
from model_glue.errors import ModelError
from model_glue.formats.chat_template import ChatTemplate
from model_glue.model.generate import GREEDY, STOPPED_IN_PREFILL, Generation, Sampling, generate
from model_glue.model.llama import LlamaModel
from model_glue.options import RunOptions
from model_glue.policy import TILED_MAX_CONTEXT
from model_glue.sources import OpenedModel

DEFAULT_MAX_NEW_TOKENS = 128
MAX_MESSAGE_CHARS = 8000  # a longer message is refused before tokenizing


class ChatSession:
    """A conversation over an opened model (model_glue.sources.open_model): its messages, replies
    streamed as text, stop, comparison mode."""

    def __init__(self, opened: OpenedModel):
        self.model: LlamaModel = opened.model
        self.tokenizer = opened.tokenizer
        self.template: ChatTemplate = opened.template
        # a GGUF's tokenizer knows its template's end-of-turn markers; the served SmolLM2's stops at <|im_end|>
        self.stop_ids = getattr(self.tokenizer, "turn_end_ids", None) or self.tokenizer.stop_ids
        self.messages: list[dict] = []
        self._stop_requested = False

    def request_stop(self) -> None:
        """Ask a running reply to stop after the current token or prefill chunk.

        A reply stopped after its first token keeps its partial text; one stopped during prefill
        has none, and its turn is not added to the conversation.
        """
        self._stop_requested = True

    def reset(self) -> None:
        """New chat: forget the conversation and the cache."""
        self.messages = []
        self.model.reset()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text)
        bos = getattr(self.tokenizer, "bos_id", None)
        if getattr(self.tokenizer, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids  # the file asks for BOS and the template did not write it
        return ids

    def _checked_prompt(self, user_text: str) -> list[dict]:
        text = (user_text or "").strip()
        if not text:
            raise ModelError("the message is empty")
        if len(text) > MAX_MESSAGE_CHARS:
            raise ModelError(f"the message has {len(text)} characters; the limit is {MAX_MESSAGE_CHARS}")
        return self.messages + [{"role": "user", "content": text}]

    async def reply(self, user_text: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                    options: RunOptions | None = None, sampling: Sampling = GREEDY, reuse_cache: bool = True,
                    on_text=None, on_step=None, on_prefill=None) -> dict:
        """Add a user message, generate the assistant's reply (streamed through on_text), run with
        `options` (default: the model's; model_glue.options).

        With `reuse_cache` (the default) only the tokens after the conversation's cached prefix
        are prefilled; the reply's `speed` says how many that was.
        """
        started = time.perf_counter()  # time to first token counts tokenizing too
        messages = self._checked_prompt(user_text)
        ids = self.prompt_ids(messages)
        result = await self._run(ids, max_new_tokens, options, on_text, on_step, on_prefill,
                                 sampling=sampling, reuse_cache=reuse_cache, started=started)
        if result["stop_reason"] != STOPPED_IN_PREFILL:
            self.messages = messages + [{"role": "assistant", "content": result["text"]}]
        return result

    async def _run(self, ids, max_new_tokens, options, on_text, on_step=None, on_prefill=None, *,
                   sampling=GREEDY, reuse_cache=False, forced_ids=None, on_logits=None, started=None) -> dict:
        started = time.perf_counter() if started is None else started
        self._stop_requested = False
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        pieces: list[str] = []
        first_token_at = []

        async def on_token(token_id: int):
            if not first_token_at:
                first_token_at.append(time.perf_counter())
            if on_step is not None:
                on_step(self.model.stats[-1].to_dict())
            piece = decoder.push(token_id)
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        gen = await generate(self.model, ids, max_new_tokens=max_new_tokens, stop_ids=self.stop_ids,
                             options=options, sampling=sampling, reuse_cache=reuse_cache, forced_ids=forced_ids,
                             on_token=on_token, on_prefill=on_prefill, on_logits=on_logits,
                             should_stop=lambda: self._stop_requested)
        tail = decoder.flush()
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        ttft_ms = (first_token_at[0] - started) * 1e3 if first_token_at else None
        return {"text": "".join(pieces), "token_ids": gen.token_ids, "prompt_tokens": len(ids),
                "stop_reason": gen.stop_reason, "seed": gen.seed, "speed": speed_figures(gen, ttft_ms),
                "stats": [s.to_dict() for s in gen.stats]}

    async def compare(self, user_text: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                      options: RunOptions | None = None, on_progress=None) -> dict:
        """The same prompt greedily (always) through each nest: texts, first divergence, timing curves.

        Each nest prefills the whole prompt (no cache reuse, so their timings are comparable).
        Teacher-forced agreement feeds the sharded nest the tiled run's tokens and counts how often
        its top-1 equals the tiled token; while the texts are identical the sharded run already was
        fed those tokens, so the extra run happens only after a divergence. At each miss it reads
        both runs' logits (`forced_misses`): the sharded run's in that extra run, the tiled run's in
        a repeat of it fed its own tokens up to the last miss. The conversation so far
        is the context; the compared replies are not added to it. Unlike a chat turn (one decode
        step in RunOptions.time_attention_every), every decode step times its attention: the
        comparison's curves are its point, and its tokens/s carry the per-layer passes' cost. And a
        split call's merge runs as its own dispatch (RunOptions.merge_in_o False), so that each
        nest's attention time holds all of its work.
        """
        ids = self.prompt_ids(self._checked_prompt(user_text))
        runs = {}
        for nest in NESTS:
            if on_progress is not None:
                on_progress(nest)
            runs[nest] = await self._run(ids, max_new_tokens, self._compared(options, nest), None)
        a, b = runs["tiled"]["token_ids"], runs["sharded"]["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        forced, misses, repeated = b, [], None
        if first is not None and a:
            forced, misses, repeated = await self.forced_misses(ids, a, options, on_progress)
        matches = sum(x == y for x, y in zip(a, forced))
        return {"runs": runs, "first_divergence": first, "identical": first is None,
                "teacher_forced": {"steps": len(a), "matches": matches,
                                   "match_rate": matches / len(a) if a else None,
                                   "misses": misses, "near_tie_logits": NEAR_TIE_LOGITS,
                                   "tiled_repeated": repeated},
                "past_switch": attention_past_switch(runs)}

    @staticmethod
    def _compared(options: RunOptions | None, nest: str) -> RunOptions:
        """A comparison run's options: the nest forced, every step's attention timed, a split call's
        merge in its own dispatch."""
        return replace(options or RunOptions(), attention=nest, time_attention_every=1, merge_in_o=False)

    async def forced_misses(self, ids: list[int], tiled: list[int], options: RunOptions | None,
                            on_progress=None) -> tuple[list[int], list[dict], bool | None]:
        """The sharded nest fed the tiled run's tokens: its predictions, and at each one that
        misses the tiled token both runs' figures there (`miss_figures`). The tiled run's logits
        come from a repeat of it fed its own tokens up to the last miss. Reading a step's logits
        needs it alone in flight, so both runs go one step at a time; logits come back only at
        misses. Also returns whether the repeat picked the tiled run's tokens again (None: no miss,
        no repeat)."""
        sharded_rows: dict[int, bytes] = {}

        async def keep_sharded_miss(index: int, token_id: int) -> None:
            if token_id != tiled[index]:
                sharded_rows[index] = await self.model.read_logits()

        if on_progress is not None:
            on_progress("sharded, fed the tiled tokens,")
        forced = (await self._run(ids, len(tiled), replace(options or RunOptions(), attention="sharded"), None,
                                  forced_ids=tiled, on_logits=keep_sharded_miss))["token_ids"]
        if not sharded_rows:
            return forced, [], None
        misses: list[dict] = []

        async def figure_miss(index: int, token_id: int) -> None:
            if index in sharded_rows:
                misses.append(miss_figures(index, tiled[index], forced[index], await self.model.read_logits(),
                                           sharded_rows.pop(index)))

        if on_progress is not None:
            on_progress("tiled, again for its logits at the misses,")
        last = max(sharded_rows) + 1
        repeat = (await self._run(ids, last, self._compared(options, "tiled"), None, forced_ids=tiled[:last],
                                  on_logits=figure_miss))["token_ids"]
        return forced, misses, repeat == tiled[:len(repeat)]  # a stop ends the repeat early, not differently


# A teacher-forced miss is a near-tie when in each run the other run's pick is within this many logits
# of its own (at least e^-0.5 = 61% as likely; docs/benchmarks.md has the misses it was set from).
NEAR_TIE_LOGITS = 0.5


def logits_row(raw: bytes) -> array:
    """A logits buffer's raw f32 bytes as floats."""
    row = array("f")
    row.frombytes(raw)
    return row


def pick_figures(row: array, pick: int, other: int) -> dict:
    """One run's logits where the two runs' picks differ: its top-1 minus top-2 logit (`margin`), how
    far its own pick led the other run's (`lead`), and the other pick's rank in it (2: its runner-up)."""
    best = max(row)
    at = row.index(best)
    second = max(max(row[:at], default=-math.inf), max(row[at + 1:], default=-math.inf))
    return {"margin": best - second, "lead": row[pick] - row[other],
            "other_rank": 1 + sum(map(row[other].__lt__, row))}  # values above the other pick (in C)


def miss_figures(step: int, tiled_id: int, sharded_id: int, tiled_raw: bytes, sharded_raw: bytes) -> dict:
    """A teacher-forced miss at generated token `step`: each run's figures (`pick_figures`), the two
    runs' logits' relative L2 difference there, and whether it is a near-tie (`is_near_tie`)."""
    tiled_row, sharded_row = logits_row(tiled_raw), logits_row(sharded_raw)
    tiled = pick_figures(tiled_row, tiled_id, sharded_id)
    sharded = pick_figures(sharded_row, sharded_id, tiled_id)
    zeros = array("f", bytes(len(tiled_raw)))
    rel_l2 = math.dist(tiled_row, sharded_row) / (math.dist(tiled_row, zeros) or 1.0)
    return {"step": step, "tiled_id": tiled_id, "sharded_id": sharded_id, "tiled": tiled, "sharded": sharded,
            "logits_rel_l2": rel_l2, "near_tie": is_near_tie(tiled, sharded)}


def is_near_tie(tiled: dict, sharded: dict) -> bool:
    """Each run's pick within NEAR_TIE_LOGITS of the other run's pick."""
    return max(tiled["lead"], sharded["lead"]) <= NEAR_TIE_LOGITS


def speed_figures(gen: Generation, ttft_ms: float | None) -> dict:
    """What WebLLM reports per reply: time to first token, prefill and decode tokens per second."""
    return {
        "ttft_ms": ttft_ms,
        "reused_tokens": gen.reused_tokens,
        "prefill_tokens": gen.prefill_tokens,
        "prefill_tok_s": gen.prefill_tokens / (gen.prefill_ms / 1e3) if gen.prefill_ms > 0 and gen.token_ids else None,
        "decode_tokens": gen.decode_steps,
        "decode_tok_s": gen.decode_steps / (gen.decode_ms / 1e3) if gen.decode_steps and gen.decode_ms > 0 else None,
    }


def attention_past_switch(runs: dict) -> dict:
    """Median attention ms per nest over decode steps whose context is past the tiled nest's range."""
    medians = {}
    for nest, run in runs.items():
        times = [s["attention_ms"] for s in run["stats"]
                 if s["kind"] == "decode" and s["context"] > TILED_MAX_CONTEXT and s["attention_ms"] is not None]
        medians[nest] = statistics.median(times) if times else None
    tiled, sharded = medians.get("tiled"), medians.get("sharded")
    return {"steps": {nest: sum(1 for s in run["stats"] if s["kind"] == "decode" and s["context"] > TILED_MAX_CONTEXT)
                      for nest, run in runs.items()},
            "median_attention_ms": medians, "speedup": tiled / sharded if tiled and sharded else None}
