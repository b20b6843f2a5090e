"""Host side: turn the tokenizer embedded in the model GGUF into a HF `tokenizer.json`.

The GGUF is the single source of truth for the model, so the tokenizer the browser loads is derived
from it rather than downloaded separately. Building it through the `tokenizers` library (instead of
writing the JSON by hand) gives the tests a reference implementation to compare the pure-Python
run-time tokenizer (`model_glue.formats.tokenizer`) against.

This module imports `gguf` and `tokenizers`; it is build-time only and never loaded in Pyodide.
"""

from __future__ import annotations

import json
from pathlib import Path

from convert.gguf_fields import gguf_field, open_gguf
from contract.artifacts import TOKENIZER_CONFIG_FILE

# llama.cpp's token types (gguf.TokenType): CONTROL and USER_DEFINED tokens are never split by BPE.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPECIAL_TOKEN_TYPES = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)



def read_gguf_tokenizer(gguf_path) -> dict:
    """The raw tokenizer metadata of a GGUF: tokens, types, merges, special ids, chat template."""
    reader = open_gguf(gguf_path)
    model = gguf_field(reader, "tokenizer.ggml.model")
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    if pre != "smollm":
        # Other pre-types use other split regexes; exporting them with SmolLM's would silently mis-tokenize.
        raise ValueError(f"tokenizer.ggml.pre is {pre!r}; only 'smollm' is supported")
    return {
        "tokens": gguf_field(reader, "tokenizer.ggml.tokens"),
        "token_types": gguf_field(reader, "tokenizer.ggml.token_type"),
        "merges": gguf_field(reader, "tokenizer.ggml.merges"),
        "bos_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "unk_id": gguf_field(reader, "tokenizer.ggml.unknown_token_id"),
        "pad_id": gguf_field(reader, "tokenizer.ggml.padding_token_id"),
        "add_bos_token": gguf_field(reader, "tokenizer.ggml.add_bos_token", False),
        "chat_template": gguf_field(reader, "tokenizer.chat_template"),
    }


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` equivalent to HF SmolLM2's tokenizer.json (= llama.cpp 'smollm')."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = meta["tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary has duplicate tokens")
    merges = []
    for line in meta["merges"]:
        left, sep, right = line.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ValueError(f"malformed merge {line!r}")
        merges.append((left, right))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    # SmolLM2: every digit is its own pre-token, then GPT-2's byte-level regex split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
                for t, ty in zip(tokens, meta["token_types"]) if ty in SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens(specials)
    return tok


def export_tokenizer(gguf_path, out_path) -> dict:
    """Write `tokenizer.json` (at out_path) and `tokenizer_config.json` (beside it) from the GGUF.

    Returns the config dict: special ids, the special token list and the chat template, which is
    all the run-time side needs besides tokenizer.json to build prompts and stop generation.
    """
    meta = read_gguf_tokenizer(gguf_path)
    tok = build_tokenizer(meta)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path), pretty=False)

    tokens = meta["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    config = {
        "bos_id": meta["bos_id"],
        "eos_id": meta["eos_id"],
        "unk_id": meta["unk_id"],
        "pad_id": meta["pad_id"],
        "im_start_id": vocab.get("<|im_start|>"),
        "im_end_id": vocab.get("<|im_end|>"),
        "add_bos_token": meta["add_bos_token"],
        "special_tokens": [t for t, ty in zip(tokens, meta["token_types"]) if ty in SPECIAL_TOKEN_TYPES],
        "vocab_size": len(tokens),
        "chat_template": meta["chat_template"],
    }
    (out_path.parent / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n",
                                                         encoding="utf-8")
    return config
