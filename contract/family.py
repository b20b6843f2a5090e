"""Model families as data: how an architecture's layer differs from Llama's.

A `Family` is the one description that the GGUF reader (which tensors a file holds), the kernel specs
(contract.kernels: which folds and variants a layer's kernels are compiled with), the forward pass
(model_glue.model.forward) and the tests' float64 reference read. Adding a family is a row of
`FAMILIES`, plus a kernel feature only where the row names one no kernel has yet.

The layer, for every family (a flag off leaves its step out):

    h = norm(x, attn_norm)
    q, k, v = h @ Wq^T (+ bq), h @ Wk^T (+ bk), h @ Wv^T (+ bv)      qkv_bias
    q, k = norm(q, q_norm), norm(k, k_norm)   (per head)            qk_norm
    q, k = rope(q), rope(k)                   (rope_pairs, the layer's base)
    a = attention(q, K, V)                    (the layer's window: global or sliding)
    a = a @ Wo^T;  a = norm(a, post_attn_norm)                       post_norms
    x = x + a
    h = norm(x, ffn_norm)
    f = act(h @ Wg^T) * (h @ Wu^T) @ Wd^T;  f = norm(f, post_ffn_norm)   ffn_activation, post_norms
    x = x + f

with x0 = embedding(ids) (* sqrt(dim): embed_scale_sqrt_dim) and logits = norm(x, final_norm) @ head^T.
Norm weights are used as the GGUF stores them (llama.cpp's converter already adds Gemma's 1 to its
norm weights).
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated FFN's: SwiGLU, GeGLU with GELU's tanh approximation
ROPE_PAIRS = ("adjacent", "halves")  # (x[2i], x[2i+1]) as llama.cpp's permuted llama Q/K; (x[i], x[i + D/2]) (NEOX)


@dataclass(frozen=True)
class Family:
    """One architecture (GGUF `general.architecture`) as the runtime runs it."""

    name: str
    ffn_activation: str = "silu"
    rope_pairs: str = "adjacent"
    qk_norm: bool = False  # RMSNorm over each q and k head (weights of head_dim) before RoPE
    post_norms: bool = False  # RMSNorm of the attention's and the FFN's outputs before each residual add
    qkv_bias: bool = False  # biases on q, k and v
    embed_scale_sqrt_dim: bool = False  # the embedding's rows times sqrt(dim)
    # Every `global_every`-th layer (the last of each run) attends to the whole context, the others to
    # the last `sliding_window` tokens (the config's, from the file) with RoPE base `local_rope_theta`.
    global_every: int | None = None
    local_rope_theta: float | None = None
    # Whether activations may be f16: Gemma 3's residual stream passes f16's 65,504 (docs/benchmarks.md),
    # so the family runs the f32 kernels.
    f16_activations: bool = True

    def __post_init__(self):
        if self.ffn_activation not in ACTIVATIONS or self.rope_pairs not in ROPE_PAIRS:
            raise ValueError(f"family {self.name}: activation one of {ACTIVATIONS}, rope_pairs one of {ROPE_PAIRS}")

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """The runtime names of a layer's norm weights (`layers.{i}.<name>`)."""
        return (("attn_norm", "ffn_norm") + ("q_norm", "k_norm") * self.qk_norm
                + ("post_attn_norm", "post_ffn_norm") * self.post_norms)

    @property
    def fused_rope_append(self) -> bool:
        """Whether a decode step's qkv matmul can rotate and append in its epilogue: each of its columns is
        final there (no per-head norm over other workgroups' columns, no bias) and pairs adjacent."""
        return self.rope_pairs == "adjacent" and not self.qk_norm and not self.qkv_bias

    @property
    def residual_in_matmul(self) -> bool:
        """Whether the o and down matmuls add the residual in their epilogue (no post-norm between)."""
        return not self.post_norms


FAMILIES = {f.name: f for f in (
    Family("llama"),
    Family("qwen2", rope_pairs="halves", qkv_bias=True),
    Family("qwen3", rope_pairs="halves", qk_norm=True),
    Family("gemma3", ffn_activation="gelu_tanh", rope_pairs="halves", qk_norm=True, post_norms=True,
           embed_scale_sqrt_dim=True, global_every=6, local_rope_theta=10000.0, f16_activations=False),
)}

# The GGUF tensor of each runtime norm (llama.cpp's names, the same in every family).
GGUF_LAYER_NORMS = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "q_norm": "attn_q_norm",
                    "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm"}
# What a family that is not here lacks, for the refusal (architectures people open most).
KNOWN_UNSUPPORTED = {
    "phi3": "fused QKV and gate/up tensors (attn_qkv, ffn_up holding both)",
    "gemma2": "attention and final logit soft-capping",
    "gemma": "Gemma 1's GELU FFN without post-norms is not described yet",
    "mistral3": "its vision tower",
    "smollm3": "RoPE-free layers",
}


def family(name: str) -> Family:
    """The family of an architecture; ValueError names what runs and, where known, what it lacks."""
    if name in FAMILIES:
        return FAMILIES[name]
    lacks = f" (it needs {KNOWN_UNSUPPORTED[name]})" if name in KNOWN_UNSUPPORTED else ""
    raise ValueError(f"this GGUF's architecture is {name!r}{lacks}; the runtime runs {', '.join(FAMILIES)} models")
