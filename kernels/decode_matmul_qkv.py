"""The decode qkv matmul with RoPE and the K/V append as its epilogue: y is not written; q goes to `q`
and k, v into the token's page slot, rotated in f32 from the totals (rope_and_append, the separate
dispatch, reads them rounded to `dtype`). kernels.decode_matmul picks it; the parts: decode_matmul_common.
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import PAGE_SIZE, MatmulSpec
from kernels.build_attrs import KEEP_WORKGROUP_BUFFERS_APART
from kernels.decode_matmul_common import (LANES, ROWS, TOKENS, TRIP_UNROLL, Geometry, check_folds,
                                          column_value, dot_float_chunk, dot_int8_chunk, load_weight_chunk,
                                          quantize_x_prologue, reduce_lanes)
from kernels.layer_ops import rope_inv_freq
from kernels.quantize_x import CHUNK as XQ_CHUNK, WORDS_PER_CHUNK as XQ_WORDS


@T.macro
def rope_append(head_dim, scaled, dtype, total, column, position, slot_index, pages, q_out, q_heads, kv_heads,
                rope_exponent, rope_inv_factor, rope_ratio, rope_low, rope_span):
    """Store qkv column `column` (q heads, then k heads, then v heads): total[0] is its value, total[2]
    its RoPE pair's (the even column of a pair is x0, the odd x1: (x0 c - x1 s, x0 s + x1 c));
    total[3] takes the rotated value."""
    page: T.let[T.int32] = slot_index // PAGE_SIZE
    slot: T.let[T.int32] = slot_index % PAGE_SIZE
    head: T.let[T.int32] = column // head_dim
    i: T.let[T.int32] = column % head_dim
    if column < (q_heads + kv_heads) * head_dim:
        angle: T.let[T.float32] = T.Cast("float32", position) * rope_inv_freq(
            i // 2, rope_exponent, (rope_inv_factor, rope_ratio, rope_low, rope_span) if scaled else None)
        c: T.let[T.float32] = T.cos(angle)
        sn: T.let[T.float32] = T.sin(angle)
        if i % 2 == 0:
            total[3] = total[0] * c - total[2] * sn
        else:
            total[3] = total[2] * sn + total[0] * c
        if column < q_heads * head_dim:
            q_out[0, head, i] = T.Cast(dtype, total[3])
        else:
            pages[page, 0, head - q_heads, slot, i] = T.Cast(dtype, total[3])
    else:
        pages[page, 1, (column - (q_heads + kv_heads) * head_dim) // head_dim, slot, i] = T.Cast(dtype, total[0])


def qkv_rope_matmul(spec: MatmulSpec):
    """qkv = x[n, in] @ W^T (W q4, q8 or q8a, spec.norm_eps: the RMSNorm folded in), x in `dtype` or as
    int8 codes (spec.int8_x: read, or made by the prologue where spec.quantizes_x), then each q and k
    column rotated with its pair's other column and q, k, v stored (spec.rope_append: head_dim and
    scaling compiled in, heads and base runtime values)."""
    check_folds(spec, "qkv", glu=spec.glu is not None, residual=spec.residual,
                split_head_dim=spec.split_head_dim is not None, argmax_partials=spec.argmax_partials,
                quantizes_y=spec.quantizes_y)
    g = Geometry.of(spec)
    in_features, dtype, int8_x, quantizes_x = g.in_features, g.dtype, spec.int8_x, spec.quantizes_x
    x_chunks = g.chunks if quantizes_x else 1  # the prologue's copy of x's codes in workgroup memory
    assert not int8_x or (g.weights in ("q4", "q8a") and g.chunk_values == XQ_CHUNK)
    D = spec.rope_append.head_dim
    scaled = spec.rope_append.scaling is not None  # compiled in (contract.kernels.rope_tag)
    CPG = g.columns_per_group

    @T.prim_func(s_tir=True)
    def matmul(x_h: T.handle, xq_h: T.handle, xstats_h: T.handle, norm_h: T.handle, w_h: T.handle,
               scale_h: T.handle, min_h: T.handle, positions_h: T.handle, slots_h: T.handle, pages_h: T.handle,
               q_h: T.handle, eps: T.float32, rope_exponent: T.float32, rope_inv_factor: T.float32,
               rope_ratio: T.float32, rope_low: T.float32, rope_span: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out_features = T.int32()  # the qkv columns
        num_pages = T.int32()
        q_heads = T.int32()
        kv_heads = T.int32()
        x = T.match_buffer(x_h, (n, in_features // 4), f"{dtype}x4")  # same bytes as [n, in]
        xq = T.match_buffer(xq_h, (n, g.chunks), "uint32x4")  # int8_x: a chunk's codes (kernels.quantize_x)
        xstats = T.match_buffer(xstats_h, (n, g.chunks), "float32x4")  # and its d, d * sum c, sum x^2
        norm = T.match_buffer(norm_h, (in_features // 4,), "float32x4")
        w = T.match_buffer(w_h, (out_features, g.chunks), g.word_vector)  # same bytes as [out, words]
        scale = T.match_buffer(scale_h, (out_features, g.blocks), "float32")
        wmin = T.match_buffer(min_h, (out_features, g.blocks), "float32")
        positions = T.match_buffer(positions_h, (n,), "int32")
        slots = T.match_buffer(slots_h, (n,), "int32")
        pages = T.match_buffer(pages_h, (num_pages, 2, kv_heads, PAGE_SIZE, D), dtype)
        q = T.match_buffer(q_h, (n, q_heads, D), dtype)
        for rb in T.thread_binding(out_features // CPG, thread="blockIdx.x"):
            for tb in T.thread_binding(T.ceildiv(n, TOKENS), thread="blockIdx.y"):
                for r in T.thread_binding(ROWS, thread="threadIdx.y"):
                    for lane in T.thread_binding(LANES, thread="threadIdx.x"):
                        with T.sblock("matmul"):
                            T.reads()
                            T.writes()
                            # the lanes' partial dots, then (normed) the x^2 sums
                            partial = T.sblock_alloc_buffer((g.partial_words,), "float32", scope="shared")
                            acc = T.sblock_alloc_buffer((g.rows_per_thread * TOKENS,), "float32", scope="local")
                            squares = T.sblock_alloc_buffer((TOKENS,), "float32", scope="local")
                            # this thread's rows' chunks, scales and mins at the current chunk
                            word = T.sblock_alloc_buffer((g.rows_per_thread,), g.word_vector,
                                                         scope="local")
                            ws = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            wm = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            xv4 = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # the chunk's x
                            xw = T.sblock_alloc_buffer((1,), "uint32x4", scope="local")  # int8_x: its codes
                            xst = T.sblock_alloc_buffer((1,), "float32x4", scope="local")  # and stats
                            nq = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # its norm weights
                            # quantizes_x: x's codes and stats, made by the prologue
                            xq_made = T.sblock_alloc_buffer((1, x_chunks), "uint32x4", scope="shared")
                            xstats_made = T.sblock_alloc_buffer((1, x_chunks), "float32x4", scope="shared")
                            qs = T.sblock_alloc_buffer((3,), "float32", scope="local")  # a chunk's max, sums of x^2
                            xcode = T.sblock_alloc_buffer((XQ_WORDS + 1,), "int32", scope="local")  # words, sum
                            # total: 0 a column's dot, 1 sum of x^2, 2 its RoPE pair's dot, 3 the rotated value
                            total = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            tok0: T.let[T.int32] = tb * TOKENS
                            for a in T.unroll(g.rows_per_thread * TOKENS):
                                acc[a] = T.float32(0)
                            for j in T.unroll(TOKENS):
                                squares[j] = T.float32(0)
                            if quantizes_x:
                                quantize_x_prologue(g, x, norm, xq_made, xstats_made, xv4, qs, xcode, r, lane, tok0, n)
                            for trips in T.serial(g.trip_groups):
                              for trip in T.unroll(TRIP_UNROLL):  # so that their loads are in flight together
                                wi: T.let[T.int32] = (trips * TRIP_UNROLL + trip) * LANES + lane  # the chunk
                                if wi < g.chunks:
                                    load_weight_chunk(g, w, scale, wmin, word, ws, wm, rb, r, wi, out_features)
                                    if quantizes_x:
                                        dot_int8_chunk(g, xq_made, xstats_made, 0, xw, xst, word, ws, wm, acc,
                                                       squares, r, tok0, n, wi)
                                    elif int8_x:
                                        dot_int8_chunk(g, xq, xstats, tok0, xw, xst, word, ws, wm, acc, squares, r,
                                                       tok0, n, wi)
                                    else:
                                        dot_float_chunk(g, x, norm, False, xv4, nq, partial, word, ws, wm, acc,
                                                        squares, r, tok0, n, wi)
                            reduce_lanes(g, acc, squares, partial, r, lane)
                            if lane < TOKENS:  # the epilogue: lane j finishes token j's columns
                                if tok0 + lane < n:
                                    for p in T.unroll(g.columns_per_thread):
                                        column_value(g, total, partial, p, r, lane, eps, True)
                                        column: T.let[T.int32] = rb * CPG + p * ROWS + r
                                        rope_append(D, scaled, dtype, total, column, positions[tok0], slots[tok0],
                                                    pages, q, q_heads, kv_heads, rope_exponent, rope_inv_factor,
                                                    rope_ratio, rope_low, rope_span)

    # the prologue's buffers live before `partial` does: TVM would put that f32 array in their storage
    return matmul.with_attr(KEEP_WORKGROUP_BUFFERS_APART, True) if quantizes_x else matmul
