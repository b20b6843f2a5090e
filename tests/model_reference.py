"""A plain numpy decoder forward pass: the ground truth the WebGPU model is compared against.

Deliberately simple and explicit (no batching tricks, no paging): dense float32 weights, with
norms, RoPE and softmax done in float64 so the reference itself adds as little error as possible.
It keeps its own KV cache so a prefill followed by single-token steps can be compared with the
runtime's prefill/decode split position by position.

Every family of contract.family.FAMILIES runs from its description there and the config's helpers in
contract.model (layer_window, layer_rope_theta, embed_scale), never from the runtime's code: qkv bias,
per-head q/k RMSNorm, RoPE on adjacent pairs or on halves (NEOX) with each layer's base, a sliding
window in the family's local layers, post-norms, a SiLU or GELU-tanh gated FFN, the embedding scale.

Llama's RoPE is the adjacent-pair form (rotate (x[2i], x[2i+1]) by theta^(-2i/head_dim)) because the
GGUF's llama attn_q/attn_k rows are permuted for llama.cpp; the half-rotation (HF) form on these
weights gives degraded text. The other families' GGUFs keep HF's row order and rotate halves.
"""

from __future__ import annotations

import numpy as np

from contract.model import LlamaConfig, embed_scale, layer_rope_theta, layer_window, rope_frequency_divisors


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x * w / sqrt(mean(x^2) + eps) over the last axis."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w


def _rope_angles(positions: np.ndarray, head_dim: int, theta: float, divisors) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [seq, 1, head_dim/2] of each pair i's angle, position * theta^(-2i/head_dim) / divisor_i."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    if divisors is not None:
        inv_freq = inv_freq / np.asarray(divisors, dtype=np.float64)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]                # [seq, head_dim/2]
    return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]


def rope_adjacent(x: np.ndarray, positions: np.ndarray, theta: float, divisors=None) -> np.ndarray:
    """Adjacent-pair RoPE on x [seq, heads, head_dim] at absolute `positions` [seq]; `divisors`
    (contract.model.rope_frequency_divisors, llama.cpp's rope_freqs) divide each pair's frequency."""
    cos, sin = _rope_angles(positions, x.shape[-1], theta, divisors)
    x0, x1 = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rope_halves(x: np.ndarray, positions: np.ndarray, theta: float, divisors=None) -> np.ndarray:
    """NEOX (rotate-half) RoPE: pair i is (x[i], x[i + head_dim/2]), at the same frequencies as `rope_adjacent`."""
    half = x.shape[-1] // 2
    cos, sin = _rope_angles(positions, x.shape[-1], theta, divisors)
    x0, x1 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:] = x0 * sin + x1 * cos
    return out


ROPE = {"adjacent": rope_adjacent, "halves": rope_halves}


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (Gemma's gelu_pytorch_tanh, llama.cpp's ggml_gelu)."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


class ReferenceLlama:
    """The decoder of any family (contract.family) over the dense weight dict of
    `convert.weights.load_*_weights` or `gguf_reference.load_gguf_weights`: per layer the matrices
    `layers.{i}.qkv|o|gate_up|down`, the norms the family names (`Family.layer_norms`) and, with
    qkv_bias, `layers.{i}.qkv_bias` (q|k|v)."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        self.cfg = config
        self.w = weights
        self.config = LlamaConfig.from_dict(config)
        self.family = self.config.arch
        self.rope = ROPE[self.family.rope_pairs]
        self.activation = ACTIVATIONS[self.family.ffn_activation]
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
        c, fam, w = self.cfg, self.family, self.w
        nh, nkv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        seq = x.shape[0]
        qkv = (x.astype(np.float32) @ w[f"layers.{i}.qkv"].T).astype(np.float64)
        if fam.qkv_bias:
            qkv = qkv + w[f"layers.{i}.qkv_bias"]
        q = qkv[:, :nh * hd].reshape(seq, nh, hd)
        k = qkv[:, nh * hd:(nh + nkv) * hd].reshape(seq, nkv, hd)
        v = qkv[:, (nh + nkv) * hd:].reshape(seq, nkv, hd)
        if fam.qk_norm:  # RMSNorm over each head's head_dim values
            q = rms_norm(q, w[f"layers.{i}.q_norm"], c["rms_eps"])
            k = rms_norm(k, w[f"layers.{i}.k_norm"], c["rms_eps"])
        window = layer_window(self.config, i)
        # Llama 3's RoPE scaling is the global RoPE's: a family's local layers rotate at their own plain base
        divisors = rope_frequency_divisors(self.config) if window is None else None
        theta = layer_rope_theta(self.config, i)
        q = self.rope(q, positions, theta, divisors)
        k = self.rope(k, positions, theta, divisors)
        self.k_cache[i] = k if self.k_cache[i] is None else np.concatenate([self.k_cache[i], k])
        self.v_cache[i] = v if self.v_cache[i] is None else np.concatenate([self.v_cache[i], v])
        keys, vals = self.k_cache[i], self.v_cache[i]            # [total, nkv, hd]
        key_pos = np.arange(keys.shape[0])
        causal = key_pos[None, :] <= positions[:, None]           # [seq, total]
        if window is not None:                                    # keys p-W+1..p only
            causal &= key_pos[None, :] > positions[:, None] - window
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
        out = (out.reshape(seq, nh * hd).astype(np.float32) @ w[f"layers.{i}.o"].T).astype(np.float64)
        return rms_norm(out, w[f"layers.{i}.post_attn_norm"], c["rms_eps"]) if fam.post_norms else out

    def _ffn(self, i: int, x: np.ndarray) -> np.ndarray:
        f = self.cfg["ffn_dim"]
        gu = (x.astype(np.float32) @ self.w[f"layers.{i}.gate_up"].T).astype(np.float64)
        h = self.activation(gu[:, :f]) * gu[:, f:]
        out = (h.astype(np.float32) @ self.w[f"layers.{i}.down"].T).astype(np.float64)
        return rms_norm(out, self.w[f"layers.{i}.post_ffn_norm"], self.cfg["rms_eps"]) if self.family.post_norms else out

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
        scale = embed_scale(self.config)
        if scale != 1.0:
            x = x * scale
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
