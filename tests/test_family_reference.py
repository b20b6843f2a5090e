"""The float64 reference (tests/model_reference.py) beyond Llama, and Gemma 3's tokenizer.

- On random tiny weights, every family of contract.family runs from its description alone: prefill
  equals token-by-token decode, NEOX RoPE is adjacent-pair RoPE on reordered dimensions, and a
  sliding-window layer never sees past its window.
- On the real Gemma 3 270M GGUF (build/model/gemma3/, skipped without it), the reference continues
  "The three primary colors are" greedily as llama.cpp does (" red, blue, and yellow."), and the
  runtime's SentencePiece tokenizer (model_glue.formats.gguf_tokenizer) gives HF `tokenizers`' ids,
  built from the same 262,144-piece vocabulary, on varied and fuzzed text.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers

from contract.family import FAMILIES
from contract.model import LlamaConfig, norm_width
from conftest import ROOT
from model_glue.formats.gguf_file import file_reader, read_header
from model_glue.formats.gguf_tokenizer import CONTROL, NORMAL, USER_DEFINED, tokenizer_from_gguf
from model_reference import ReferenceLlama, rope_adjacent, rope_halves

GEMMA3 = ROOT / "build" / "model" / "gemma3" / "gemma-3-270m-q4_k_m.gguf"
needs_gemma3 = pytest.mark.skipif(not GEMMA3.exists(), reason=f"the Gemma 3 270M GGUF is not at {GEMMA3}")


# -- the reference on random tiny weights -------------------------------------------------------------

def tiny_config(family: str, n_layers: int = 2, window: int | None = None) -> dict:
    return LlamaConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=97,
                       rope_theta=10000.0, rms_eps=1e-6, family=family,
                       sliding_window=window if FAMILIES[family].global_every else None).to_dict()


def tiny_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random dense weights with every tensor the config's family names."""
    c = LlamaConfig.from_dict(config)
    rng = np.random.default_rng(seed)
    mat = lambda rows, cols: (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    norm = lambda n: (0.5 + rng.random(n)).astype(np.float32)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    w = {"embed": rng.standard_normal((c.vocab_size, c.dim)).astype(np.float32), "final_norm": norm(c.dim)}
    for i in range(c.n_layers):
        p = f"layers.{i}"
        w.update({f"{p}.qkv": mat(q + 2 * kv, c.dim), f"{p}.o": mat(c.dim, q),
                  f"{p}.gate_up": mat(2 * c.ffn_dim, c.dim), f"{p}.down": mat(c.dim, c.ffn_dim)})
        w.update({f"{p}.{n}": norm(norm_width(c, n)) for n in c.arch.layer_norms})
        if c.arch.qkv_bias:
            w[f"{p}.qkv_bias"] = (0.1 * rng.standard_normal(c.qkv_dim)).astype(np.float32)
    return w


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_equals_stepwise_decode(family):
    """Every family's tensors are read and its cache and (sliding-window) mask agree between a prefill and
    one-token steps; gemma3 with 6 layers has 5 window-3 layers and a global one over 10 tokens."""
    config = tiny_config(family, n_layers=6, window=3)
    model = ReferenceLlama(config, tiny_weights(config))
    ids = [5, 17, 90, 2, 33, 61, 8, 8, 40, 96]
    full = model.forward(ids)
    model.reset()
    steps = np.concatenate([model.forward(ids[:4], 0)] + [model.forward([t], 4 + k) for k, t in enumerate(ids[4:])])
    assert np.isfinite(full).all()
    np.testing.assert_allclose(steps, full, rtol=1e-5, atol=1e-5)


def test_rope_halves_is_adjacent_rope_on_reordered_dims():
    """NEOX pairs (x[i], x[i + D/2]) rotate like adjacent pairs (x[2i], x[2i+1]) once interleaved."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16))
    positions = np.array([0, 1, 7, 100, 4095])
    interleave = np.stack([np.arange(8), np.arange(8) + 8], axis=1).reshape(-1)  # 0, 8, 1, 9, ...
    for theta, divisors in ((10000.0, None), (1e6, np.linspace(1.0, 8.0, 8))):
        adjacent = rope_adjacent(x[..., interleave], positions, theta, divisors)
        np.testing.assert_allclose(rope_halves(x, positions, theta, divisors)[..., interleave], adjacent, atol=1e-12)


def test_sliding_window_hides_older_tokens():
    """Two window-4 layers: the last of 8 positions sees tokens 1..7 (two hops of 3 back), never token 0;
    with the window off it does."""
    config = tiny_config("gemma3", n_layers=2, window=4)
    weights = tiny_weights(config, seed=1)
    ids = [3, 14, 15, 92, 65, 35, 89, 79]

    def last(cfg, tokens):
        return ReferenceLlama(cfg, weights).forward(tokens)[-1]

    base = last(config, ids)
    np.testing.assert_allclose(last(config, [50] + ids[1:]), base, rtol=0, atol=1e-9)
    assert np.abs(last(config, ids[:1] + [50] + ids[2:]) - base).max() > 1e-3
    assert np.abs(last({**config, "sliding_window": None}, [50] + ids[1:])
                  - last({**config, "sliding_window": None}, ids)).max() > 1e-3


# -- Gemma 3 270M -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_metadata() -> dict:
    """The GGUF's metadata through the runtime's own header reader (pure Python, as in Pyodide)."""
    return asyncio.run(read_header(*file_reader(GEMMA3))).metadata


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_metadata):
    start = time.perf_counter()
    tokenizer = tokenizer_from_gguf(gemma3_metadata)
    print(f"\nGemma 3's tokenizer ({len(gemma3_metadata['tokenizer.ggml.tokens']):,} pieces) built in "
          f"{time.perf_counter() - start:.2f} s")
    return tokenizer


PROMPT = "The three primary colors are"


def hf_sentencepiece(tokens: list[str], scores: list[float], types: list[int]) -> Tokenizer:
    """HF's equivalent of a SentencePiece BPE vocabulary without a space prefix (Gemma's): merges of two
    normal pieces into a normal piece, ranked by the merged piece's score (found by splitting each piece,
    not by pairing all pieces: 513,511 merges for Gemma's); spaces as U+2581; byte fallback; control and
    user-defined pieces matched in the raw text first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    merges = sorted((-scores[vocab[t]], vocab[t[:k]], vocab[t[k:]], t[:k], t[k:])
                    for t in normal for k in range(1, len(t)) if t[:k] in normal and t[k:] in normal)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], byte_fallback=True,
                               fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


