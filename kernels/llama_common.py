"""What the Llama kernels share (kernels.decode_matmul, kernels.layer_ops, kernels.sampling).

Weights use the artifact's packing (convert/weights.py): a Q4 matrix W[out, in] is `q4` u32
[out, in/8] (element 8w+k in bits 4k..4k+3 of word w), `scale` and `min` f32 [out, in/32]
(value = q * scale + min); the Q8 embedding is `q8` u32 [vocab, dim/4] (signed bytes) and
`scale` f32 [vocab, dim/32]. Activations are `dtype` (f16 where the adapter has shader-f16, f32
otherwise); every sum accumulates in f32.

Each builder takes what the kernel is compiled for (the matmul: its contract.kernels.MatmulSpec) and
returns one PrimFunc. Sizes that only set a grid or a loop's trip count are runtime values, so shapes
share kernels: `n` (tokens), a matmul's `out_features`, the vocabulary, the FFN width, the head
counts, and the scalars `eps` and RoPE's (contract.kernels.rope_values).
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

THREADS = 256
BLOCK = 32  # quantization block: one scale (and min) per 32 weights


@T.macro
def workgroup_sum(partial, base, t):
    """partial[base] = the sum of partial[base:base + THREADS], one value a thread (t its index): a
    tree over the workgroup's THREADS invocations in workgroup memory (TVM places the barriers)."""
    for level in T.unroll(THREADS.bit_length() - 1):
        half: T.let[T.int32] = T.shift_right(THREADS // 2, level)
        if t < half:
            partial[base + t] = partial[base + t] + partial[base + t + half]


# GELU's tanh form as a sigmoid: 0.5 * (1 + tanh(u)) = 1 / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3),
# which needs no tanh (WGSL's overflows to NaN for large arguments on some drivers).
GELU_TANH_2U = 2 * math.sqrt(2 / math.pi)
GELU_TANH_CUBIC = 0.044715


def gated(gate, up, activation: str, lanes: int | None = None):
    """act(gate) * up in f32 (scalars, or f32x`lanes` vectors): SiLU (SwiGLU) or GELU-tanh (GeGLU),
    both as gate / (1 + exp(-k)) with k = gate (SiLU) or 2u (GELU-tanh)."""
    def const(v):
        return T.Broadcast(T.float32(v), lanes) if lanes else T.float32(v)
    if activation == "silu":
        k = gate
    elif activation == "gelu_tanh":
        k = gate * const(GELU_TANH_2U) * (const(1) + const(GELU_TANH_CUBIC) * gate * gate)
    else:
        raise ValueError(f"no gated activation {activation!r}")
    return gate / (const(1) + T.exp(-k)) * up


def gated_wgsl(gate: str, up: str, activation: str) -> str:
    """`gated` as a WGSL f32 expression of the variables `gate` and `up`."""
    if activation == "silu":
        return f"{gate} / (1.0f + exp(-{gate})) * {up}"
    k = f"{gate} * {GELU_TANH_2U!r}f * (1.0f + {GELU_TANH_CUBIC!r}f * {gate} * {gate})"
    return f"{gate} / (1.0f + exp(-({k}))) * {up}"


def sign_extend_byte(word, k):
    """Byte k of a u32 as a signed int32 (shift it to the top, then arithmetic-shift down)."""
    return T.shift_right(T.shift_left(T.reinterpret("int32", word), 24 - 8 * k), 24)
