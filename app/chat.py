"""A chat session over the model: prompt formatting, streaming text, stop, comparison mode.

Runs unchanged in the page (Pyodide) and in the native CLI (`python -m app generate`).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from model_glue.contract import NESTS
from model_glue.model import STOPPED_IN_PREFILL, LlamaModel, ModelError, generate
from model_glue.tokenizer import BPETokenizer, format_chat

DEFAULT_MAX_NEW_TOKENS = 128
MAX_MESSAGE_CHARS = 8000  # a longer message is refused before tokenizing


class ChatSession:
    def __init__(self, model: LlamaModel, tokenizer: BPETokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.messages: list[dict] = []
        self._stop_requested = False

    @classmethod
    async def load(cls, device, library, model_readers, *, max_context=None, dtype=None, progress=lambda m: None):
        read_text, read_bytes = model_readers
        progress("loading the tokenizer")
        try:
            tokenizer = BPETokenizer.from_json(await read_text("tokenizer.json"),
                                               json.loads(await read_text("tokenizer_config.json")))
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot load the tokenizer: {err}") from err
        model = await LlamaModel.load(device, library, read_text, read_bytes, max_context=max_context,
                                      dtype=dtype, progress=progress)
        return cls(model, tokenizer)

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
        return self.tokenizer.encode(format_chat(messages, add_generation_prompt=True))

    async def reply(self, user_text: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, attention: str = "auto",
                    on_text=None, on_step=None, on_prefill=None) -> dict:
        """Add a user message, generate the assistant's reply (streamed through on_text)."""
        text = (user_text or "").strip()
        if not text:
            raise ModelError("the message is empty")
        if len(text) > MAX_MESSAGE_CHARS:
            raise ModelError(f"the message has {len(text)} characters; the limit is {MAX_MESSAGE_CHARS}")
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        if len(ids) + max_new_tokens > self.model.config.max_context:
            raise ModelError(f"the conversation is {len(ids)} tokens; with {max_new_tokens} new tokens it "
                             f"exceeds the model's context of {self.model.config.max_context}. Start a new chat.")
        result = await self._run(ids, max_new_tokens, attention, on_text, on_step, on_prefill)
        if result["stop_reason"] != STOPPED_IN_PREFILL:
            self.messages = messages + [{"role": "assistant", "content": result["text"]}]
        return result

    async def _run(self, ids, max_new_tokens, attention, on_text, on_step=None, on_prefill=None) -> dict:
        self._stop_requested = False
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        pieces: list[str] = []

        async def on_token(token_id: int):
            if on_step is not None:
                on_step(asdict(self.model.stats[-1]))
            piece = decoder.push(token_id)
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        gen = await generate(self.model, ids, max_new_tokens=max_new_tokens, stop_ids=self.tokenizer.stop_ids,
                             attention=attention, on_token=on_token, on_prefill=on_prefill,
                             should_stop=lambda: self._stop_requested)
        tail = decoder.flush()
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        return {"text": "".join(pieces), "token_ids": gen.token_ids, "prompt_tokens": len(ids),
                "stop_reason": gen.stop_reason, "stats": [asdict(s) for s in gen.stats]}

    async def compare(self, user_text: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, on_progress=None) -> dict:
        """The same prompt greedily through each nest: texts, first divergence, timing curves.

        The conversation so far is the context; the compared replies are not added to it.
        """
        text = (user_text or "").strip()
        if not text:
            raise ModelError("the message is empty")
        ids = self.prompt_ids(self.messages + [{"role": "user", "content": text}])
        runs = {}
        for nest in NESTS:
            if on_progress is not None:
                on_progress(nest)
            runs[nest] = await self._run(ids, max_new_tokens, nest, None)
        a, b = runs["tiled"]["token_ids"], runs["sharded"]["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        return {"runs": runs, "first_divergence": first, "identical": first is None}
