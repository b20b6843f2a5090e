"""The decode matmul: one token's (or the head's) y = x @ W^T on 4- or 8-bit weights, with its folds.

Each variant is a kernel of its own, chosen below by a few of the spec's booleans:

  kernels.decode_matmul_qkv    rope_append      the qkv matmul; RoPE and the K/V append as its epilogue
  kernels.decode_matmul_head   argmax_partials  the head; each workgroup's best logit for the argmax
  kernels.decode_matmul_int8   int8_x           x as int8 codes (dot4I8Packed); may quantize y for down
  kernels.decode_matmul_float  (the rest)       x in dtype, or merged from a split attention call

and each may fold the RMSNorm before it (norm_eps); the y-writing ones the SwiGLU after it and a
residual add. The folds are for GPUs, where a dispatch costs more than the work folded in; CPU
rasterizers run rms_norm, the plain matmul and swiglu apart (docs/benchmarks.md). What every variant
shares (the nest, loads, dequantization, the lanes' reduction): kernels.decode_matmul_common. Prefill
passes run kernels.prefill_matmul (scalar) or kernels.prefill_matmul_matrix (subgroup matrices).
"""

from __future__ import annotations

from contract.kernels import MatmulSpec
from kernels.decode_matmul_float import float_x_matmul
from kernels.decode_matmul_head import head_matmul
from kernels.decode_matmul_int8 import int8_x_matmul
from kernels.decode_matmul_qkv import qkv_rope_matmul


def quantized_matmul(spec: MatmulSpec):
    """The decode matmul kernel (a PrimFunc) of `spec`: the variant its folds name."""
    assert not spec.tiled
    if spec.rope_append is not None:
        return qkv_rope_matmul(spec)
    if spec.argmax_partials:
        return head_matmul(spec)
    if spec.int8_x:
        return int8_x_matmul(spec)
    return float_x_matmul(spec)
