"""TIR kernels that turn a GGUF tensor's raw blocks into the runtime's weight formats on the GPU.

A tensor's bytes are uploaded as they are in the file (`raw`, read as u32 words: GGUF blocks of
18, 22 or 210 bytes do not keep words aligned, so every field is assembled from bytes). Each
invocation writes one 32-weight block of the output, `out_block + i` for block i of the tensor, so a
fused matrix (q, k and v rows in one `qkv`) is written part by part. contract.gguf says which
(source, target) pairs are exact; the others requantize:

* to Q4 (`q4` words, 8 codes a word, element 8w+k in bits 4k..; `scale`, `wmin` per block):
  min/max per block, code = round((v - min) / scale), scale = (max - min) / 15;
* to Q8 (`q8` words, 4 signed bytes a word; `scale` per block): scale = max|v| / 127;
* to Q8A (`q8a` words, 4 signed bytes a word in contract.model.q8a_code_position's order; `scale`,
  `wmin` per 16 weights): min/max per 16, code = round((v - min) / scale) - 128, scale = (max - min) / 255.

Every quantized type reaches Q8A exactly (`_exact_q8a`): its codes as signed bytes (a Q5 code q as q,
or q - 16 where the type is symmetric; Q6_K's as q - 32) and a 16-weight block's scale and min
multiplied out in f32 from the file's f16s and 6- or 8-bit sub-block scales.

Block layouts follow ggml-quants.c (block_q4_0 ... block_q6_K); each `_decode_*` below documents
the one it reads. The grid is fixed and strides over the blocks, like kernels.random_fill, so any
tensor fits one dispatch.
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.gguf import EXACT_REPACKS, GGML_TYPES
from contract.model import Q8A_BLOCK, q8a_weight_at

THREADS = 256
WORKGROUPS = 1024
STRIDE = THREADS * WORKGROUPS  # blocks one trip of the whole grid writes
BLOCK = 32
Q4_LEVELS = 15  # codes 0..15
Q8_LEVELS = 127  # codes -127..127
Q8A_LEVELS = 255  # codes -128..127
Q8A_OFFSET = 128  # a requantized Q8A code is its level minus this
HALVES = BLOCK // Q8A_BLOCK  # Q8A blocks a 32-weight block
CONSTANTS = 3  # per-block constants a decoder keeps in registers (d, min, a high-bit word)


# -- reading bytes out of u32 words -------------------------------------------------------------------
def _byte(raw, b):
    """Byte b of the tensor, as a u32 in 0..255."""
    return T.bitwise_and(T.shift_right(raw[T.shift_right(b, 2)], T.Cast("uint32", T.bitwise_and(b, 3) * 8)),
                         T.uint32(0xFF))


def _half_bits(raw, b):
    """The 16 bits at an even byte offset b (never across a word: even offsets stay in one)."""
    return T.bitwise_and(T.shift_right(raw[T.shift_right(b, 2)], T.Cast("uint32", T.bitwise_and(b, 2) * 8)),
                         T.uint32(0xFFFF))


def _half(raw, b):
    """The f16 at byte b, as f32 (WGSL has no u16: the bits are widened by hand)."""
    h = _half_bits(raw, b)
    sign = T.shift_left(T.shift_right(h, T.uint32(15)), T.uint32(31))
    exponent = T.bitwise_and(T.shift_right(h, T.uint32(10)), T.uint32(0x1F))
    mantissa = T.bitwise_and(h, T.uint32(0x3FF))
    normal = T.reinterpret("float32", T.bitwise_or(sign, T.bitwise_or(
        T.shift_left(exponent + T.uint32(127 - 15), T.uint32(23)), T.shift_left(mantissa, T.uint32(13)))))
    special = T.reinterpret("float32", T.bitwise_or(sign, T.bitwise_or(T.uint32(0x7F800000),
                                                                       T.shift_left(mantissa, T.uint32(13)))))
    subnormal = T.Cast("float32", mantissa) * T.float32(2.0 ** -24)
    subnormal = T.if_then_else(sign != T.uint32(0), -subnormal, subnormal)
    return T.if_then_else(exponent == T.uint32(0), subnormal,
                          T.if_then_else(exponent == T.uint32(31), special, normal))


def _int8(raw, b):
    """The signed byte at b, as int32."""
    return T.Cast("int32", _byte(raw, b)) - T.Cast("int32", T.shift_left(T.shift_right(_byte(raw, b), T.uint32(7)),
                                                                          T.uint32(8)))


def _low_or_high_nibble(raw, b, high):
    return T.if_then_else(high, T.shift_right(_byte(raw, b), T.uint32(4)), T.bitwise_and(_byte(raw, b), T.uint32(0xF)))


def _k_scale_min(raw, scales, j, want_min):
    """get_scale_min_k4: sub-block j's 6-bit scale (or min) from a K-quant's 12 packed bytes."""
    low = T.bitwise_and(_byte(raw, scales + j + 4 * want_min), T.uint32(63))
    packed = _byte(raw, scales + j + 4)
    high_low = T.if_then_else(want_min == 1, T.shift_right(packed, T.uint32(4)), T.bitwise_and(packed, T.uint32(0xF)))
    high = T.bitwise_or(high_low, T.shift_left(T.shift_right(_byte(raw, scales + j - 4 + 4 * want_min), T.uint32(6)),
                                               T.uint32(4)))
    return T.Cast("float32", T.if_then_else(j < 4, low, high))


# -- per type: a block's constants, then each weight's code or value ---------------------------------------
# A decoder is (constants(raw, base, sub) -> up to CONSTANTS f32 exprs, value(raw, base, sub, e, c) -> f32)
# with base the block's first byte, sub the 32-weight sub-block in it, e the weight in that sub-block and c
# the kept constants. Exact 4-bit sources also give code(raw, base, sub, e) -> u32 and their (scale, min).

def _decode_f32():
    return (lambda raw, base, sub: [],
            lambda raw, base, sub, e, c: T.reinterpret("float32", raw[T.shift_right(base, 2) + e]))


def _decode_f16():
    return lambda raw, base, sub: [], lambda raw, base, sub, e, c: _half(raw, base + 2 * e)


def _decode_bf16():
    return (lambda raw, base, sub: [],
            lambda raw, base, sub, e, c: T.reinterpret("float32", T.shift_left(_half_bits(raw, base + 2 * e), T.uint32(16))))


def _q4_0_code(raw, base, sub, e):  # block_q4_0: f16 d; 16 bytes, weight j low nibble of byte j, j+16 high
    return _low_or_high_nibble(raw, base + 2 + T.truncmod(e, 16), e >= 16)


def _q4_1_code(raw, base, sub, e):  # block_q4_1: f16 d, f16 m; nibbles as q4_0
    return _low_or_high_nibble(raw, base + 4 + T.truncmod(e, 16), e >= 16)


def _q4_k_code(raw, base, sub, e):
    """block_q4_K (256 weights): f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of codes: 64-weight
    chunk c = sub / 2 in bytes 32c..32c+31, its first 32 weights in the low nibbles, the next in the high."""
    return _low_or_high_nibble(raw, base + 16 + 32 * T.shift_right(sub, 1) + e, T.bitwise_and(sub, 1) == 1)


EXACT_Q4 = {  # source -> (code, [scale, min] of the sub-block)
    "Q4_0": (_q4_0_code, lambda raw, base, sub: [_half(raw, base), T.float32(-8.0) * _half(raw, base)]),
    "Q4_1": (_q4_1_code, lambda raw, base, sub: [_half(raw, base), _half(raw, base + 2)]),
    "Q4_K": (_q4_k_code, lambda raw, base, sub: [_half(raw, base) * _k_scale_min(raw, base + 4, sub, 0),
                                                 -(_half(raw, base + 2) * _k_scale_min(raw, base + 4, sub, 1))]),
}


def _from_exact(source):
    code, constants = EXACT_Q4[source]
    return constants, lambda raw, base, sub, e, c: T.Cast("float32", code(raw, base, sub, e)) * c[0] + c[1]


def _u32_at(raw, b):
    """A little-endian u32 at any byte offset."""
    return T.bitwise_or(T.bitwise_or(_byte(raw, b), T.shift_left(_byte(raw, b + 1), T.uint32(8))),
                        T.bitwise_or(T.shift_left(_byte(raw, b + 2), T.uint32(16)), T.shift_left(_byte(raw, b + 3), T.uint32(24))))


def _q5_high_bit(c, e):
    """Bit e of the block's qh word (kept in c[2] as its bit pattern)."""
    return T.bitwise_and(T.shift_right(T.reinterpret("uint32", c[2]), T.Cast("uint32", e)), T.uint32(1))


