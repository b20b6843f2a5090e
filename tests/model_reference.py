"""A plain numpy llama forward pass: the ground truth the WebGPU model is compared against.

Deliberately simple and explicit (no batching tricks, no paging): dense float32 weights, with
norms, RoPE and softmax done in float64 so the reference itself adds as little error as possible.
It keeps its own KV cache so a prefill followed by single-token steps can be compared with the
runtime's prefill/decode split position by position.

RoPE is the adjacent-pair form (rotate (x[2i], x[2i+1]) by theta^(-2i/head_dim)) because the
GGUF's attn_q/attn_k rows are permuted for llama.cpp; the half-rotation (HF) form on these
weights gives degraded text.
"""

from __future__ import annotations

import numpy as np

from contract.model import LlamaConfig, rope_frequency_divisors


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x * w / sqrt(mean(x^2) + eps) over the last axis."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w


def rope_adjacent(x: np.ndarray, positions: np.ndarray, theta: float, divisors=None) -> np.ndarray:
    """Adjacent-pair RoPE on x [seq, heads, head_dim] at absolute `positions` [seq]; `divisors`
    (contract.model.rope_frequency_divisors, llama.cpp's rope_freqs) divide each pair's frequency."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    if divisors is not None:
        inv_freq = inv_freq / np.asarray(divisors, dtype=np.float64)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]                # [seq, head_dim/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceLlama:
    """Llama decoder over the dense weight dict of `convert.weights.load_*_weights`."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        self.cfg = config
        self.w = weights
        self.reset()

    def reset(self) -> None:
        """Forget the KV cache (start a new sequence)."""
        self.k_cache: list[np.ndarray | None] = [None] * self.cfg["n_layers"]
        self.v_cache: list[np.ndarray | None] = [None] * self.cfg["n_layers"]

    @property
    def length(self) -> int:
        """Tokens currently in the KV cache."""
        k = self.k_cache[0]
        return 0 if k is None else k.shape[0]

    def _attention(self, i: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c = self.cfg
        nh, nkv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        seq = x.shape[0]
        qkv = (x.astype(np.float32) @ self.w[f"layers.{i}.qkv"].T).astype(np.float64)
        q = qkv[:, :nh * hd].reshape(seq, nh, hd)
        k = qkv[:, nh * hd:(nh + nkv) * hd].reshape(seq, nkv, hd)
        v = qkv[:, (nh + nkv) * hd:].reshape(seq, nkv, hd)
        divisors = rope_frequency_divisors(LlamaConfig.from_dict(c))
        q = rope_adjacent(q, positions, c["rope_theta"], divisors)
        k = rope_adjacent(k, positions, c["rope_theta"], divisors)
        self.k_cache[i] = k if self.k_cache[i] is None else np.concatenate([self.k_cache[i], k])
        self.v_cache[i] = v if self.v_cache[i] is None else np.concatenate([self.v_cache[i], v])
        keys, vals = self.k_cache[i], self.v_cache[i]            # [total, nkv, hd]
        key_pos = np.arange(keys.shape[0])
        causal = key_pos[None, :] <= positions[:, None]           # [seq, total]
        group = nh // nkv
        out = np.empty((seq, nh, hd), dtype=np.float64)
        for h in range(nh):
            kv = h // group                                       # GQA: query head h reads kv head h // group
            scores = (q[:, h, :] @ keys[:, kv, :].T) / np.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            scores -= scores.max(axis=1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=1, keepdims=True)
            out[:, h, :] = p @ vals[:, kv, :]
        return (out.reshape(seq, nh * hd).astype(np.float32) @ self.w[f"layers.{i}.o"].T).astype(np.float64)

    def _ffn(self, i: int, x: np.ndarray) -> np.ndarray:
        f = self.cfg["ffn_dim"]
        gu = (x.astype(np.float32) @ self.w[f"layers.{i}.gate_up"].T).astype(np.float64)
        h = silu(gu[:, :f]) * gu[:, f:]
        return (h.astype(np.float32) @ self.w[f"layers.{i}.down"].T).astype(np.float64)

    def forward(self, token_ids: list[int], start_pos: int = 0) -> np.ndarray:
        """Logits [len(token_ids), vocab] (float64) for tokens at positions start_pos... .

        `start_pos` must equal the cached length: this call appends to the KV cache.
        """
        if start_pos != self.length:
            raise ValueError(f"start_pos {start_pos} but the KV cache holds {self.length} tokens")
        c = self.cfg
        eps = c["rms_eps"]
        positions = np.arange(start_pos, start_pos + len(token_ids))
        x = self.w["embed"][np.asarray(token_ids)].astype(np.float64)
        for i in range(c["n_layers"]):
            x = x + self._attention(i, rms_norm(x, self.w[f"layers.{i}.attn_norm"], eps), positions)
            x = x + self._ffn(i, rms_norm(x, self.w[f"layers.{i}.ffn_norm"], eps))
        x = rms_norm(x, self.w["final_norm"], eps)
        head = self.w.get("head", self.w["embed"])  # the tied embedding unless the model has its own
        return (x.astype(np.float32) @ head.T).astype(np.float64)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, stop_ids=()) -> list[int]:
        """Greedy continuation of `prompt_ids` from an empty cache; stops after a stop id (included)."""
        self.reset()
        logits = self.forward(list(prompt_ids), 0)
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            if tok in stop_ids:
                break
            logits = self.forward([tok], self.length)
        return out


def hf_tokenizer_from_gguf(path):
    """A `tokenizers.Tokenizer` rebuilt from GGUF metadata (byte-level BPE, SmolLM pre-tokenizer).

    Test-only: used to make prompt ids independently of the project's own tokenizer module.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    fields = GGUFReader(str(path)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    return tok
