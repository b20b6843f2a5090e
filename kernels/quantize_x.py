"""A decode matmul's x as int8 codes, for the q4 matmul's integer dot products (`dot4I8Packed`).

x is cut into chunks of CHUNK (16) values: a q4 matmul lane's load of two packed words
(kernels.decode_matmul_common: WORDS_PER_LOAD x 8 weights). Per chunk, with v = x (times the RMSNorm's weight
where `normed`):

    d = max|v| / 127          codes c = floor(0.5 + v / d)   (signed bytes, |c| <= 127)
    xq[i, chunk]     = 4 u32 of codes in the order a q4 word pair is split by its nibbles:
                       word 0's even elements (0, 2, 4, 6), its odd ones (1, 3, 5, 7), then word 1's
    xstats[i, chunk] = (d, d * sum c, sum x^2, 0)   sum x^2 of the unnormed x, for the matmul's inv_rms

so the matmul's dot of the chunk with a weight row (value q * s + m) is
s * d * sum(q * c) + m * d * sum(c): four dot4I8Packed, no per-weight float work, and exactly the dot
with the dequantized codes c * d. (With m * sum(v) instead, the codes' rounding errors would meet
q * s, all of one sign, rather than the weights q * s + m, and not cancel: on the tiny test model's
random Q4_1 weights that took one decode step's logits 6.5% away instead of 0.8%.) The norm's weight
is applied here, so the matmul only scales its row total by inv_rms (from the chunks' sum x^2).

With `split_head_dim`, x is not read but merged from a split attention call's partial states
(kernels.decode_attention_merge's arithmetic and its rounding to `dtype`), which replaces the merge
dispatch.

One thread a 4-wide vector of x, four threads a chunk: they meet in workgroup memory twice (the
chunk's max, sum and sum x^2; then each thread's codes, half a word of two words), one barrier each.
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.model import q8a_code_position
from kernels.decode_attention_merge import MERGE_UNROLL, merge_split_states

THREADS = 256
VEC = 4
CHUNK = 16  # values of x per chunk: one q4 lane load (kernels.decode_matmul_common.WORDS_PER_LOAD words)
VECS = CHUNK // VEC  # threads per chunk
WORDS_PER_CHUNK = CHUNK // 4  # the codes' u32 words (4 signed bytes each): even/odd of 2 q4 words
CHUNKS_PER_GROUP = THREADS // VECS
CODE_MAX = 127.0  # the codes' range: signed bytes, symmetric
BYTE = 0xFF


# (word, byte) of value c of a chunk in its 4 words of codes: word 2u + h holds q4 word u's even (h = 0)
# or odd (h = 1) elements, in order; a q8a weight block's bytes are stored by the same rule. The kernel
# below packs by it four values a thread; MatmulSpec.quantizes_y's epilogue (kernels.decode_matmul_int8)
# one word a thread.
code_position = q8a_code_position


def quantize_x(dtype: str, normed: bool, split_head_dim: int | None = None):
    """xq, xstats (above) of x [n, 4 * vecs] (`vecs` 4-wide vectors, a runtime size; chunks = vecs / 4)."""
    merges = split_head_dim is not None
    MD = split_head_dim or VEC
    M_CHUNKS = MD // VEC  # 4-wide vectors of a head in the split workspace
    assert not merges or MD % CHUNK == 0  # a chunk within one head

    @T.prim_func(s_tir=True)
    def quantize(x_h: T.handle, partial_o_h: T.handle, partial_stats_h: T.handle, norm_h: T.handle,
                 xq_h: T.handle, xstats_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        vecs = T.int32()  # 4-wide vectors of x: in_features / 4
        heads = T.int32()
        num_splits = T.int32()
        x = T.match_buffer(x_h, (n, vecs), f"{dtype}x4")  # same bytes as [n, in]
        partial_o = T.match_buffer(partial_o_h, (n, heads, num_splits, M_CHUNKS), "float32x4")
        partial_stats = T.match_buffer(partial_stats_h, (n, heads, num_splits, 2), "float32")
        norm = T.match_buffer(norm_h, (vecs,), "float32x4")
        xq = T.match_buffer(xq_h, (n, vecs), "uint32")  # a chunk's 4 words: vecs / 4 chunks
        xstats = T.match_buffer(xstats_h, (n, vecs), "float32")  # a chunk's 4 floats: the matmul reads an f32x4
        for g in T.thread_binding(T.ceildiv(vecs, THREADS), thread="blockIdx.x"):
            for i in T.thread_binding(n, thread="blockIdx.y"):
                for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("quantize_x"):
                        T.reads()
                        T.writes()
                        # per thread: its vector's max |v| and sum x^2; then its two half words and sum of codes
                        meet = T.sblock_alloc_buffer((2 * THREADS,), "float32", scope="shared")
                        halves = T.sblock_alloc_buffer((2 * THREADS,), "uint32", scope="shared")
                        code_sums = T.sblock_alloc_buffer((THREADS,), "int32", scope="shared")
                        v = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                        st = T.sblock_alloc_buffer((2,), "float32", scope="local")  # max |v|, sum x^2
                        code_sum = T.sblock_alloc_buffer((1,), "int32", scope="local")  # this vector's codes' sum
                        stat = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        o_acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                        split_max = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                        split_sum = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                        split_o = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32x4", scope="local")
                        vec: T.let[T.int32] = g * THREADS + t
                        first: T.let[T.int32] = t - t % VECS  # the chunk's first thread
                        v[0] = T.Broadcast(T.float32(0), VEC)
                        if vec < vecs:
                            if merges:  # rounded to dtype, as the merge dispatch writes it
                                merge_split_states(partial_o, partial_stats, i, vec // M_CHUNKS, vec % M_CHUNKS,
                                                   num_splits, stat, o_acc, split_max, split_sum, split_o)
                                denom: T.let[T.float32] = T.if_then_else(stat[1] > T.float32(0), stat[1], T.float32(1))
                                v[0] = T.Cast("float32x4", T.Cast(f"{dtype}x4", o_acc[0] / T.Broadcast(denom, VEC)))
                            else:
                                v[0] = T.Cast("float32x4", x[i, vec])
                        st[1] = T.float32(0)
                        for e in T.unroll(VEC):
                            st[1] = st[1] + T.Shuffle([v[0]], [e]) * T.Shuffle([v[0]], [e])
                        if normed:
                            if vec < vecs:
                                v[0] = v[0] * norm[vec]
                        st[0] = T.float32(0)
                        for e in T.unroll(VEC):
                            st[0] = T.max(st[0], T.abs(T.Shuffle([v[0]], [e])))
                        for k in T.unroll(2):
                            meet[k * THREADS + t] = st[k]
                        T.tvm_storage_sync("shared")
                        for k in T.unroll(2):
                            st[k] = T.float32(0)
                        for j in T.unroll(VECS):  # the chunk's four vectors, in order (the same sums in every thread)
                            st[0] = T.max(st[0], meet[first + j])
                            st[1] = st[1] + meet[THREADS + first + j]
                        inv: T.let[T.float32] = T.if_then_else(st[0] > T.float32(0), T.float32(CODE_MAX) / st[0],
                                                               T.float32(0))
                        # this vector's codes: elements 0, 2 go to an "even" word, 1, 3 to an "odd" one
                        code_sum[0] = T.int32(0)
                        for h in T.unroll(2):
                            lo: T.let[T.int32] = T.Cast("int32", T.floor(T.float32(0.5) + T.Shuffle([v[0]], [h]) * inv))
                            hi: T.let[T.int32] = T.Cast("int32", T.floor(T.float32(0.5) + T.Shuffle([v[0]], [h + 2]) * inv))
                            code_sum[0] = code_sum[0] + lo + hi
                            halves[2 * t + h] = T.bitwise_or(
                                T.bitwise_and(T.reinterpret("uint32", lo), T.uint32(BYTE)),
                                T.shift_left(T.bitwise_and(T.reinterpret("uint32", hi), T.uint32(BYTE)), T.uint32(8)))
                        code_sums[t] = code_sum[0]
                        T.tvm_storage_sync("shared")
                        if vec < vecs:
                            # word k of the chunk: vectors 2 (k // 2) and 2 (k // 2) + 1, their even
                            # (k even) or odd half words, the later one in the upper 16 bits
                            k: T.let[T.int32] = t % VECS
                            a: T.let[T.int32] = first + 2 * (k // 2)
                            xq[i, vec] = T.bitwise_or(halves[2 * a + k % 2],
                                                      T.shift_left(halves[2 * (a + 1) + k % 2], T.uint32(16)))
                            # and float k of its stats: d, d * sum c, sum x^2, 0
                            d: T.let[T.float32] = st[0] / T.float32(CODE_MAX)
                            codes: T.let[T.int32] = code_sums[first] + code_sums[first + 1] + code_sums[first + 2] + \
                                code_sums[first + 3]
                            xstats[i, vec] = T.if_then_else(k == 0, d, T.if_then_else(
                                k == 1, d * T.Cast("float32", codes), T.if_then_else(k == 2, st[1], T.float32(0))))

    return quantize
