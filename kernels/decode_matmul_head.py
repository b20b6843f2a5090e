"""The decode head: logits = x @ W^T (the tied q8 embedding, the final RMSNorm folded in), and each
workgroup's best logit with its index, so that the argmax (kernels.sampling.argmax_partials) reads one
pair a workgroup rather than every logit. kernels.decode_matmul picks it; the parts: decode_matmul_common.

It runs on a slice of the vocabulary's rows (contract.slices: a head past the adapter's binding limit
runs once per slice): W, its scales and mins are bound at the slice's first row, `row_base`, and
out_features is the slice's rows; y (`vocab` wide) and best are the whole vocabulary's, written at
the slice's columns and workgroups, with global indices. The whole vocabulary is one slice, row_base 0.
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import MatmulSpec
from kernels.decode_matmul_common import (LANES, ROWS, TOKENS, TRIP_UNROLL, Geometry, check_folds,
                                          column_value, dot_float_chunk, load_weight_chunk, reduce_lanes)

NO_NUMBER = -3.0e38  # the search's start: a workgroup whose logits are all NaN reports index out_features


@T.macro
def workgroup_best(g, column_best, total, best, group, r, lane, vocab):
    """best[group] = (the largest of the workgroup's logits, its column): columns in increasing order,
    so '>' keeps the lowest index of a tie. column_best holds each column's logit, then its index
    (f32, exact below 2^24); total[0..3] are scratch (a shared read cannot sit in a condition)."""
    if r == 0:
        if lane == 0:
            total[0] = T.float32(NO_NUMBER)
            total[1] = T.Cast("float32", vocab)
            for c in T.serial(g.columns_per_group):
                total[2] = column_best[c]
                total[3] = column_best[g.columns_per_group + c]
                if total[2] > total[0]:
                    total[0] = total[2]
                    total[1] = total[3]
            best[group, 0] = total[0]
            best[group, 1] = total[1]


def head_matmul(spec: MatmulSpec):
    """y[n, out] = x[n, in] @ W^T in out_dtype (f32 logits), W q8 or q4, x in `dtype`, spec.norm_eps
    folding the RMSNorm in; each workgroup also writes best[workgroup] (spec.argmax_partials). W's
    rows are the vocabulary's from `row_base` on (one slice of it), y's columns and best's workgroups
    the whole vocabulary's."""
    check_folds(spec, "head", glu=spec.glu is not None, residual=spec.residual, int8_x=spec.int8_x,
                split_head_dim=spec.split_head_dim is not None, rope_append=spec.rope_append is not None,
                quantizes_y=spec.quantizes_y)
    g = Geometry.of(spec)
    in_features, dtype, out_dtype = g.in_features, g.dtype, g.out_dtype
    CPG = g.columns_per_group

    @T.prim_func(s_tir=True)
    def matmul(x_h: T.handle, norm_h: T.handle, w_h: T.handle, scale_h: T.handle, min_h: T.handle, y_h: T.handle,
               best_h: T.handle, eps: T.float32, row_base: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out_features = T.int32()  # the slice's rows of the vocabulary (from row_base on)
        vocab = T.int32()  # the whole vocabulary: y's width
        x = T.match_buffer(x_h, (n, in_features // 4), f"{dtype}x4")  # same bytes as [n, in]
        norm = T.match_buffer(norm_h, (in_features // 4,), "float32x4")
        w = T.match_buffer(w_h, (out_features, g.chunks), g.word_vector)  # same bytes as [out, words]
        scale = T.match_buffer(scale_h, (out_features, g.blocks), "float32")
        wmin = T.match_buffer(min_h, (out_features, g.blocks), "float32")  # q4 and q8a only
        y = T.match_buffer(y_h, (n, vocab), out_dtype)
        best = T.match_buffer(best_h, (vocab // CPG, 2), "float32")
        for rb in T.thread_binding(out_features // CPG, thread="blockIdx.x"):
            for tb in T.thread_binding(T.ceildiv(n, TOKENS), thread="blockIdx.y"):
                for r in T.thread_binding(ROWS, thread="threadIdx.y"):
                    for lane in T.thread_binding(LANES, thread="threadIdx.x"):
                        with T.sblock("matmul"):
                            T.reads()
                            T.writes()
                            # the lanes' partial dots, then (normed) the x^2 sums
                            partial = T.sblock_alloc_buffer((g.partial_words,), "float32", scope="shared")
                            # each column's logit, then its index
                            column_best = T.sblock_alloc_buffer((2 * CPG,), "float32", scope="shared")
                            acc = T.sblock_alloc_buffer((g.rows_per_thread * TOKENS,), "float32", scope="local")
                            squares = T.sblock_alloc_buffer((TOKENS,), "float32", scope="local")
                            # this thread's rows' chunks, scales and mins at the current chunk
                            word = T.sblock_alloc_buffer((g.rows_per_thread,), g.word_vector,
                                                         scope="local")
                            ws = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            wm = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            xv4 = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # the chunk's x
                            nq = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # its norm weights
                            # total: 0 a column's dot, 1 sum of x^2, 2 and 3 workgroup_best's scratch
                            total = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            tok0: T.let[T.int32] = tb * TOKENS
                            for a in T.unroll(g.rows_per_thread * TOKENS):
                                acc[a] = T.float32(0)
                            for j in T.unroll(TOKENS):
                                squares[j] = T.float32(0)
                            for trips in T.serial(g.trip_groups):
                              for trip in T.unroll(TRIP_UNROLL):  # so that their loads are in flight together
                                wi: T.let[T.int32] = (trips * TRIP_UNROLL + trip) * LANES + lane  # the chunk
                                if wi < g.chunks:
                                    load_weight_chunk(g, w, scale, wmin, word, ws, wm, rb, r, wi, out_features)
                                    dot_float_chunk(g, x, norm, False, xv4, nq, partial, word, ws, wm, acc, squares,
                                                    r, tok0, n, wi)
                            reduce_lanes(g, acc, squares, partial, r, lane)
                            if lane < TOKENS:  # the epilogue: lane j finishes token j's columns
                                if tok0 + lane < n:
                                    for p in T.unroll(g.columns_per_thread):
                                        column_value(g, total, partial, p, r, lane, eps, False)
                                        column: T.let[T.int32] = row_base + rb * CPG + p * ROWS + r  # global
                                        y[tok0 + lane, column] = T.Cast(out_dtype, total[0])
                                        column_best[p * ROWS + r] = total[0]
                                        column_best[CPG + p * ROWS + r] = T.Cast("float32", column)
                            workgroup_best(g, column_best, total, best, T.floordiv(row_base, CPG) + rb, r, lane,
                                           vocab)

    return matmul
