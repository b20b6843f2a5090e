"""TIR pieces the sharded-family decode kernels share (expression builders, run while TVMScript parses).

The paged KV layout is TVM's (`batch_decode_paged_kv`):

    pages[num_pages, 2, H_kv, page_size, D] (0 = K, 1 = V), read as 4-wide vectors (`VEC`);
    sequence b owns page_table_values[indptr[b]:indptr[b+1]]; length_info[b] is its last page's
    fill, or with a sliding window length_info[:, b] = (last page fill, window offset, sink size).

Row i of the attended context (0 <= i < kv_len) lives at sequence offset `seq_offset_of(i)`: i itself,
or with a window, the first `sink` rows and then rows from the window offset on. Scores are in the
log2 domain (q is pre-scaled by sm_scale * log2 e); `lse` = max + log2(denominator).
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

VEC = 4  # K, V, q and O move as 4-wide vectors: one 8-byte f16 (16-byte f32) access, not four
LOG2_E = math.log2(math.e)
# The online softmax starts from max = MASKED_SCORE, denominator 0: an empty context (or split) gives
# O = 0, lse = MASKED_SCORE, and exp2(MASKED_SCORE - m) underflows to 0 for any real score m, so such
# a state adds nothing to a merge. TVM's tiled kernel starts from denominator 1 instead (see
# tests/test_decode_attention.py::test_empty_sequence_lse).
MASKED_SCORE = -5e4
MASKED_ROW = -1e30  # the score of a row slot past the context: exp2(MASKED_ROW - m) = 0
# 2 pi as 6.28125 (8 significant bits, so n * TWO_PI_HI is exact for n < 2^16) plus the rest.
TWO_PI_HI = 6.28125
TWO_PI_LO = 2 * math.pi - TWO_PI_HI


def kv_len_of(indptr_begin, indptr_end, b, length_info, sliding_window: bool, page_size: int):
    """Rows sequence b attends to (0 without pages; never negative)."""
    num_pages = indptr_end - indptr_begin
    if sliding_window:
        rows = (num_pages - 1) * page_size + length_info[0, b] - length_info[1, b] + length_info[2, b]
    else:
        rows = (num_pages - 1) * page_size + length_info[b]
    return T.if_then_else(indptr_begin < indptr_end, T.max(rows, 0), 0)


def seq_offset_of(pos, b, length_info, sliding_window: bool):
    """Row -> offset in the sequence's pages: the first `sink` rows are the sink, the rest start at
    the window offset."""
    if sliding_window:
        return T.if_then_else(pos < length_info[2, b], pos, pos - length_info[2, b] + length_info[1, b])
    return pos


@T.macro
def rope_cos_sin(rot, pos, chunk, head_dim: int, rope_scale, rope_theta):
    """rot[0], rot[1] = cos and sin (f32x4) of the RoPE angles of the 4 dims of vector `chunk` at `pos`.

    TVM's rotate-half convention: dims d and d + D/2 share frequency theta^(-2 (d mod D/2) / D).
    WGSL's sin/cos are only accurate near [-pi, pi], and angles reach pos radians, so the angle is
    reduced by Cody-Waite with a two-part 2 pi; what remains is the f32 rounding of the angle itself.
    Written as statements on `rot` so that the WGSL stays small (TVM's CSE is off for the build).
    """
    rot[1] = T.Broadcast(T.Cast("float32", pos) * rope_scale, VEC) * T.exp2(
        T.Cast("float32x4", 2 * T.Ramp(T.floormod(chunk, head_dim // 2 // VEC) * VEC, 1, VEC))
        * (-T.log2(rope_theta) / T.float32(head_dim)))
    rot[0] = T.round(rot[1] * T.Broadcast(T.float32(1 / (2 * math.pi)), VEC))  # whole turns
    rot[1] = (rot[1] - rot[0] * T.Broadcast(T.float32(TWO_PI_HI), VEC)) - rot[0] * T.Broadcast(T.float32(TWO_PI_LO), VEC)
    rot[0] = T.cos(rot[1])
    rot[1] = T.sin(rot[1])


@T.macro
def rope_rotate(dst, x4, partner4, pos, chunk, head_dim: int, rope_scale, rope_theta, rot):
    """dst[0] = the 4 dims of vector `chunk` rotated at `pos` (f32x4). `partner4` holds dims d + D/2
    (first half) or d - D/2 (second half); a chunk never straddles D/2, so the rotation's sign is one
    scalar. `rot` is 2 x f32x4 of local scratch (rope_cos_sin)."""
    rope_cos_sin(rot, pos, chunk, head_dim, rope_scale, rope_theta)
    dst[0] = x4 * rot[0] + T.Broadcast(T.if_then_else(chunk < head_dim // 2 // VEC, T.float32(-1), T.float32(1)),
                                       VEC) * partner4 * rot[1]


def partner_chunk(chunk, head_dim: int):
    """The vector RoPE pairs with vector `chunk` (d +- D/2)."""
    half_chunks = head_dim // 2 // VEC
    return T.if_then_else(chunk < half_chunks, chunk + half_chunks, chunk - half_chunks)


def lane_sum(v4):
    """The 4 lanes of a vector added."""
    return T.Shuffle([v4], [0]) + T.Shuffle([v4], [1]) + T.Shuffle([v4], [2]) + T.Shuffle([v4], [3])


def broadcast(x, lanes: int):
    """x in every lane of a `lanes`-wide vector (x itself for one lane)."""
    return x if lanes == 1 else T.Broadcast(x, lanes)


def lane_of(v, i, lanes: int):
    """Lane i of a `lanes`-wide vector (v itself for one lane)."""
    return v if lanes == 1 else T.Shuffle([v], [i])


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)
