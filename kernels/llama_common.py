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

from tvm.script import tirx as T

THREADS = 256
BLOCK = 32  # quantization block: one scale (and min) per 32 weights


def sign_extend_byte(word, k):
    """Byte k of a u32 as a signed int32 (shift it to the top, then arithmetic-shift down)."""
    return T.shift_right(T.shift_left(T.reinterpret("int32", word), 24 - 8 * k), 24)