def _q5_0_code(raw, base, sub, e, c):
    """block_q5_0: f16 d, u32 qh (bit j: weight j's fifth bit, kept in c[2]), 16 bytes of low nibbles as
    q4_0; v = (q - 16) d. The code: q - 16."""
    return T.Cast("int32", T.bitwise_or(_low_or_high_nibble(raw, base + 6 + T.truncmod(e, 16), e >= 16),
                                        T.shift_left(_q5_high_bit(c, e), T.uint32(4)))) - 16


def _q5_1_code(raw, base, sub, e, c):
    """block_q5_1: f16 d, f16 m, u32 qh, 16 bytes of low nibbles; v = q d + m. The code: q."""
    return T.Cast("int32", T.bitwise_or(_low_or_high_nibble(raw, base + 8 + T.truncmod(e, 16), e >= 16),
                                        T.shift_left(_q5_high_bit(c, e), T.uint32(4))))


def _q8_0_code(raw, base, sub, e, c):
    """block_q8_0: f16 d, 32 signed bytes; v = q d."""
    return _int8(raw, base + 2 + e)


def _q5_k_code(raw, base, sub, e, c):
    """block_q5_K: f16 d, f16 dmin, 12 bytes of scales/mins as q4_K, 32 bytes qh (bit `sub` of byte e:
    the fifth bit of weight e of sub-block sub), 128 bytes of low nibbles as q4_K; v = d sc q - dmin m."""
    low = _low_or_high_nibble(raw, base + 48 + 32 * T.shift_right(sub, 1) + e, T.bitwise_and(sub, 1) == 1)
    high = T.bitwise_and(T.shift_right(_byte(raw, base + 16 + e), T.Cast("uint32", sub)), T.uint32(1))
    return T.Cast("int32", T.bitwise_or(low, T.shift_left(high, T.uint32(4))))


