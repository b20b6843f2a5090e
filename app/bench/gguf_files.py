"""GGUFs written with the `gguf` package: a llama model of a contract shape with random weights in
chosen tensor types, and its tokenizer in either kind (byte-level BPE, "gpt2"; SentencePiece, "llama"), for
the tests (tiny shapes) and `python -m app bench gguf --shape` (a whole model's size).

gguf quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 itself; it only dequantizes K-quants, so Q4_K, Q5_K and
Q6_K blocks are packed here (a plain min/max fit; any bytes would do, since the tests compare against
gguf's own dequantization of what was written).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from contract.family import GGUF_LAYER_NORMS
from contract.model import LlamaConfig, norm_width, rope_frequency_divisors


def _half_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _k_fit(w: np.ndarray, levels: int):
    """A K-quant's min/max fit of f32 [rows, cols]: (d, dmin, packed 6-bit scales/mins, codes [blocks, 8, 32])."""
    blocks = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(blocks.min(axis=2), 0)
    step = (blocks.max(axis=2) - lo) / levels
    d = np.maximum(step.max(axis=1), 1e-8) / 63
    dmin = np.maximum((-lo).max(axis=1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    codes = np.clip(np.round((blocks + (dmin[:, None] * m)[..., None]) / (d[:, None] * sc)[..., None]), 0,
                    levels).astype(np.uint8)
    scales = np.zeros((len(blocks), 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return d, dmin, scales, codes


def _low_nibbles(codes: np.ndarray) -> np.ndarray:
    """A K-quant's 128 bytes of low nibbles: sub-block pair c in bytes 32c.., the even one low."""
    low = codes & 0xF
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(codes), 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """f32 [rows, cols] -> block_q4_K bytes [rows, cols / 256 * 144]."""
    d, dmin, scales, codes = _k_fit(w, 15)
    out = np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, _low_nibbles(codes)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """f32 [rows, cols] -> block_q5_K bytes [rows, cols / 256 * 176]: as Q4_K with a fifth bit, bit `sub` of
    byte e of qh for weight e of sub-block sub."""
    d, dmin, scales, codes = _k_fit(w, 31)
    qh = ((codes >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    out = np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, qh, _low_nibbles(codes)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """f32 [rows, cols] -> block_q6_K bytes [rows, cols / 256 * 210]."""
    blocks = w.reshape(-1, 16, 16).astype(np.float32)
    group_scale = np.abs(blocks).max(axis=2) / 31
    d = np.maximum(np.abs(group_scale).max(axis=1), 1e-8) / 127
    d = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(group_scale / d[:, None]), 1, 127).astype(np.int8)
    q = (np.clip(np.round(blocks / (d[:, None] * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql = np.zeros((len(q), 128), np.uint8)
    qh = np.zeros((len(q), 64), np.uint8)
    for half in range(2):
        y = q[:, 128 * half:128 * (half + 1)]
        q1, q2, q3, q4 = y[:, 0:32], y[:, 32:64], y[:, 64:96], y[:, 96:128]
        ql[:, 64 * half:64 * half + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        ql[:, 64 * half + 32:64 * half + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        qh[:, 32 * half:32 * half + 32] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _half_bytes(d)], axis=1)
    return out.reshape(w.shape[0], -1)


def encode(w: np.ndarray, qtype: str) -> np.ndarray:
    """The bytes (or f32/f16 array) gguf's writer takes for `w` in `qtype`."""
    if qtype == "F32":
        return w.astype(np.float32)
    if qtype == "F16":
        return w.astype(np.float16)
    if qtype == "Q4_K":
        return quantize_q4_k(w)
    if qtype == "Q5_K":
        return quantize_q5_k(w)
    if qtype == "Q6_K":
        return quantize_q6_k(w)
    if qtype == "Q2_K_RAW":  # bytes of the right size, for a type the runtime refuses (84 bytes a block)
        return np.zeros((w.shape[0], w.shape[1] // 256 * 84), np.uint8)
    return quantize(w.astype(np.float32), GGMLQuantizationType[qtype])


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of `size` tokens: the 256 byte symbols, then merges of common pairs."""
    from model_glue.formats.tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens, merges = list(symbols), []
    letters = [bytes_to_unicode()[b] for b in b" etaoinshrdlucmfwypvbgk"]
    for a in letters:
        for b in letters:
            if len(tokens) >= size:
                return tokens, merges
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    while len(tokens) < size:  # unreachable pieces up to the model's vocabulary
        tokens.append(f"<filler{len(tokens)}>")
    return tokens, merges


def sentencepiece_vocab(size: int, rng) -> tuple[list[str], list[float], list[int]]:
    """A llama-style vocabulary: <unk> <s> </s>, the 256 byte tokens <0xXX>, then pieces with scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["\u2581", "e", "t", "a", "o", "n", "\u2581t", "he", "\u2581the", "\u2581a", "in", "er", "\u2581w",
              "or", "\u2581o", "at", "\u2581he", "\u2581wor", "ld", "\u2581world", "\u2581hello", "ll", "lo", "h", "l",
              "d", "r", "w", "i", "s", "\u2581s", "\u2581is", "!", ","]
    for k, piece in enumerate(pieces):
        if len(tokens) < size:
            tokens.append(piece)
            types.append(TokenType.NORMAL)
            scores.append(-float(k))
    while len(tokens) < size:
        tokens.append(f"\u2581filler{len(tokens)}")
        types.append(TokenType.NORMAL)
        scores.append(-1000.0 - len(tokens))
    return tokens, scores, [int(t) for t in types]


def write_llama_gguf(path, config: LlamaConfig, *, types: dict | None = None, tokenizer: str = "gpt2",
                     pre: str = "smollm", chat_template: str | None = None, seed: int = 0,
                     rope_freqs: bool = False, extra_tensor: tuple | None = None, dense: bool = True,
                     context_length: int = 4096) -> dict:
    """Write a GGUF of `config` (of its family, contract.family: the architecture's keys, norms and
    biases) with random weights; `types` picks each role's tensor type
    ("matrix", "embed", "head", "norm"; default Q4_0 / Q8_0 / Q8_0 / F32), a layer matrix's own where
    given ("down", or "down.1" for layer 1's: a llama.cpp mix such as Q4_K_M's). Returns gguf's dequantized
    dense weights under the runtime's names (embed, head, layers.i.qkv, ...), the f64 reference's input
    (with `dense` False nothing is dequantized or kept: a benchmark's large file). `context_length` is
    the file's own, which caps the context it opens with."""
    types = {"matrix": "Q4_0", "embed": "Q8_0", "head": "Q8_0", "norm": "F32", **(types or {})}
    keep_dense = dense
    rng = np.random.default_rng(seed)
    c = config
    writer = GGUFWriter(str(path), config.family)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(c.dim)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_vocab_size(c.vocab_size)
    if tokenizer == "gpt2":
        tokens, merges = byte_level_vocab(c.vocab_size - 3)
        tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([int(TokenType.NORMAL)] * (len(tokens) - 3) + [int(TokenType.CONTROL)] * 3)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(len(tokens) - 3)
        writer.add_eos_token_id(len(tokens) - 1)
    else:
        tokens, scores, token_types = sentencepiece_vocab(c.vocab_size, rng)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    if chat_template:
        writer.add_chat_template(chat_template)

    dense = {}

    def tensor(gguf_name, runtime_name, values, qtype):
        data = encode(values, qtype)
        gtype = GGMLQuantizationType["Q2_K" if qtype == "Q2_K_RAW" else qtype]
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype in ("F32", "F16") else gtype)
        if qtype == "Q2_K_RAW":
            return values
        if not keep_dense:
            return np.zeros(0, np.float32)
        back = data if qtype in ("F32", "F16") else dequantize(data, gtype)
        return np.asarray(back, np.float32).reshape(values.shape)

    def matrix(rows, cols, scale):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    dense["embed"] = tensor("token_embd.weight", "embed", matrix(c.vocab_size, c.dim, 0.5), types["embed"])
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_frequency_divisors(c), np.float32))
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for layer in range(c.n_layers):
        b, p = f"blk.{layer}", f"layers.{layer}"
        for norm in c.arch.layer_norms:  # the family's (contract.family), by llama.cpp's names
            width = norm_width(c, norm)
            dense[f"{p}.{norm}"] = tensor(f"{b}.{GGUF_LAYER_NORMS[norm]}.weight", None,
                                          1 + 0.1 * matrix(1, width, 1)[0], types["norm"])
        if c.arch.qkv_bias:
            dense[f"{p}.qkv_bias"] = np.concatenate([
                tensor(f"{b}.attn_{n}.bias", None, 0.5 * matrix(1, r, 1)[0], "F32") for n, r in (("q", q), ("k", kv), ("v", kv))])
        def type_of(m):
            return types.get(f"{m}.{layer}", types.get(m, types["matrix"]))

        parts = [tensor(f"{b}.attn_{n}.weight", None, matrix(r, c.dim, c.dim ** -0.5), type_of("qkv"))
                 for n, r in (("q", q), ("k", kv), ("v", kv))]
        dense[f"{p}.qkv"] = np.concatenate(parts)
        dense[f"{p}.o"] = tensor(f"{b}.attn_output.weight", None, matrix(c.dim, q, q ** -0.5), type_of("o"))
        dense[f"{p}.gate_up"] = np.concatenate([
            tensor(f"{b}.ffn_{n}.weight", None, matrix(c.ffn_dim, c.dim, c.dim ** -0.5), type_of("gate_up"))
            for n in ("gate", "up")])
        dense[f"{p}.down"] = tensor(f"{b}.ffn_down.weight", None, matrix(c.dim, c.ffn_dim, c.ffn_dim ** -0.5),
                                    type_of("down"))
    dense["final_norm"] = tensor("output_norm.weight", None, 1 + 0.1 * matrix(1, c.dim, 1)[0], types["norm"])
    if not c.tied_embeddings:
        dense["head"] = tensor("output.weight", None, matrix(c.vocab_size, c.dim, c.dim ** -0.5), types["head"])
    if extra_tensor:
        writer.add_tensor(*extra_tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dense
