"""The decode matmul on x in `dtype`, writing y: y = x @ W^T (+ resid), with the RMSNorm before it and
the SwiGLU after it folded in where asked, and x made in workgroup memory where it is not in memory:
for the o-projection after a split attention call, merged from the call's partial states; for a
post-norm family's next matmul, the residual stream plus the last matmul's output normalized
(kernels.decode_matmul picks it; the parts: decode_matmul_common).
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import MatmulSpec
from kernels.decode_attention_merge import MERGE_UNROLL, merge_split_states
from kernels.decode_matmul_common import (LANES, ROWS, TOKENS, TRIP_UNROLL, Geometry, check_folds,
                                          column_value, dot_float_chunk, load_weight_chunk, reduce_lanes)
from kernels.llama_common import THREADS, workgroup_sum

VEC = 4  # the split workspace's vectors: f32x4
assert ROWS * LANES == THREADS  # the workgroup's invocations, as workgroup_sum counts them


@T.macro
def merge_x(g, head_dim, partial, partial_o, partial_stats, num_splits, tok0, r, lane, stat, o_acc, split_max,
            split_sum, split_o):
    """x into workgroup memory after the partials (at g.partial_words), merged from a split call's
    partial states a 4-wide vector a thread, with kernels.decode_attention_merge's arithmetic and its
    rounding to `dtype`: what the merge dispatch would have written, one barrier later."""
    for trip in T.unroll((g.in_features // VEC + ROWS * LANES - 1) // (ROWS * LANES)):
        chunk: T.let[T.int32] = trip * ROWS * LANES + r * LANES + lane
        if chunk < g.in_features // VEC:
            merge_split_states(partial_o, partial_stats, tok0, chunk // (head_dim // VEC), chunk % (head_dim // VEC),
                               num_splits, stat, o_acc, split_max, split_sum, split_o)
            denom: T.let[T.float32] = T.if_then_else(stat[1] > T.float32(0), stat[1], T.float32(1))
            for e in T.unroll(VEC):  # rounded to dtype, as the merge writes it
                partial[g.partial_words + chunk * VEC + e] = T.Cast("float32", T.Cast(
                    g.dtype, T.Shuffle([o_acc[0]], [e]) / denom))


@T.macro
def post_norm_x(g, x, stream, post_norm, stream_out, partial, sq, xv4, added, rb, r, lane, tok0, eps):
    """x into workgroup memory after the partials (at g.partial_words): stream + norm(x) * post_norm,
    what layer_ops.rms_norm(residual=True) would have written, rounded to `dtype` as it writes it;
    workgroup 0 also writes it to stream_out (the next residual add's stream). The sum of x^2 meets
    in workgroup memory after x (workgroup_sum). xv4, added: local f32x4, dtype x4."""
    t: T.let[T.int32] = r * LANES + lane
    sums: T.let[T.int32] = g.partial_words + g.in_features
    sq[0] = T.float32(0)
    for trip in T.unroll((g.in_features // VEC + THREADS - 1) // THREADS):
        c: T.let[T.int32] = trip * THREADS + t
        if c < g.in_features // VEC:
            xv4[0] = T.Cast("float32x4", x[tok0, c])
            for e in T.unroll(VEC):
                sq[0] = sq[0] + T.Shuffle([xv4[0]], [e]) * T.Shuffle([xv4[0]], [e])
    partial[sums + t] = sq[0]
    workgroup_sum(partial, sums, t)
    inv_rms: T.let[T.float32] = T.rsqrt(partial[sums] / T.float32(g.in_features) + eps)
    for trip in T.unroll((g.in_features // VEC + THREADS - 1) // THREADS):
        c: T.let[T.int32] = trip * THREADS + t
        if c < g.in_features // VEC:
            added[0] = T.Cast(f"{g.dtype}x4", T.Cast("float32x4", stream[tok0, c])
                              + T.Cast("float32x4", x[tok0, c]) * T.Broadcast(inv_rms, VEC) * post_norm[c])
            if rb == 0:
                stream_out[tok0, c] = added[0]
            for e in T.unroll(VEC):
                partial[g.partial_words + c * VEC + e] = T.Cast("float32", T.Shuffle([added[0]], [e]))


def float_x_matmul(spec: MatmulSpec):
    """y[n, out] = x[n, in] @ W^T (+ resid) with x in `dtype` (or merged: spec.split_head_dim), W q4,
    q8 or q8a; spec.norm_eps folds the RMSNorm before it, spec.glu the gated FFN after it (W's gate rows,
    then its up rows: y[n, F] = act(x @ Wg^T) * (x @ Wu^T), act spec.glu's: SiLU or GELU-tanh)."""
    check_folds(spec, "float-x", int8_x=spec.int8_x, rope_append=spec.rope_append is not None,
                argmax_partials=spec.argmax_partials, quantizes_y=spec.quantizes_y)
    g = Geometry.of(spec)
    in_features, dtype, out_dtype, residual = g.in_features, g.dtype, g.out_dtype, spec.residual
    merges, adds_post_norm = spec.split_head_dim is not None, spec.adds_post_norm
    assert not (merges and adds_post_norm)
    # x in workgroup memory after the partials (and, adds_post_norm, the workgroup's sums of x^2)
    x_in_memory = g.partial_words + in_features + THREADS * adds_post_norm if merges or adds_post_norm else g.partial_words
    MD = spec.split_head_dim or VEC  # split_head_dim: x[h * MD + i] from partial_o [n, MH, S, MD / 4] (f32x4)
    MH, M_CHUNKS = in_features // MD, MD // VEC
    assert not merges or in_features % MD == 0
    CPG, width_of = g.columns_per_group, g.out_columns

    @T.prim_func(s_tir=True)
    def matmul(x_h: T.handle, partial_o_h: T.handle, partial_stats_h: T.handle, stream_h: T.handle,
               post_norm_h: T.handle, norm_h: T.handle, w_h: T.handle, scale_h: T.handle, min_h: T.handle,
               resid_h: T.handle, y_h: T.handle, stream_out_h: T.handle, eps: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out_features = T.int32()  # W's rows (gate and up rows with glu)
        num_splits = T.int32()
        x = T.match_buffer(x_h, (n, in_features // 4), f"{dtype}x4")  # same bytes as [n, in]
        partial_o = T.match_buffer(partial_o_h, (n, MH, num_splits, M_CHUNKS), "float32x4")
        partial_stats = T.match_buffer(partial_stats_h, (n, MH, num_splits, 2), "float32")
        stream = T.match_buffer(stream_h, (n, in_features // 4), f"{dtype}x4")  # read only with adds_post_norm
        post_norm = T.match_buffer(post_norm_h, (in_features // 4,), "float32x4")
        stream_out = T.match_buffer(stream_out_h, (n, in_features // 4), f"{dtype}x4")
        norm = T.match_buffer(norm_h, (in_features // 4,), "float32x4")
        w = T.match_buffer(w_h, (g.w_rows(out_features), g.chunks), g.word_vector)  # [out, words]
        scale = T.match_buffer(scale_h, (g.w_rows(out_features), g.blocks), "float32")
        wmin = T.match_buffer(min_h, (g.w_rows(out_features), g.blocks), "float32")
        resid = T.match_buffer(resid_h, (n, width_of(out_features)), out_dtype)
        y = T.match_buffer(y_h, (n, width_of(out_features)), out_dtype)
        for rb in T.thread_binding(width_of(out_features) // CPG, thread="blockIdx.x"):
            for tb in T.thread_binding(T.ceildiv(n, TOKENS), thread="blockIdx.y"):
                for r in T.thread_binding(ROWS, thread="threadIdx.y"):
                    for lane in T.thread_binding(LANES, thread="threadIdx.x"):
                        with T.sblock("matmul"):
                            T.reads()
                            T.writes()
                            # the lanes' partial dots, (normed) the x^2 sums, (merges) the merged x
                            partial = T.sblock_alloc_buffer((x_in_memory,), "float32", scope="shared")
                            acc = T.sblock_alloc_buffer((g.rows_per_thread * TOKENS,), "float32", scope="local")
                            squares = T.sblock_alloc_buffer((TOKENS,), "float32", scope="local")
                            sq = T.sblock_alloc_buffer((1,), "float32", scope="local")  # adds_post_norm's x^2
                            added = T.sblock_alloc_buffer((1,), f"{dtype}x4", scope="local")  # ... its x
                            # this thread's rows' chunks, scales and mins at the current chunk
                            word = T.sblock_alloc_buffer((g.rows_per_thread,), g.word_vector,
                                                         scope="local")
                            ws = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            wm = T.sblock_alloc_buffer((g.rows_per_thread,), "float32", scope="local")
                            xv4 = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # the chunk's x
                            nq = T.sblock_alloc_buffer((g.x_vecs,), "float32x4", scope="local")  # its norm weights
                            # total: 0 a column's dot, 1 sum of x^2, 2 the up row's dot (glu)
                            total = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            # merges: the merge's state (max, denominator; O)
                            stat = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            o_acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                            split_max = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                            split_sum = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                            split_o = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32x4", scope="local")
                            tok0: T.let[T.int32] = tb * TOKENS
                            for a in T.unroll(g.rows_per_thread * TOKENS):
                                acc[a] = T.float32(0)
                            for j in T.unroll(TOKENS):
                                squares[j] = T.float32(0)
                            if merges:
                                merge_x(g, MD, partial, partial_o, partial_stats, num_splits, tok0, r, lane, stat,
                                        o_acc, split_max, split_sum, split_o)
                            if adds_post_norm:
                                post_norm_x(g, x, stream, post_norm, stream_out, partial, sq, xv4, added, rb, r, lane, tok0,
                                            eps)
                            for trips in T.serial(g.trip_groups):
                              for trip in T.unroll(TRIP_UNROLL):  # so that their loads are in flight together
                                wi: T.let[T.int32] = (trips * TRIP_UNROLL + trip) * LANES + lane  # the chunk
                                if wi < g.chunks:
                                    load_weight_chunk(g, w, scale, wmin, word, ws, wm, rb, r, wi,
                                                      width_of(out_features))
                                    dot_float_chunk(g, x, norm, merges or adds_post_norm, xv4, nq, partial, word,
                                                    ws, wm, acc, squares, r, tok0, n, wi)
                            reduce_lanes(g, acc, squares, partial, r, lane)
                            if lane < TOKENS:  # the epilogue: lane j finishes token j's columns
                                if tok0 + lane < n:
                                    for p in T.unroll(g.columns_per_thread):
                                        column_value(g, total, partial, p, r, lane, eps, False)
                                        column: T.let[T.int32] = rb * CPG + p * ROWS + r
                                        if residual:
                                            total[0] = total[0] + T.Cast("float32", resid[tok0 + lane, column])
                                        y[tok0 + lane, column] = T.Cast(out_dtype, total[0])

    return matmul