def _q6_k_code(raw, base, sub, e, c):
    """block_q6_K (256 weights): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per
    16 weights), f16 d. Sub-block sub = 4h + q (half h of 128 weights, quarter q): weight e reads the low
    (q < 2) or high nibble of ql[64h + e + 32 (q odd)], bits 2q..2q+1 of qh[32h + e]; v = d scale (q6 - 32)
    with the scale of `_q6_k_scale`. The code: q6 - 32."""
    half, quarter = T.shift_right(sub, 2), T.bitwise_and(sub, 3)
    low = _low_or_high_nibble(raw, base + 64 * half + e + 32 * T.bitwise_and(quarter, 1), quarter >= 2)
    high = T.bitwise_and(T.shift_right(_byte(raw, base + 128 + 32 * half + e), T.Cast("uint32", 2 * quarter)),
                         T.uint32(3))
    return T.Cast("int32", T.bitwise_or(low, T.shift_left(high, T.uint32(4)))) - 32


def _q6_k_scale(raw, base, sub, e16):
    """Q6_K's int8 scale of the 16 weights from e16 (0 or 16) of sub-block sub: scales[8h + e16/16 + 2q]."""
    return _int8(raw, base + 192 + 8 * T.shift_right(sub, 2) + T.shift_right(e16, 4) + 2 * T.bitwise_and(sub, 3))


def _k_constants(raw, base, sub):  # Q4_K and Q5_K: a sub-block's d * sc and -(dmin * m)
    return [_half(raw, base) * _k_scale_min(raw, base + 4, sub, 0),
            -(_half(raw, base + 2) * _k_scale_min(raw, base + 4, sub, 1))]


