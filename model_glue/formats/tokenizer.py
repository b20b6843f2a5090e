"""Run-time byte-level BPE tokenizer (every BPE GGUF the runtime serves), in pure standard-library Python.

It runs in Pyodide as well as natively, so it cannot use `tokenizers`, numpy or the `regex` module.
It reads the `tokenizer.json` that `convert.tokenizer` writes from the model GGUF and must
produce exactly the ids HF `tokenizers` produces for it (the tests check this):

1. special tokens (`<|im_start|>` ...) are cut out of the text first and map to their ids;
2. each remaining span is split so that every numeric character stands alone (Digits pre-tokenizer);
3. each piece is split by GPT-2's pattern
   `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`,
   scanned by hand because `re` has no `\\p{..}` classes;
4. each pre-token's UTF-8 bytes are mapped to printable characters and merged by BPE rank.
"""

from __future__ import annotations

import functools

import codecs
import json
import re
import unicodedata

# Unicode White_Space, which is what `\s` matches in the Oniguruma regex HF tokenizers uses.
# (str.isspace() differs: it also accepts U+001C..U+001F.)
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a\u2028\u2029\u202f\u205f\u3000")

# Character classes of the split pattern.
_SPACE, _LETTER, _NUMBER, _OTHER = 0, 1, 2, 3

_CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")  # after an apostrophe; case-sensitive like GPT-2


# Letters and numbers that HF `tokenizers` knows but Unicode 15.0 leaves unassigned (additions of
# Unicode 15.1 to 17.0). `unicodedata` follows the running Python (3.12: Unicode 15.0, Pyodide's 3.14:
# 16.0), while HF 0.23 classifies with Oniguruma's Unicode 16.0 tables (\p{L}, \p{N}) and Rust's
# Unicode 17.0 `char::is_numeric` (Digits). Without this table, e.g. "\u1c89's" or "  \U00010d40"
# encode differently from HF on Python 3.12. Derived by classifying every code point through HF's
# pre-tokenizer; used only for characters the running Python does not know (category Cn).
_NEWER_LETTERS = (
    (0x1C89, 0x1C8A), (0xA7CB, 0xA7CD), (0xA7DA, 0xA7DC), (0x105C0, 0x105F3), (0x10D4A, 0x10D65),
    (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x11380, 0x11389), (0x1138B, 0x1138B), (0x1138E, 0x1138E),
    (0x11390, 0x113B5), (0x113B7, 0x113B7), (0x113D1, 0x113D1), (0x113D3, 0x113D3), (0x11BC0, 0x11BE0),
    (0x13460, 0x143FA), (0x16100, 0x1611D), (0x16D40, 0x16D6C), (0x18CFF, 0x18CFF), (0x1E5D0, 0x1E5ED),
    (0x1E5F0, 0x1E5F0), (0x2EBF0, 0x2EE5D))
_NEWER_NUMBERS = (
    (0x10D40, 0x10D49), (0x116D0, 0x116E3), (0x11BF0, 0x11BF9), (0x11DE0, 0x11DE9), (0x16130, 0x16139),
    (0x16D70, 0x16D79), (0x16FF4, 0x16FF6), (0x1CCF0, 0x1CCF9), (0x1E5F1, 0x1E5FA))


def _classify(ch: str) -> int:
    if ch in _WHITESPACE:
        return _SPACE
    cat = unicodedata.category(ch)
    if cat[0] == "L":
        return _LETTER
    if cat[0] == "N":
        return _NUMBER
    if cat == "Cn":
        cp = ord(ch)
        if any(lo <= cp <= hi for lo, hi in _NEWER_LETTERS):
            return _LETTER
        if any(lo <= cp <= hi for lo, hi in _NEWER_NUMBERS):
            return _NUMBER
    return _OTHER


class _ClassTable(dict):
    """Character -> class, filled on first sight so each character's category is looked up once."""

    def __missing__(self, ch):
        cls = self[ch] = _classify(ch)
        return cls


