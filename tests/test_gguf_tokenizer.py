"""A GGUF's tokenizer from its metadata (model_glue.formats.gguf_tokenizer) against HF `tokenizers` built from
the same vocabulary (an independent implementation), for both kinds and each split pattern; and the
chat templates' families."""

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from app.bench.gguf_files import byte_level_vocab, sentencepiece_vocab
from model_glue.formats.chat_template import chat_template
from model_glue.errors import ModelError
from model_glue.formats.gguf_tokenizer import CONTROL, NORMAL, USER_DEFINED, tokenizer_from_gguf

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen 2's tokenizer.json: one digit a word
TEXTS = ["Hello world!", "a  1 x   22\n 333", "  leading spaces and trailing   ", "It's 12345 o'clock, DON'T", "tabs\tand\nnew\n\n lines\r\n x",
         "ünïcödé — ça va? 日本語テキスト 123456789", "a  b   c\n\n\nd", "'S 'Ll 're'", "x\u00a0y", "emoji 🎉🎉 done.",
         "<|im_start|>user\nhi<|im_end|>", "!!!??? ...\n\n\t\t", "1,000,000.50$"]


def gpt2_metadata(pre):
    tokens, merges = byte_level_vocab(700)
    tokens += ["<|im_start|>", "<|im_end|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [NORMAL] * (len(tokens) - 2) + [CONTROL] * 2, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": len(tokens) - 1}, tokens, merges


def hf_bpe(tokens, merges, pre_tokenizer):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "gpt-2"])
def test_byte_level_bpe_matches_hf(pre):
    metadata, tokens, merges = gpt2_metadata(pre)
    ours = tokenizer_from_gguf(metadata)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in ("llama-bpe", "qwen2"))
    steps = {"llama-bpe": [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"), byte_level],
             "qwen2": [pre_tokenizers.Split(Regex(QWEN2_PATTERN), "isolated"), byte_level],
             "smollm": [pre_tokenizers.Digits(individual_digits=True), byte_level], "gpt-2": [byte_level]}[pre]
    reference = hf_bpe(tokens, merges, pre_tokenizers.Sequence(steps))
    rng = np.random.default_rng(0)
    alphabet = list(" \t\n\r'sSdDlLmMrReEvVtT0123456789aé日!?.,-") + ["\u00a0", "🎉"]
    fuzz = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 40)))) for _ in range(300)]
    for text in TEXTS + fuzz:
        assert ours.encode(text) == reference.encode(text).ids, (pre, text)
        assert ours.decode(ours.encode(text)) == text


def sentencepiece_reference(tokens, scores, types):
    """HF's SentencePiece-BPE equivalent: merges ranked by the merged piece's score, byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((a, b) for a in tokens for b in tokens if a + b in vocab and types[vocab[a + b]] == NORMAL
                     and types[vocab[a]] == NORMAL and types[vocab[b]] == NORMAL),
                    key=lambda ab: -scores[vocab[ab[0] + ab[1]]])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    return tok


def test_sentencepiece_matches_hf():
    tokens, scores, types = sentencepiece_vocab(400, np.random.default_rng(0))
    tokens = tokens[:293]  # no filler pieces: HF would merge them from pairs
    scores, types = scores[:293], types[:293]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    ours = tokenizer_from_gguf(metadata)
    reference = sentencepiece_reference(tokens, scores, types)
    rng = np.random.default_rng(1)
    alphabet = list(" helowrdtains!,") + ["é", "日", "🎉"]
    fuzz = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 30)))) for _ in range(300)]
    for text in ["hello world", "the world is hello!", " two  spaces", "héllo 日本 🎉"] + fuzz:
        assert ours.encode(text) == reference.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == " " + text  # the prefix space is the model's
    assert ours.add_bos and ours.encode("</s>hello")[0] == 2
    assert ours.encode("hello</s>")[-1] == 2


def test_user_defined_tokens_stay_text_when_specials_are_skipped():
    """A user-defined piece (Gemma's "\n", space runs, HTML tags, its "</s>") is cut out of the text like a
    control token, but decode(skip_special_tokens=True), the chat's stream, keeps it as llama.cpp does;
    and a user-defined "</s>" does not end a turn."""
    metadata, tokens, _ = gpt2_metadata("smollm")
    metadata = {**metadata, "tokenizer.ggml.tokens": tokens + ["<b>"],
                "tokenizer.ggml.token_type": metadata["tokenizer.ggml.token_type"] + [USER_DEFINED]}
    tokens, scores, types = sentencepiece_vocab(300, np.random.default_rng(0))
    spm = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens + ["<b>", "<i>", "<eot>"],
           "tokenizer.ggml.scores": scores + [0.0] * 3, "tokenizer.ggml.token_type": types + [USER_DEFINED] * 2 + [CONTROL],
           "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_space_prefix": False}
    for ours in (tokenizer_from_gguf(metadata), tokenizer_from_gguf(spm)):
        ids = ours.encode("hello<b>world")
        assert ours.token_to_id("<b>") in ids
        assert ours.decode(ids, skip_special_tokens=True) == ours.decode(ids) == "hello<b>world"
    ours = tokenizer_from_gguf(spm)
    assert ours.decode(ours.encode("<s>hi<eot>"), skip_special_tokens=True) == "hi"
    # Gemma's: EOS <eos>, a user-defined "</s>" (HTML), <end_of_turn>
    gemma_like = {**spm, "tokenizer.ggml.tokens": tokens[:2] + ["<eos>"] + tokens[3:] + ["<b>", "</s>", "<end_of_turn>"]}
    assert tokenizer_from_gguf(gemma_like).turn_end_ids == {2, len(tokens) + 2}


def test_unsupported_tokenizers_are_named():
    metadata, _, _ = gpt2_metadata("deepseek-llm")
    with pytest.raises(ModelError, match="pre-tokenizer is 'deepseek-llm'"):
        tokenizer_from_gguf(metadata)
    with pytest.raises(ModelError, match="tokenizer is 'bert'"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.model": "bert"})


@pytest.mark.parametrize("template,family,rendered", [
    ("{% for m in messages %}<|im_start|>{{m.role}}\n{{m.content}}<|im_end|>\n{% endfor %}", "chatml",
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}"
     "<|eot_id|>{% endfor %}", "llama3",
     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("{% if messages[0].role == 'system' %}<<SYS>>{% endif %}[INST] {{ m.content }} [/INST]", "llama2",
     "<s>[INST] Hi [/INST]"),
    ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>{% endfor %}<|user|><|assistant|>", "zephyr",
     "<|user|>\nHi</s>\n<|assistant|>\n"),
    ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n"
     "{% endfor %}<start_of_turn>model\n", "gemma", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    ("{{ messages }}", "raw", "Hi\n"),
    (None, "text", "Hi"),
])
def test_chat_templates(template, family, rendered):
    t = chat_template(template)
    assert t.family == family and t.render([{"role": "user", "content": "Hi"}]) == rendered
    assert (t.note is not None) == (family in ("raw", "text"))
