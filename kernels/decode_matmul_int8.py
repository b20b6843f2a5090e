"""The decode matmul on int8 codes of x, writing y: the q4 or q8a dots as dot4I8Packed on x as
kernels.quantize_x made it, with the RMSNorm's inv_rms, the SwiGLU and a residual folded in where
asked, and optionally y's own codes for the next matmul (kernels.decode_matmul picks it; the parts:
decode_matmul_common).
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import MatmulSpec
from kernels.build_attrs import KEEP_WORKGROUP_BUFFERS_APART
from kernels.decode_matmul_common import (LANES, ROWS, TOKENS, TRIP_UNROLL, Geometry, check_folds,
                                          column_value, dot_int8_chunk, load_weight_chunk, quantize_x_prologue,
                                          reduce_lanes)
from kernels.quantize_x import BYTE, CHUNK as XQ_CHUNK, CODE_MAX, WORDS_PER_CHUNK as XQ_WORDS, code_position


@T.macro
def quantize_y(g, column_best, total, code, yq, ystats, rb, r, lane, tok0, n):
    """yq, ystats = the codes and stats kernels.quantize_x would make of this workgroup's chunk of y
    (column_best: its XQ_CHUNK values, rounded as written), one word of codes a thread of row 0 in the
    quantizer's rule and order. total[0] is the chunk's max |y|, total[1] 127 / max, total[2] a value;
    code[0] this word's bytes, code[1] the codes' sum."""
    if r == 0:
        if lane < XQ_WORDS:
            if tok0 < n:
                total[0] = T.float32(0)
                for c in T.serial(g.columns_per_group):
                    total[2] = column_best[c]
                    total[0] = T.max(total[0], T.abs(total[2]))
                total[1] = T.if_then_else(total[0] > T.float32(0), T.float32(CODE_MAX) / total[0], T.float32(0))
                code[0] = T.int32(0)
                code[1] = T.int32(0)
                for c in T.unroll(g.columns_per_group):
                    total[2] = column_best[c]
                    c_code: T.let[T.int32] = T.Cast("int32", T.floor(T.float32(0.5) + total[2] * total[1]))
                    code[1] = code[1] + c_code
                    if lane == code_position(c)[0]:  # value c is in this thread's word
                        code[0] = T.bitwise_or(code[0], T.shift_left(T.bitwise_and(c_code, BYTE),
                                                                     8 * code_position(c)[1]))
                yq[tok0, rb * XQ_WORDS + lane] = T.reinterpret("uint32", code[0])
                d: T.let[T.float32] = total[0] / T.float32(CODE_MAX)
                ystats[tok0, rb * XQ_WORDS + lane] = T.if_then_else(
                    lane == 0, d, T.if_then_else(lane == 1, d * T.Cast("float32", code[1]), T.float32(0)))


def int8_x_matmul(spec: MatmulSpec):
    """y[n, out] = x[n, in] @ W^T (+ resid) with W q4 or q8a and x as int8 codes with per-chunk stats (xq,
    xstats), or (spec.quantizes_x) x and the norm's weight, made into them by the prologue;
    spec.norm_eps scales each column by inv_rms from the chunks' sum x^2 (the quantizer or the
    prologue applied the norm's weight), spec.glu as in kernels.decode_matmul_float. With
    spec.quantizes_y (a workgroup's columns are one XQ_CHUNK of y) the epilogue also writes y's codes
    and stats (yq, ystats): the next matmul's quantize dispatch, folded in behind one barrier."""
    check_folds(spec, "int8-x", split_head_dim=spec.split_head_dim is not None,
                rope_append=spec.rope_append is not None, argmax_partials=spec.argmax_partials)
    g = Geometry.of(spec)
    in_features, out_dtype, residual, quantizes_y = g.in_features, g.out_dtype, spec.residual, spec.quantizes_y
    quantizes_x = spec.quantizes_x
    x_chunks = g.chunks if quantizes_x else 1  # the prologue's copy of x's codes in workgroup memory
    assert g.weights in ("q4", "q8a") and g.chunk_values == XQ_CHUNK  # a lane's chunk is one chunk of codes
    assert not quantizes_y or g.columns_per_group == XQ_CHUNK
    CPG, width_of = g.columns_per_group, g.out_columns

    @T.prim_func(s_tir=True)
    def matmul(x_h: T.handle, norm_h: T.handle, xq_h: T.handle, xstats_h: T.handle, w_h: T.handle,
               scale_h: T.handle, min_h: T.handle, resid_h: T.handle, y_h: T.handle, yq_h: T.handle,
               ystats_h: T.handle, eps: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out_features = T.int32()  # W's rows (gate and up rows with glu)
        x = T.match_buffer(x_h, (n, in_features // 4), f"{g.dtype}x4")  # quantizes_x: x, same bytes as [n, in]
        norm = T.match_buffer(norm_h, (in_features // 4,), "float32x4")  # and the norm's weight
        xq = T.match_buffer(xq_h, (n, g.chunks), "uint32x4")  # a chunk's codes (kernels.quantize_x)
        xstats = T.match_buffer(xstats_h, (n, g.chunks), "float32x4")  # and its d, d * sum c, sum x^2
        w = T.match_buffer(w_h, (g.w_rows(out_features), g.chunks), g.word_vector)
        scale = T.match_buffer(scale_h, (g.w_rows(out_features), g.blocks), "float32")
        wmin = T.match_buffer(min_h, (g.w_rows(out_features), g.blocks), "float32")
        resid = T.match_buffer(resid_h, (n, width_of(out_features)), out_dtype)
        y = T.match_buffer(y_h, (n, width_of(out_features)), out_dtype)
        yq = T.match_buffer(yq_h, (n, width_of(out_features) // 4), "uint32")  # quantizes_y: 4 words a chunk
        ystats = T.match_buffer(ystats_h, (n, width_of(out_features) // 4), "float32")  # and 4 floats
        for rb in T.thread_binding(width_of(out_features) // CPG, thread="blockIdx.x"):
            for tb in T.thread_binding(T.ceildiv(n, TOKENS), thread="blockIdx.y"):
                for r in T.thread_binding(ROWS, thread="threadIdx.y"):
                    for lane in T.thread_binding(LANES, thread="threadIdx.x"):
                        with T.sblock("matmul"):
                            T.reads()
                            T.writes()
                            # the lanes' partial dots, then (normed) the x^2 sums
                            partial = T.sblock_alloc_buffer((g.partial_words,), "float32", scope="shared")
                            # quantizes_y: the workgroup's chunk of y, as written (named as the head's staging)
                            column_best = T.sblock_alloc_buffer((CPG,), "float32", scope="shared")
                            # quantizes_x: x's codes and stats, made by the prologue
                            xq_made = T.sblock_alloc_buffer((1, x_chunks), "uint32x4", scope="shared")
                            xstats_made = T.sblock_alloc_buffer((1, x_chunks), "float32x4", scope="shared")
                            xv4 = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # a chunk of x
                            qs = T.sblock_alloc_buffer((3,), "float32", scope="local")  # its max, sums of x^2
                            xcode = T.sblock_alloc_buffer((XQ_WORDS + 1,), "int32", scope="local")  # words, sum
                            acc = T.sblock_alloc_buffer((g.rows_per_thread * TOKENS,), "float32", scope="local")
                            squares = T.sblock_alloc_buffer((TOKENS,), "float32", scope="local")
                            # this thread's rows' chunks, scales and mins at the current chunk
                            word = T.sblock_alloc_buffer((g.rows_per_thread,), g.word_vector,
                                                         scope="local")
                            ws = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            wm = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            xw = T.sblock_alloc_buffer((1,), "uint32x4", scope="local")  # the chunk's codes
                            xst = T.sblock_alloc_buffer((1,), "float32x4", scope="local")  # and stats
                            # total: 0 a column's dot, 1 sum of x^2, 2 the up row's dot (glu)
                            total = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            code = T.sblock_alloc_buffer((2,), "int32", scope="local")  # quantizes_y: word, sum
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
                                    load_weight_chunk(g, w, scale, wmin, word, ws, wm, rb, r, wi,
                                                      width_of(out_features))
                                    if quantizes_x:
                                        dot_int8_chunk(g, xq_made, xstats_made, 0, xw, xst, word, ws, wm, acc, squares,
                                                       r, tok0, n, wi)
                                    else:
                                        dot_int8_chunk(g, xq, xstats, tok0, xw, xst, word, ws, wm, acc, squares, r,
                                                       tok0, n, wi)
                            reduce_lanes(g, acc, squares, partial, r, lane)
                            if lane < TOKENS:  # the epilogue: lane j finishes token j's columns
                                if tok0 + lane < n:
                                    for p in T.unroll(g.columns_per_thread):
                                        column_value(g, total, partial, p, r, lane, eps, False)
                                        column: T.let[T.int32] = rb * CPG + p * ROWS + r
                                        if residual:
                                            total[0] = total[0] + T.Cast("float32", resid[tok0 + lane, column])
                                        y[tok0 + lane, column] = T.Cast(out_dtype, total[0])
                                        if quantizes_y:  # y's chunk, rounded as written
                                            column_best[p * ROWS + r] = T.Cast("float32", T.Cast(out_dtype, total[0]))
                            if quantizes_y:
                                quantize_y(g, column_best, total, code, yq, ystats, rb, r, lane, tok0, n)

    # the prologue's buffers live before `partial` does: TVM would put that f32 array in their storage
    return matmul.with_attr(KEEP_WORKGROUP_BUFFERS_APART, True) if quantizes_x else matmul