SPLIT_PATTERNS = ("gpt2", "llama3", "qwen2")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE vocabularies use it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class SpecialsFirst:
    """`encode`: special tokens written in the text become their single ids (the longest at a position),
    the text between them goes to the subclass's `_encode_ordinary`. Needs `special_tokens` (text ->
    id) and `_special_re` (special_token_pattern's)."""

    special_tokens: dict[str, int]
    _special_re: "re.Pattern | None"

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for m in (self._special_re.finditer(text) if self._special_re is not None else ()):
            if m.start() > start:
                self._encode_ordinary(text[start:m.start()], ids)
            ids.append(self.special_tokens[m.group()])
            start = m.end()
        if start < len(text):
            self._encode_ordinary(text[start:], ids)
        return ids

    def _encode_ordinary(self, text: str, ids: list[int]) -> None:
        raise NotImplementedError


def special_token_pattern(special_tokens) -> "re.Pattern | None":
    """One alternation of the special tokens, longest first so a longer one wins at a position."""
    alternatives = sorted(special_tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in alternatives)) if alternatives else None


class BPETokenizer(SpecialsFirst):
    """Byte-level BPE with GPT-2's or Llama 3's pre-tokenizer; `encode` matches HF `tokenizers` id for id."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], special_tokens: dict[str, int],
                 *, individual_digits: bool = True, add_prefix_space: bool = False,
                 eos_id: int | None = None, im_end_id: int | None = None, bos_id: int | None = None,
                 split_pattern: str = "gpt2", text_special_ids=()):
        # A model whose vocabulary is larger than this tokenizer's (a synthetic Llama-3 shape behind
        # SmolLM2's tokenizer: 128,256 ids against 49,152) may emit ids it has no text for; with
        # `show_unknown_ids` they decode as "<id 123456>" instead of raising.
        self.show_unknown_ids = False
        self.vocab = vocab
        self.id_to_token_list: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for tok, i in vocab.items():
            self.id_to_token_list[i] = tok
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.special_tokens = dict(special_tokens)
        self.special_ids = {i: tok for tok, i in self.special_tokens.items()}
        # Special tokens that are text all the same (a GGUF's user-defined ones): cut out of the text when
        # encoding like the others, but kept by `decode(skip_special_tokens=True)`, as llama.cpp and HF do.
        self.text_special_ids = frozenset(text_special_ids)
        for tok, i in self.special_tokens.items():
            if i >= len(self.id_to_token_list):
                self.id_to_token_list.extend([None] * (i + 1 - len(self.id_to_token_list)))
            self.id_to_token_list[i] = tok
        self.individual_digits = individual_digits
        self.add_prefix_space = add_prefix_space
        if split_pattern not in SPLIT_PATTERNS:
            raise ValueError(f"unknown split pattern {split_pattern!r} (known: {', '.join(SPLIT_PATTERNS)})")
        # GPT-2's pattern (SmolLM2, after its Digits step), Llama 3's (tiktoken's cl100k pattern) or Qwen 2's
        # (Llama 3's with each digit a word of its own)
        self._split_pattern = {"gpt2": self._split_gpt2, "llama3": self._split_llama3,
                               "qwen2": functools.partial(self._split_llama3, max_digits=1)}[split_pattern]
        self._special_re = special_token_pattern(self.special_tokens)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # Per-byte printable strings, indexed by byte value: bytes -> BPE symbols without a dict lookup.
        self._byte_chars = [self.byte_encoder[b] for b in range(256)]
        self._classes = _ClassTable()
        self._cache: dict[str, tuple[int, ...]] = {}
        self._cache_limit = 100_000
        self.bos_id = bos_id
        self._eos_id = eos_id if eos_id is not None else self.special_tokens.get("<|endoftext|>")
        self._im_end_id = im_end_id if im_end_id is not None else self.special_tokens.get("<|im_end|>")

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_json(cls, text: str, config: dict | str | None = None) -> "BPETokenizer":
        """Build from the text of a HF tokenizer.json (and optionally tokenizer_config.json's ids)."""
        data = json.loads(text)
        model = data["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"tokenizer.json model type {model.get('type')!r}; only BPE is supported")
        if model.get("ignore_merges") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError("tokenizer.json uses BPE options this tokenizer does not implement")
        merges = []
        for m in model["merges"]:
            if isinstance(m, str):  # older tokenizer.json files store "left right"
                left, _, right = m.partition(" ")
                merges.append((left, right))
            else:
                merges.append((m[0], m[1]))
        special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}

        individual_digits, add_prefix_space, byte_level = False, False, False
        pre = data.get("pre_tokenizer") or {}
        for p in pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]:
            if p.get("type") == "Digits":
                if not p.get("individual_digits"):
                    raise ValueError("only Digits(individual_digits=True) is supported")
                individual_digits = True
            elif p.get("type") == "ByteLevel":
                if not p.get("use_regex", True):
                    raise ValueError("only ByteLevel(use_regex=True) is supported")
                byte_level = True
                add_prefix_space = bool(p.get("add_prefix_space"))
            elif p:
                raise ValueError(f"unsupported pre-tokenizer {p.get('type')!r}")
        if not byte_level:
            raise ValueError("tokenizer.json has no ByteLevel pre-tokenizer")
        if data.get("normalizer"):
            raise ValueError("tokenizer.json normalizers are not supported")

        if isinstance(config, str):
            config = json.loads(config)
        config = config or {}
        return cls(model["vocab"], merges, special, individual_digits=individual_digits,
                   add_prefix_space=add_prefix_space, eos_id=config.get("eos_id"),
                   im_end_id=config.get("im_end_id"), bos_id=config.get("bos_id"))

    # ------------------------------------------------------------------ ids

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def im_end_id(self) -> int | None:
        return self._im_end_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn: <|im_end|> for chat, the EOS token otherwise."""
        return frozenset(i for i in (self._eos_id, self._im_end_id) if i is not None)

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token_list)

    def token_to_id(self, token: str) -> int | None:
        special = self.special_tokens.get(token)
        return special if special is not None else self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        if 0 <= token_id < len(self.id_to_token_list):
            return self.id_to_token_list[token_id]
        return None

    # ------------------------------------------------------------------ encoding

    def _encode_ordinary(self, text: str, ids: list[int]) -> None:
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        cache = self._cache
        for word in self._split(text):
            toks = cache.get(word)
            if toks is None:
                toks = self._bpe(word)
                if len(cache) >= self._cache_limit:
                    cache.clear()
                cache[word] = toks
            ids.extend(toks)

    def _split(self, text: str) -> list[str]:
        """Pre-tokens of one special-free span: digits isolated, then the GPT-2 pattern per piece."""
        classes = self._classes
        cls = [classes[ch] for ch in text]
        words: list[str] = []
        if not self.individual_digits:
            self._split_pattern(text, cls, 0, len(text), words)
            return words
        # Digits(individual_digits=True) isolates every numeric character (Rust char::is_numeric,
        # i.e. categories Nd/Nl/No = \p{N}); the byte-level pattern then runs on each piece alone,
        # so its lookahead and ' ?' prefixes never see across a digit.
        start = 0
        for i, c in enumerate(cls):
            if c == _NUMBER:
                if i > start:
                    self._split_pattern(text, cls, start, i, words)
                words.append(text[i])
                start = i + 1
        if start < len(text):
            self._split_pattern(text, cls, start, len(text), words)
        return words

    @staticmethod
    def _split_llama3(text: str, cls: list[int], start: int, end: int, words: list[str], max_digits: int = 3) -> None:
        r"""Append the matches of Llama 3's pattern over text[start:end] (a leftmost-first scan):
        `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|`
        `\s*[\r\n]+|\s+(?!\S)|\s+` (Qwen 2's: `\p{N}` for `\p{N}{1,3}`, `max_digits` 1)."""
        i = start
        while i < end:
            c, ch = cls[i], text[i]
            if ch == "'" and i + 1 < end:  # contractions, any case
                suffix = next((s for s in _CONTRACTIONS if text[i + 1:i + 1 + len(s)].lower() == s), None)
                if suffix is not None:
                    words.append(text[i:i + 1 + len(suffix)])
                    i += 1 + len(suffix)
                    continue
            # [^\r\n\p{L}\p{N}]?\p{L}+: letters, maybe after one character that is none of those
            j = i if c == _LETTER else i + 1 if (c != _NUMBER and ch not in "\r\n" and i + 1 < end
                                                 and cls[i + 1] == _LETTER) else None
            if j is not None:
                j += 1
                while j < end and cls[j] == _LETTER:
                    j += 1
                words.append(text[i:j])
                i = j
                continue
            if c == _NUMBER:  # \p{N}{1,max_digits}
                j = i + 1
                while j < end and j - i < max_digits and cls[j] == _NUMBER:
                    j += 1
                words.append(text[i:j])
                i = j
                continue
            # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
            j = i + 1 if ch == " " and i + 1 < end and cls[i + 1] == _OTHER else i
            if cls[j] == _OTHER:
                j += 1
                while j < end and cls[j] == _OTHER:
                    j += 1
                while j < end and text[j] in "\r\n":
                    j += 1
                words.append(text[i:j])
                i = j
                continue
            # whitespace: up to its last line break (\s*[\r\n]+), else all of it but the character
            # before a non-space (\s+(?!\S)), else all of it (\s+)
            k = i + 1
            while k < end and cls[k] == _SPACE:
                k += 1
            last_break = next((m for m in range(k - 1, i - 1, -1) if text[m] in "\r\n"), None)
            if last_break is not None:
                j = last_break + 1
            elif k < end and k - i > 1:
                j = k - 1
            else:
                j = k
            words.append(text[i:j])
            i = j

    @staticmethod
    def _split_gpt2(text: str, cls: list[int], start: int, end: int, words: list[str]) -> None:
        """Append the matches of the GPT-2 pattern over text[start:end] (a leftmost-first scan)."""
        i = start
        while i < end:
            c = cls[i]
            ch = text[i]
            # 's|'t|'re|'ve|'m|'ll|'d
            if ch == "'" and i + 1 < end:
                matched = False
                for suffix in _CONTRACTIONS:
                    j = i + 1 + len(suffix)
                    if j <= end and text[i + 1:j] == suffix:
                        words.append(text[i:j])
                        i = j
                        matched = True
                        break
                if matched:
                    continue
            # ' ?\p{L}+' | ' ?\p{N}+' | ' ?[^\s\p{L}\p{N}]+': a run of one class, maybe after one ' '.
            j = i
            if ch == " " and i + 1 < end and cls[i + 1] != _SPACE:
                j = i + 1
            run = cls[j]
            if run != _SPACE:
                j += 1
                while j < end and cls[j] == run:
                    j += 1
                words.append(text[i:j])
                i = j
                continue
            # '\s+(?!\S)' then '\s+': the whitespace run, minus its last character when a
            # non-space follows (that character then leads the next pre-token).
            j = i + 1
            while j < end and cls[j] == _SPACE:
                j += 1
            if j < end and j - i > 1:
                j -= 1
            words.append(text[i:j])
            i = j

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-token: its bytes as printable symbols, merged lowest rank first."""
        byte_chars = self._byte_chars
        vocab = self.vocab
        # SmolLM2's vocabulary lacks 21 byte symbols (e.g. 0x04, 0xC0, 0xF5..0xFF). With no unk
        # token, HF BPE drops such a symbol before merging, so its neighbours may merge; do the same.
        symbols = [s for s in (byte_chars[b] for b in word.encode("utf-8")) if s in vocab]
        ranks = self.ranks
        while len(symbols) > 1:
            best = None
            best_rank = None
            for k in range(len(symbols) - 1):
                r = ranks.get((symbols[k], symbols[k + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank = r
                    best = (symbols[k], symbols[k + 1])
            if best is None:
                break
            left, right = best
            merged = left + right
            out = []
            k = 0
            n = len(symbols)
            while k < n:
                if k < n - 1 and symbols[k] == left and symbols[k + 1] == right:
                    out.append(merged)
                    k += 2
                else:
                    out.append(symbols[k])
                    k += 1
            symbols = out
        return tuple(vocab[s] for s in symbols)

    # ------------------------------------------------------------------ decoding

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of `ids` (maybe ending inside a UTF-8 character, e.g. mid-stream)."""
        out = bytearray()
        byte_decoder = self.byte_decoder
        specials = self.special_ids
        table = self.id_to_token_list
        for i in ids:
            special = specials.get(i)
            if special is not None:
                if not skip_special_tokens or i in self.text_special_ids:
                    out += special.encode("utf-8")
                continue
            tok = table[i] if 0 <= i < len(table) else None
            if tok is None:
                if self.show_unknown_ids:
                    out += f"<id {i}>".encode()
                    continue
                raise ValueError(f"token id {i} is out of the vocabulary")
            for ch in tok:
                out.append(byte_decoder[ch])
        return bytes(out)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut by a token boundary) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental decode for a streaming UI: `push(id)` returns only the text that is complete.

    A multi-byte character split over two tokens is held back until its last byte arrives, so
    printing each returned chunk never shows a spurious U+FFFD.
    """

    def __init__(self, tokenizer: BPETokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.decode_bytes([token_id], self.skip_special_tokens))

    def flush(self) -> str:
        """Whatever is still pending (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