# source -> (constants(raw, base, sub) [scale, min, qh bits], code(raw, base, sub, e, c) -> int32): v = code
# scale + min for every type but Q6_K, whose scale is d times a scale per 16 weights (`_q6_k_scale`).
EXACT_CODES = {
    "Q4_0": (EXACT_Q4["Q4_0"][1], lambda raw, base, sub, e, c: T.Cast("int32", _q4_0_code(raw, base, sub, e))),
    "Q4_1": (EXACT_Q4["Q4_1"][1], lambda raw, base, sub, e, c: T.Cast("int32", _q4_1_code(raw, base, sub, e))),
    "Q4_K": (EXACT_Q4["Q4_K"][1], lambda raw, base, sub, e, c: T.Cast("int32", _q4_k_code(raw, base, sub, e))),
    "Q5_0": (lambda raw, base, sub: [_half(raw, base), T.float32(0), T.reinterpret("float32", _u32_at(raw, base + 2))],
             _q5_0_code),
    "Q5_1": (lambda raw, base, sub: [_half(raw, base), _half(raw, base + 2), T.reinterpret("float32", _u32_at(raw, base + 4))],
             _q5_1_code),
    "Q8_0": (lambda raw, base, sub: [_half(raw, base)], _q8_0_code),
    "Q5_K": (_k_constants, _q5_k_code),
    "Q6_K": (lambda raw, base, sub: [_half(raw, base + 208)], _q6_k_code),
}


def _from_codes(source):
    """A value decoder of a type in EXACT_CODES."""
    constants, code = EXACT_CODES[source]
    if source == "Q6_K":
        return constants, lambda raw, base, sub, e, c: c[0] * T.Cast("float32", _q6_k_scale(
            raw, base, sub, T.shift_left(T.shift_right(e, 4), 4)) * code(raw, base, sub, e, c))
    return constants, lambda raw, base, sub, e, c: T.Cast("float32", code(raw, base, sub, e, c)) * c[0] + \
        (c[1] if len(constants(raw, base, sub)) > 1 else T.float32(0))


DECODERS = {"F32": _decode_f32, "F16": _decode_f16, "BF16": _decode_bf16, "Q4_0": lambda: _from_exact("Q4_0"),
            "Q4_1": lambda: _from_exact("Q4_1"), "Q4_K": lambda: _from_exact("Q4_K"),
            **{t: (lambda t=t: _from_codes(t)) for t in ("Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K")}}


def _constant(constants, raw, base, sub, k):
    """A decoder's k-th block constant (0 where it keeps fewer)."""
    exprs = constants(raw, base, sub)
    return exprs[k] if k < len(exprs) else T.float32(0)


def gguf_repack(source: str, target: str):
    """The PrimFunc that repacks `blocks` 32-weight blocks of a GGUF tensor of type `source` into the
    runtime's `target` format ("q4", "q8" or "q8a"), writing output blocks out_block ... out_block + blocks - 1."""
    ggml = GGML_TYPES[source]
    SUB_BLOCKS, BLOCK_BYTES = ggml.sub_blocks, ggml.block_bytes
    if (source, target) in EXACT_REPACKS:
        exact = {"q4": lambda: _exact_q4(source, SUB_BLOCKS, BLOCK_BYTES), "q8": lambda: _exact_q8_0(BLOCK_BYTES),
                 "q8a": lambda: _exact_q8a(source, SUB_BLOCKS, BLOCK_BYTES)}
        return exact[target]()
    constants, value = DECODERS[source]()
    return {"q4": _requant_q4, "q8": _requant_q8, "q8a": _requant_q8a}[target](constants, value, SUB_BLOCKS, BLOCK_BYTES)


