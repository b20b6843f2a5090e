"""A GGUF's own tokenizer, built from its metadata in pure Python (it runs in Pyodide too).

- `tokenizer.ggml.model` "gpt2": byte-level BPE with the file's merges (model_glue.formats.tokenizer's
  BPETokenizer), its split pattern named by `tokenizer.ggml.pre` (PRE_TOKENIZERS);
- "llama": SentencePiece as llama.cpp runs it (`SentencePieceTokenizer`): spaces become U+2581, a
  space is put before the text and after each special token, adjacent pieces merge highest score first, and characters without a
  piece fall back to their bytes' <0xXX> tokens.

Control and user-defined tokens are cut out of the text first in both (so a chat template's markers
are single ids).
"""

from __future__ import annotations

import codecs
import heapq
import re

from model_glue.errors import ModelError
from model_glue.formats.tokenizer import BPETokenizer, SpecialsFirst, special_token_pattern

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_TYPES = (CONTROL, USER_DEFINED)
# tokenizer.ggml.pre -> (split pattern, digits each a pre-token first)
PRE_TOKENIZERS = {"smollm": ("gpt2", True), "gpt-2": ("gpt2", False), "llama-bpe": ("llama3", False),
                  "llama3": ("llama3", False), "qwen2": ("qwen2", False)}  # qwen2: Qwen 2 / 2.5 / 3's files
SPACE = "\u2581"  # SentencePiece's visible space


def tokenizer_from_gguf(metadata: dict):
    """The runtime tokenizer of a GGUF's metadata, or a ModelError naming what is not supported."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError("the GGUF has no tokenizer (tokenizer.ggml.tokens)")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in SPECIAL_TYPES}
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    if kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
        if pre not in PRE_TOKENIZERS:
            raise ModelError(f"the GGUF's BPE pre-tokenizer is {pre!r}; this runtime splits text like "
                             f"{', '.join(PRE_TOKENIZERS)}")
        pattern, digits = PRE_TOKENIZERS[pre]
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
        vocab = {t: i for i, t in enumerate(tokens) if t not in special}
        tokenizer = BPETokenizer(vocab, merges, special, individual_digits=digits, eos_id=eos, bos_id=bos,
                                 im_end_id=special.get("<|im_end|>"), split_pattern=pattern,
                                 text_special_ids={i for i in special.values() if types[i] == USER_DEFINED})
    elif kind == "llama":
        tokenizer = SentencePieceTokenizer(tokens, metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                           bos_id=bos, eos_id=eos,
                                           add_space_prefix=metadata.get("tokenizer.ggml.add_space_prefix", True))
    else:
        raise ModelError(f"the GGUF's tokenizer is {kind!r}; this runtime reads 'gpt2' (byte-level BPE) and "
                         "'llama' (SentencePiece)")
    tokenizer.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    # ends a turn: the EOS token, and the template's end-of-turn markers where the vocabulary has them
    # ("</s>" only as a control token: Gemma's vocabulary has a user-defined "</s>", HTML's strikethrough end)
    markers = [i for t, i in special.items() if t in TURN_END_TOKENS and (t != "</s>" or types[i] == CONTROL)]
    tokenizer.turn_end_ids = frozenset(i for i in (eos, *markers) if i is not None)
    return tokenizer


# ChatML, Llama 3, Phi, Llama 2 / Zephyr, GPT-2 style and Gemma turns
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>", "<end_of_turn>")


class SentencePieceTokenizer(SpecialsFirst):
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm): the same ids llama.cpp gives for a file's text."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], *, bos_id=None, eos_id=None,
                 add_space_prefix: bool = True):
        self.tokens, self.scores = tokens, scores
        self.vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED, UNUSED)}
        self.byte_ids = {}
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty == BYTE and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
                self.byte_ids[int(t[3:5], 16)] = i
        self.special_tokens = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in SPECIAL_TYPES}
        self.special_ids = {i: t for t, i in self.special_tokens.items()}
        # user-defined pieces are text (Gemma's "\n", runs of spaces, HTML tags): only control tokens are
        # left out by decode(skip_special_tokens=True)
        self.text_special_ids = frozenset(i for i in self.special_ids if types[i] == USER_DEFINED)
        self.types = types
        self.bos_id, self.eos_id, self.add_space_prefix = bos_id, eos_id, add_space_prefix
        self.unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
        self.show_unknown_ids = False
        self._special_re = special_token_pattern(self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(i for i in (self.eos_id,) if i is not None)

    def token_to_id(self, token: str):
        return self.special_tokens.get(token, self.vocab.get(token))

    def _encode_ordinary(self, text: str, ids: list[int]) -> None:
        # every fragment between special tokens starts the text or follows a special token: llama.cpp
        # puts the space prefix before both
        if self.add_space_prefix:
            text = " " + text
        symbols = list(text.replace(" ", SPACE))
        # merge the adjacent pair whose joined piece scores highest (leftmost on ties), until none is a piece
        alive = [True] * len(symbols)
        right = list(range(1, len(symbols) + 1))
        left = list(range(-1, len(symbols) - 1))
        heap = []

        def push(a):
            b = right[a]
            if b < len(symbols):
                piece = symbols[a] + symbols[b]
                i = self.vocab.get(piece)
                if i is not None:
                    heapq.heappush(heap, (-self.scores[i], a, piece))

        for a in range(len(symbols) - 1):
            push(a)
        while heap:
            _, a, piece = heapq.heappop(heap)
            b = right[a] if alive[a] else len(symbols)
            if b >= len(symbols) or symbols[a] + symbols[b] != piece:
                continue  # stale: one side has merged since
            symbols[a], alive[b] = piece, False
            right[a] = right[b]
            if right[b] < len(symbols):
                left[right[b]] = a
            if left[a] >= 0:
                push(left[a])
            push(a)
        for k, symbol in enumerate(symbols):
            if not alive[k]:
                continue
            i = self.vocab.get(symbol)
            if i is not None:
                ids.append(i)
                continue
            for byte in symbol.encode("utf-8"):  # byte fallback
                fallback = self.byte_ids.get(byte, self.unk_id)
                if fallback is None:
                    raise ModelError(f"the tokenizer has no piece and no byte token for {symbol!r}")
                ids.append(fallback)

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        out = bytearray()
        for i in ids:
            if i in self.special_ids:
                if not skip_special_tokens or i in self.text_special_ids:
                    out += self.special_ids[i].encode()
                continue
            if not 0 <= i < len(self.tokens):
                if self.show_unknown_ids:
                    out += f"<id {i}>".encode()
                    continue
                raise ValueError(f"token id {i} is out of the vocabulary")
            if self.types[i] == BYTE:
                out.append(int(self.tokens[i][3:5], 16))
            else:
                out += self.tokens[i].replace(SPACE, " ").encode()
        return bytes(out)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False):
        return _StreamDecoder(self, skip_special_tokens)


class _StreamDecoder:
    """Text of each new id once its UTF-8 is complete (a byte-fallback character spans several ids)."""

    def __init__(self, tokenizer, skip_special_tokens):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.decode_bytes([token_id], self.skip))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