GEMMA_TEXTS = [
    PROMPT, "Hello world!", "  leading, double  and trailing spaces   ", "a  b   c    d" + " " * 40 + "e",
    "tabs\tand\t\tnew\nlines\n\n\nand\r\nCRLF\n" + "\n" * 40, "It's 12345 o'clock, 3.14159 DON'T 1,000,000.50$",
    "ünïcödé — ça va? 日本語テキスト 한국어 العربية", "emoji 🎉🎉 👩\u200d💻 \U0001F937\u200d\u2642\ufe0f done.",
    "x\u00a0y\u200bz\u3000w", "Ǆ ﬁ Å ㍿ ① \U00010d40",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><mask><unused0><unused6241>", "<table><tr><td>1</td></tr></table> <b>bold</b> </s>",
    "<start_of_image>[multimodal]<end_of_image>", "<start_of_turn", "def f(x):\n    return x ** 2  # square\n",
]


@needs_gemma3
def test_gemma3_tokenizer_matches_hf(gemma3_metadata, gemma3_tokenizer):
    """Ids equal HF's on varied and fuzzed text, and decode back to it (no space prefix: add_space_prefix
    is False); special and user-defined pieces (newline, tab and space runs, HTML tags) are single ids."""
    md = gemma3_metadata
    assert md["tokenizer.ggml.add_space_prefix"] is False
    reference = hf_sentencepiece(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"])
    ours = gemma3_tokenizer
    words = ("the quick brown fox jumps over lazy dog colors primary red blue yellow naïve café 東京 "
             "don't 42 3.5 10,000 x=y+1; (a[b]) {c} <div> </div> <start_of_turn> <end_of_turn> <eos> <unused7> </s> "
             "🎉 \u00a0 — … \\ / ' \" ! ?").split(" ")
    seps = [" ", "  ", "\n", "\n\n", "\t", "", " \n ", "   "]
    rng = np.random.default_rng(0)
    fuzz = ["".join(str(rng.choice(words)) + str(rng.choice(seps)) for _ in range(int(rng.integers(1, 16))))
            for _ in range(400)]
    for text in GEMMA_TEXTS + fuzz:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text, text
    assert ours.encode("<start_of_turn>user\n") == [105, 2364, 107]  # "\n" is a user-defined piece
    assert ours.encode("a  b") == [236746, 138, 236763]  # so is a run of spaces, as spaces, not U+2581
    assert ours.encode("<b></s>") == [200, 212]  # HTML tags; "</s>" is one, not an end of turn
    assert ours.add_bos and ours.bos_id == 2 and ours.turn_end_ids == {1, 106}  # <eos>, <end_of_turn>
    # the chat streams with skip_special_tokens: control tokens go, user-defined pieces are text
    ids = ours.encode("<start_of_turn>model\nRed,  blue\n\n<b>and</b> yellow.<end_of_turn>\n")
    assert ours.decode(ids, skip_special_tokens=True) == "model\nRed,  blue\n\n<b>and</b> yellow.\n"