def _block_decoder(constants, value, SUB_BLOCKS, BLOCK_BYTES):
    """A TVMScript macro: c = block i's constants, v = its 32 weights (block i of the tensor starts at
    byte (i / SUB_BLOCKS) * BLOCK_BYTES, as sub-block i % SUB_BLOCKS)."""

    @T.macro
    def decode_block(raw, c, v, i):
        base: T.let[T.int32] = T.truncdiv(i, SUB_BLOCKS) * BLOCK_BYTES
        sub: T.let[T.int32] = T.truncmod(i, SUB_BLOCKS)
        c[0] = _constant(constants, raw, base, sub, 0)
        c[1] = _constant(constants, raw, base, sub, 1)
        c[2] = _constant(constants, raw, base, sub, 2)
        for e in T.serial(BLOCK):
            v[e] = value(raw, base, sub, e, c)

    return decode_block


def _requant_q4(constants, value, SUB_BLOCKS, BLOCK_BYTES):
    decode_block = _block_decoder(constants, value, SUB_BLOCKS, BLOCK_BYTES)

    @T.prim_func(s_tir=True)
    def repack(raw_h: T.handle, q4_h: T.handle, scale_h: T.handle, min_h: T.handle, blocks: T.int32, out_block: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n_raw, n_out = T.int32(), T.int32()
        raw = T.match_buffer(raw_h, (n_raw,), "uint32")
        q4 = T.match_buffer(q4_h, (n_out * 4,), "uint32")
        scale = T.match_buffer(scale_h, (n_out,), "float32")
        wmin = T.match_buffer(min_h, (n_out,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("repack_q4"):
                    T.reads()
                    T.writes()
                    c = T.sblock_alloc_buffer((CONSTANTS,), "float32", scope="local")
                    v = T.sblock_alloc_buffer((BLOCK,), "float32", scope="local")
                    lo_hi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    word = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(blocks, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < blocks:
                            decode_block(raw, c, v, i)
                            lo_hi[0] = v[0]
                            lo_hi[1] = v[0]
                            for e in T.serial(1, BLOCK):
                                lo_hi[0] = T.min(lo_hi[0], v[e])
                                lo_hi[1] = T.max(lo_hi[1], v[e])
                            step: T.let[T.float32] = (lo_hi[1] - lo_hi[0]) / T.float32(Q4_LEVELS)
                            inverse: T.let[T.float32] = T.if_then_else(step > T.float32(0), T.float32(1) / step, T.float32(0))
                            for w in T.serial(4):
                                word[0] = T.uint32(0)
                                for k in T.unroll(8):
                                    word[0] = T.bitwise_or(word[0], T.shift_left(T.Cast("uint32", T.min(T.max(
                                        T.round((v[8 * w + k] - lo_hi[0]) * inverse), T.float32(0)), T.float32(Q4_LEVELS))),
                                        T.uint32(4 * k)))
                                q4[(out_block + i) * 4 + w] = word[0]
                            scale[out_block + i] = step
                            wmin[out_block + i] = lo_hi[0]

    return repack


def _requant_q8(constants, value, SUB_BLOCKS, BLOCK_BYTES):
    decode_block = _block_decoder(constants, value, SUB_BLOCKS, BLOCK_BYTES)

    @T.prim_func(s_tir=True)
    def repack(raw_h: T.handle, q8_h: T.handle, scale_h: T.handle, blocks: T.int32, out_block: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n_raw, n_out = T.int32(), T.int32()
        raw = T.match_buffer(raw_h, (n_raw,), "uint32")
        q8 = T.match_buffer(q8_h, (n_out * 8,), "uint32")
        scale = T.match_buffer(scale_h, (n_out,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("repack_q8"):
                    T.reads()
                    T.writes()
                    c = T.sblock_alloc_buffer((CONSTANTS,), "float32", scope="local")
                    v = T.sblock_alloc_buffer((BLOCK,), "float32", scope="local")
                    amax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    word = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(blocks, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < blocks:
                            decode_block(raw, c, v, i)
                            amax[0] = T.float32(0)
                            for e in T.serial(BLOCK):
                                amax[0] = T.max(amax[0], T.fabs(v[e]))
                            step: T.let[T.float32] = amax[0] / T.float32(Q8_LEVELS)
                            inverse: T.let[T.float32] = T.if_then_else(step > T.float32(0), T.float32(1) / step, T.float32(0))
                            for w in T.serial(8):
                                word[0] = T.uint32(0)
                                for k in T.unroll(4):
                                    word[0] = T.bitwise_or(word[0], T.shift_left(T.bitwise_and(T.reinterpret("uint32", T.Cast(
                                        "int32", T.round(v[4 * w + k] * inverse))), T.uint32(0xFF)), T.uint32(8 * k)))
                                q8[(out_block + i) * 8 + w] = word[0]
                            scale[out_block + i] = step

    return repack


def _exact_q4(source, SUB_BLOCKS, BLOCK_BYTES):
    code, constants = EXACT_Q4[source]

    @T.prim_func(s_tir=True)
    def repack(raw_h: T.handle, q4_h: T.handle, scale_h: T.handle, min_h: T.handle, blocks: T.int32, out_block: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n_raw, n_out = T.int32(), T.int32()
        raw = T.match_buffer(raw_h, (n_raw,), "uint32")
        q4 = T.match_buffer(q4_h, (n_out * 4,), "uint32")
        scale = T.match_buffer(scale_h, (n_out,), "float32")
        wmin = T.match_buffer(min_h, (n_out,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("repack_exact_q4"):
                    T.reads()
                    T.writes()
                    word = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(blocks, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < blocks:
                            base: T.let[T.int32] = T.truncdiv(i, SUB_BLOCKS) * BLOCK_BYTES
                            sub: T.let[T.int32] = T.truncmod(i, SUB_BLOCKS)
                            for w in T.serial(4):
                                word[0] = T.uint32(0)
                                for k in T.unroll(8):
                                    word[0] = T.bitwise_or(word[0], T.shift_left(code(raw, base, sub, 8 * w + k), T.uint32(4 * k)))
                                q4[(out_block + i) * 4 + w] = word[0]
                            scale[out_block + i] = _constant(constants, raw, base, sub, 0)
                            wmin[out_block + i] = _constant(constants, raw, base, sub, 1)

    return repack


def _exact_q8_0(BLOCK_BYTES):
    @T.prim_func(s_tir=True)
    def repack(raw_h: T.handle, q8_h: T.handle, scale_h: T.handle, blocks: T.int32, out_block: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n_raw, n_out = T.int32(), T.int32()
        raw = T.match_buffer(raw_h, (n_raw,), "uint32")
        q8 = T.match_buffer(q8_h, (n_out * 8,), "uint32")
        scale = T.match_buffer(scale_h, (n_out,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("repack_exact_q8"):
                    T.reads()
                    T.writes()
                    for trip in T.serial(T.ceildiv(blocks, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < blocks:
                            base: T.let[T.int32] = i * BLOCK_BYTES
                            for w in T.serial(8):  # the 32 code bytes, as they are: our Q8 packing is ggml's order
                                q8[(out_block + i) * 8 + w] = _u32_at(raw, base + 2 + 4 * w)
                            scale[out_block + i] = _half(raw, base)

    return repack


def _byte_at(code, b):
    """An int32 code in -128..127 as byte b of a u32."""
    return T.shift_left(T.bitwise_and(T.reinterpret("uint32", code), T.uint32(0xFF)), T.Cast("uint32", 8 * b))


def _exact_q8a(source, SUB_BLOCKS, BLOCK_BYTES):
    constants, code = EXACT_CODES[source]

    @T.prim_func(s_tir=True)
    def repack(raw_h: T.handle, q8a_h: T.handle, scale_h: T.handle, min_h: T.handle, blocks: T.int32,
               out_block: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n_raw, n_q8a_blocks = T.int32(), T.int32()
        raw = T.match_buffer(raw_h, (n_raw,), "uint32")
        q8a = T.match_buffer(q8a_h, (n_q8a_blocks * 4,), "uint32")
        scale = T.match_buffer(scale_h, (n_q8a_blocks,), "float32")
        wmin = T.match_buffer(min_h, (n_q8a_blocks,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("repack_exact_q8a"):
                    T.reads()
                    T.writes()
                    c = T.sblock_alloc_buffer((CONSTANTS,), "float32", scope="local")
                    word = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(blocks, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < blocks:
                            base: T.let[T.int32] = T.truncdiv(i, SUB_BLOCKS) * BLOCK_BYTES
                            sub: T.let[T.int32] = T.truncmod(i, SUB_BLOCKS)
                            c[0] = _constant(constants, raw, base, sub, 0)
                            c[1] = _constant(constants, raw, base, sub, 1)
                            c[2] = _constant(constants, raw, base, sub, 2)
                            for h in T.serial(HALVES):  # loops, not unrolled: a Q6_K code is a long expression
                                for w in T.serial(4):
                                    word[0] = T.uint32(0)
                                    for b in T.serial(4):
                                        word[0] = T.bitwise_or(word[0], _byte_at(
                                            code(raw, base, sub, h * Q8A_BLOCK + q8a_weight_at(w, b), c), b))
                                    q8a[(out_block + i) * 8 + h * 4 + w] = word[0]
                                if source == "Q6_K":
                                    scale[(out_block + i) * HALVES + h] = c[0] * T.Cast(
                                        "float32", _q6_k_scale(raw, base, sub, h * Q8A_BLOCK))
                                else:
                                    scale[(out_block + i) * HALVES + h] = c[0]
                                wmin[(out_block + i) * HALVES + h] = c[1]

    return repack


def _requant_q8a(constants, value, SUB_BLOCKS, BLOCK_BYTES):
    decode_block = _block_decoder(constants, value, SUB_BLOCKS, BLOCK_BYTES)

    @T.prim_func(s_tir=True)
    def repack(raw_h: T.handle, q8a_h: T.handle, scale_h: T.handle, min_h: T.handle, blocks: T.int32,
               out_block: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n_raw, n_q8a_blocks = T.int32(), T.int32()
        raw = T.match_buffer(raw_h, (n_raw,), "uint32")
        q8a = T.match_buffer(q8a_h, (n_q8a_blocks * 4,), "uint32")
        scale = T.match_buffer(scale_h, (n_q8a_blocks,), "float32")
        wmin = T.match_buffer(min_h, (n_q8a_blocks,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("repack_q8a"):
                    T.reads()
                    T.writes()
                    c = T.sblock_alloc_buffer((CONSTANTS,), "float32", scope="local")
                    v = T.sblock_alloc_buffer((BLOCK,), "float32", scope="local")
                    lo_hi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    word = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(blocks, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < blocks:
                            decode_block(raw, c, v, i)
                            for h in T.serial(HALVES):
                                lo_hi[0] = v[h * Q8A_BLOCK]
                                lo_hi[1] = v[h * Q8A_BLOCK]
                                for e in T.serial(1, Q8A_BLOCK):
                                    lo_hi[0] = T.min(lo_hi[0], v[h * Q8A_BLOCK + e])
                                    lo_hi[1] = T.max(lo_hi[1], v[h * Q8A_BLOCK + e])
                                step: T.let[T.float32] = (lo_hi[1] - lo_hi[0]) / T.float32(Q8A_LEVELS)
                                inverse: T.let[T.float32] = T.if_then_else(step > T.float32(0), T.float32(1) / step,
                                                                           T.float32(0))
                                for w in T.serial(4):
                                    word[0] = T.uint32(0)
                                    for b in T.serial(4):
                                        level: T.let[T.float32] = T.round((v[h * Q8A_BLOCK + q8a_weight_at(w, b)] - lo_hi[0]) * inverse)
                                        word[0] = T.bitwise_or(word[0], _byte_at(T.Cast("int32", T.min(T.max(
                                            level, T.float32(0)), T.float32(Q8A_LEVELS))) - Q8A_OFFSET, b))
                                    q8a[(out_block + i) * 8 + h * 4 + w] = word[0]
                                scale[(out_block + i) * HALVES + h] = step
                                wmin[(out_block + i) * HALVES + h] = lo_hi[0] + T.float32(Q8A_OFFSET) * step

    return repack
