"""The decode matmul: one token's (or the head's) y = x @ W^T on 4- or 8-bit weights, with its folds.

Prefill passes run kernels.prefill_matmul (scalar) or kernels.prefill_matmul_matrix (subgroup
matrices), which tile tokens as well as rows. The packing and conventions: kernels.llama_common.
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import MATMUL_ROWS, PAGE_SIZE, MatmulSpec
from kernels.decode_attention_merge import MERGE_UNROLL, merge_split_states
from kernels.layer_ops import rope_inv_freq
from kernels.llama_common import BLOCK, sign_extend_byte
from kernels.quantize_x import BYTE, CHUNK as XQ_CHUNK, CODE_MAX, WORDS_PER_CHUNK as XQ_WORDS, code_position

# The decode matmul's loads (fitted on the H200, docs/benchmarks.md): a lane reads two neighbouring
# packed words of a row at once (8 bytes: a warp's load spans 256 contiguous bytes) and has four
# such loads a row in flight (its trip loop unrolled by 4).
WORDS_PER_LOAD = 2
TRIP_UNROLL = 4
LOW_NIBBLES = 0x0F0F0F0F  # int8_x: a q4 word's even elements, one a byte (the odd ones after a shift by 4)


def quantized_matmul(spec: MatmulSpec):
    """y[n, out] = x[n, in] @ W^T (+ resid), W in the q4 or q8 packing; optionally with the
    RMSNorm before it and the SwiGLU after it folded in, so neither is a dispatch of its own.

    256 invocations = ROWS (8) x LANES (32) lanes, each thread one weight row or, where enough
    workgroups remain, two (spec.rows_per_thread: one load of x serves both); a lane walks the row
    WORDS_PER_LOAD packed words at a time with stride 32 loads (neighbouring lanes read neighbouring
    chunks), TRIP_UNROLL loads in flight, dequantizes each word once and
    applies it to the TOKENS tokens of its workgroup (1: the decode step and the head; prefill passes
    run kernels.prefill_matmul, which tiles tokens as well as rows). The 32
    lane partials of each (row, token) meet in workgroup memory behind one barrier.
    (A barrier-free one-row-per-invocation variant was measured no faster on lavapipe.)

    With `spec.subgroup_lanes` (S), each S neighbouring lanes first add up their partials with
    subgroup shuffles (`subgroupShuffleDown`, so lane 0 of the S holds their sum: right wherever
    subgroups hold whole, aligned runs of S invocations, as the host checks), and only 32 / S
    partials a row go through workgroup memory. On the H200 (S = 32) that took the 8B shape's decode
    step 4.52 -> 3.76 ms, most of it in the gate/up, qkv and head matmuls (docs/benchmarks.md). Which
    part pays (fewer workgroup-memory stores, or the epilogue's 1 serial term a row instead of 32)
    was not separated.

    With `norm_eps`, x is RMS-normalized with weight `norm` first. Since
    norm(x) @ W^T = inv_rms(x) * (x @ (W * norm)^T), the lanes scale each dequantized weight by
    `norm`, the lanes of row 0 also sum x^2 over the same words, and the epilogue scales the row's
    total by inv_rms: the normalized x never goes to memory, and it is not rounded to `dtype`
    either.

    With `swiglu`, W holds the gate rows then the up rows ([2F, in]) and y[n, F] =
    silu(x @ Wg^T) * (x @ Wu^T): a thread takes the gate row and the up row of each of its columns,
    so the epilogue finds both totals in workgroup memory.

    With `rope_append` (the decode qkv matmul), y is not written: the epilogue rotates each q and k
    column with its pair's other column (rows r and r ^ 1 of the workgroup: a pair never crosses a
    workgroup's 8-column groups) and writes q to `q` and k, v into the token's page slot, in f32 from
    the totals (rope_and_append, the separate dispatch, reads them rounded to `dtype`).

    With `split_head_dim` (the o-projection after a split attention call), x is first merged from
    the call's partial states into workgroup memory, each thread a 4-wide chunk, with
    kernels.decode_attention_merge's code (its online softmax over splits, the division and the
    rounding to `dtype`; kept as f32 beside the lanes' partials): x is what the merge dispatch
    would have written, one barrier later.

    With `argmax_partials` (the head), each workgroup also writes the largest of its columns and
    its index (the lowest on ties) to best[workgroup], for argmax_partials.

    With `int8_x` (q4, decode), x comes as kernels.quantize_x made it: per 16-value chunk 4 words
    of int8 codes c and (d, d * sum c, sum x^2). A lane splits each loaded word into its even and odd
    nibbles (two masks, one shift) and takes the chunk's dot with four dot4I8Packed: the chunk adds
    s * d * dot + m * d * sum c to the row (the dot with the dequantized codes), with no float work a
    weight and 6-7 registers of x a load in flight instead of 16 (32 with the norm's weights). On the
    H200 that took the 8B shape's step 3.79 -> 3.20 ms of GPU (docs/benchmarks.md). The quantizer
    applied the norm's weight; with `norm_eps` the lanes of row 0 sum the chunks' sum x^2 for
    inv_rms as before.

    With `quantizes_y` (a workgroup's columns are one 16-value chunk: SwiGLU with 4 rows a thread),
    the epilogue also writes y's int8 codes and stats as kernels.quantize_x would from y (rounded to
    out_dtype) into yq, ystats: the next matmul's quantize dispatch, folded in behind one barrier.

    Both folds are for GPUs, where a dispatch costs more than the work folded in. On lavapipe
    they cost more than the dispatches they save (SmolLM2 decode: the folded qkv 2.0 ms against
    1.1 + 0.1 ms apart; gate/up with SwiGLU 4.3 ms against 3.4 + 0.06 ms: two row streams per
    workgroup instead of one), so CPU rasterizers run rms_norm, the plain matmul and swiglu.
    """
    assert not spec.tiled
    # out_features (but with SwiGLU, MatmulSpec.compiled_rows), norm_eps and the RoPE values are runtime
    # values (contract.kernels.MatmulSpec.values)
    in_features, dtype, weight_format = spec.in_features, spec.dtype, spec.weights
    residual, normed, swiglu, rope = spec.residual, spec.norm_eps is not None, spec.swiglu, spec.rope_append
    rotates = rope is not None  # TVMScript's `if` takes a bool, not any object
    ROWS, LANES = MATMUL_ROWS, 32
    TOKENS = 1  # tokens per workgroup: decode passes and the head run one
    ROWS_PER_THREAD = spec.rows_per_thread
    PER_WORD = 8 if weight_format == "q4" else 4
    WORDS = in_features // PER_WORD
    CHUNKS = WORDS // WORDS_PER_LOAD  # a row's loads of WORDS_PER_LOAD neighbouring words
    CHUNK_VALUES = WORDS_PER_LOAD * PER_WORD  # weights per load: within one quantization block
    assert WORDS % WORDS_PER_LOAD == 0 and BLOCK % CHUNK_VALUES == 0
    TRIPS = (CHUNKS + LANES - 1) // LANES  # a lane's loads along a row
    X_VECS = CHUNK_VALUES // 4  # x's (and the norm's) 4-wide vectors per chunk
    COLUMNS_PER_GROUP = spec.columns_per_group  # y's columns per workgroup
    DOTS = ROWS_PER_THREAD * ROWS * TOKENS * LANES  # the lanes' partial dots, then (normed) row 0's x^2 sums
    out_dtype = spec.out_dtype or dtype
    assert in_features % BLOCK == 0
    # rope_append: q heads, then k heads, then v heads in the qkv columns; a page row per token
    D = rope.head_dim if rope else 2
    scaled = rope is not None and rope.scaling is not None  # compiled in (contract.kernels.rope_tag)
    assert not rope or (TOKENS == 1 and not swiglu and not residual)
    # split_head_dim: x[h * MD + i] from partial_o [n, MH, S, MD / 4] (f32x4) and partial_stats [n, MH, S, 2]
    merges = spec.split_head_dim is not None
    MD = spec.split_head_dim or 4
    MH, M_CHUNKS = in_features // MD, MD // 4
    X_CHUNKS = in_features // 4
    MERGED_AT = DOTS + TOKENS * LANES if normed else DOTS  # f32 words of `partial` before the merged x
    MERGE_TRIPS = (X_CHUNKS + ROWS * LANES - 1) // (ROWS * LANES)
    assert not merges or (in_features % MD == 0 and TOKENS == 1)
    int8_x = spec.int8_x
    quantizes_y = spec.quantizes_y
    assert not quantizes_y or (COLUMNS_PER_GROUP == XQ_CHUNK and TOKENS == 1 and not rope and not spec.argmax_partials)
    assert not int8_x or (weight_format == "q4" and CHUNK_VALUES == XQ_CHUNK and not merges and TOKENS == 1)

    COLUMNS_PER_THREAD = ROWS_PER_THREAD // 2 if swiglu else ROWS_PER_THREAD
    # subgroup_lanes: the lanes whose partials meet by shuffles; 1 without subgroups
    SUBGROUP_LANES = spec.subgroup_lanes or 1
    SHUFFLE_STEPS = SUBGROUP_LANES.bit_length() - 1
    assert SUBGROUP_LANES == 1 << SHUFFLE_STEPS and LANES % SUBGROUP_LANES == 0
    LANE_SUMS = LANES // SUBGROUP_LANES  # the partials of a (row, token) that meet in workgroup memory

    COMPILED_ROWS = spec.compiled_rows  # W's rows where they are compiled in (the up rows' offset)

    def w_rows(out_features):  # W's rows: the runtime value, or the compiled one
        return COMPILED_ROWS if COMPILED_ROWS is not None else out_features

    def out_columns(out_features):  # y's width
        return w_rows(out_features) // 2 if swiglu else out_features

    def weight_row(rb, r, q, width):
        # a thread's columns (of y, `width` wide) are rb * COLUMNS_PER_GROUP + c * ROWS + r; with
        # swiglu q = 2c is column c's gate row and q = 2c + 1 its up row, `width` rows further on
        if swiglu:
            return (q % 2) * width + rb * COLUMNS_PER_GROUP + (q // 2) * ROWS + r
        return rb * COLUMNS_PER_GROUP + q * ROWS + r

    def dot_row(c):  # the row (q) whose dot makes column c of the thread
        return 2 * c if swiglu else c

    def x_value(xv4, partial, wi, k):  # element k of chunk wi's x: loaded 4-wide, or merged into workgroup memory
        if merges:
            return partial[MERGED_AT + wi * CHUNK_VALUES + k]
        return T.Shuffle([xv4[k // 4]], [k % 4])

    def word_of(word, p, u):  # word u of row p's loaded chunk
        return T.Shuffle([word[p]], [u])

    def weight_value(word, k, s, m):
        if weight_format == "q4":
            return T.Cast("float32", T.bitwise_and(T.shift_right(word, T.uint32(4 * k)), T.uint32(15))) * s + m
        return T.Cast("float32", sign_extend_byte(word, k)) * s

    @T.macro
    def rope_epilogue(total, column, position, slot_index, pages, q_out, q_heads, kv_heads, rope_exponent,
                      rope_inv_factor, rope_ratio, rope_low, rope_span):
        # total[0] is this column's value, total[2] its pair's: rotate (q, k), then store (q, k, v)
        page: T.let[T.int32] = slot_index // PAGE_SIZE
        slot: T.let[T.int32] = slot_index % PAGE_SIZE
        head: T.let[T.int32] = column // D
        i: T.let[T.int32] = column % D
        if column < (q_heads + kv_heads) * D:
            angle: T.let[T.float32] = T.Cast("float32", position) * rope_inv_freq(
                i // 2, rope_exponent, (rope_inv_factor, rope_ratio, rope_low, rope_span) if scaled else None)
            c: T.let[T.float32] = T.cos(angle)
            sn: T.let[T.float32] = T.sin(angle)
            # the even column of a pair is x0, the odd x1: (x0 c - x1 s, x0 s + x1 c)
            if i % 2 == 0:
                total[3] = total[0] * c - total[2] * sn
            else:
                total[3] = total[2] * sn + total[0] * c
            if column < q_heads * D:
                q_out[0, head, i] = T.Cast(dtype, total[3])
            else:
                pages[page, 0, head - q_heads, slot, i] = T.Cast(dtype, total[3])
        else:
            pages[page, 1, (column - (q_heads + kv_heads) * D) // D, slot, i] = T.Cast(dtype, total[0])

    def int8_dot(word, p, xw):  # the chunk's dot of row p's codes with x's: four dot4I8Packed
        terms = []
        for u in range(WORDS_PER_LOAD):
            w_u = word_of(word, p, u)
            for half, nibbles in enumerate((w_u, T.shift_right(w_u, T.uint32(4)))):
                terms.append(T.call_pure_extern("int32", "dot4I8Packed", T.bitwise_and(nibbles, T.uint32(LOW_NIBBLES)),
                                                T.Shuffle([xw[0]], [2 * u + half])))
        return (terms[0] + terms[1]) + (terms[2] + terms[3])

    @T.prim_func(s_tir=True)
    def matmul(x_h: T.handle, xq_h: T.handle, xstats_h: T.handle, partial_o_h: T.handle, partial_stats_h: T.handle,
               norm_h: T.handle, w_h: T.handle,
               scale_h: T.handle, min_h: T.handle, resid_h: T.handle, y_h: T.handle, positions_h: T.handle,
               slots_h: T.handle, pages_h: T.handle, q_h: T.handle, best_h: T.handle, yq_h: T.handle,
               ystats_h: T.handle, eps: T.float32,
               rope_exponent: T.float32, rope_inv_factor: T.float32, rope_ratio: T.float32, rope_low: T.float32,
               rope_span: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out_features = T.int32()  # W's rows (gate and up rows with swiglu)
        num_pages = T.int32()
        num_splits = T.int32()
        q_heads = T.int32()
        kv_heads = T.int32()
        x = T.match_buffer(x_h, (n, in_features // 4), f"{dtype}x4")  # same bytes as [n, in]
        xq = T.match_buffer(xq_h, (n, CHUNKS), "uint32x4")  # int8_x: a chunk's codes (kernels.quantize_x)
        xstats = T.match_buffer(xstats_h, (n, CHUNKS), "float32x4")  # and its d, d * sum c, sum x^2
        partial_o = T.match_buffer(partial_o_h, (n, MH, num_splits, M_CHUNKS), "float32x4")
        partial_stats = T.match_buffer(partial_stats_h, (n, MH, num_splits, 2), "float32")
        norm = T.match_buffer(norm_h, (in_features // 4,), "float32x4")
        w = T.match_buffer(w_h, (w_rows(out_features), CHUNKS), f"uint32x{WORDS_PER_LOAD}")  # same bytes as [out, WORDS]
        scale = T.match_buffer(scale_h, (w_rows(out_features), in_features // BLOCK), "float32")
        wmin = T.match_buffer(min_h, (w_rows(out_features), in_features // BLOCK), "float32")
        resid = T.match_buffer(resid_h, (n, out_columns(out_features)), out_dtype)
        y = T.match_buffer(y_h, (n, out_columns(out_features)), out_dtype)
        positions = T.match_buffer(positions_h, (n,), "int32")
        slots = T.match_buffer(slots_h, (n,), "int32")
        pages = T.match_buffer(pages_h, (num_pages, 2, kv_heads, PAGE_SIZE, D), dtype)
        q = T.match_buffer(q_h, (n, q_heads, D), dtype)
        best = T.match_buffer(best_h, (out_columns(out_features) // COLUMNS_PER_GROUP, 2), "float32")
        yq = T.match_buffer(yq_h, (n, out_columns(out_features) // 4), "uint32")  # quantizes_y: 4 words a chunk
        ystats = T.match_buffer(ystats_h, (n, out_columns(out_features) // 4), "float32")  # and 4 floats
        for rb in T.thread_binding(out_columns(out_features) // COLUMNS_PER_GROUP, thread="blockIdx.x"):
            for tb in T.thread_binding(T.ceildiv(n, TOKENS), thread="blockIdx.y"):
                for r in T.thread_binding(ROWS, thread="threadIdx.y"):
                    for lane in T.thread_binding(LANES, thread="threadIdx.x"):
                        with T.sblock("matmul"):
                            T.reads()
                            T.writes()
                            # the lanes' partial dots, (normed) the x^2 sums, (merges) the merged x at MERGED_AT
                            partial = T.sblock_alloc_buffer((MERGED_AT + in_features if merges else MERGED_AT,),
                                                            "float32", scope="shared")
                            # argmax_partials: each column's logit, then its index (f32, exact below 2^24)
                            column_best = T.sblock_alloc_buffer((2 * COLUMNS_PER_GROUP,), "float32", scope="shared")
                            acc = T.sblock_alloc_buffer((ROWS_PER_THREAD * TOKENS,), "float32", scope="local")
                            squares = T.sblock_alloc_buffer((TOKENS,), "float32", scope="local")
                            # this thread's rows' chunks (WORDS_PER_LOAD words), scales and mins at the current chunk
                            word = T.sblock_alloc_buffer((ROWS_PER_THREAD,), f"uint32x{WORDS_PER_LOAD}", scope="local")
                            ws = T.sblock_alloc_buffer((ROWS_PER_THREAD,), "float32", scope="local")
                            wm = T.sblock_alloc_buffer((ROWS_PER_THREAD,), "float32", scope="local")
                            xv4 = T.sblock_alloc_buffer((X_VECS,), "float32x4", scope="local")  # the chunk's x
                            xw = T.sblock_alloc_buffer((1,), "uint32x4", scope="local")  # int8_x: its codes
                            xst = T.sblock_alloc_buffer((1,), "float32x4", scope="local")  # and stats
                            nq = T.sblock_alloc_buffer((X_VECS,), "float32x4", scope="local")  # its norm weights
                            # total: 0 a row's dot, 1 sum of x^2, 2 the up row's dot (swiglu) or the
                            # RoPE partner row's (rope_append), 3 the rotated value
                            total = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            # split_head_dim: the merge's state (max, denominator; O)
                            stat = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            o_acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                            split_max = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                            split_sum = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                            split_o = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32x4", scope="local")
                            code = T.sblock_alloc_buffer((2,), "int32", scope="local")  # quantizes_y: word, sum
                            tok0: T.let[T.int32] = tb * TOKENS
                            for a in T.unroll(ROWS_PER_THREAD * TOKENS):
                                acc[a] = T.float32(0)
                            for j in T.unroll(TOKENS):
                                squares[j] = T.float32(0)
                            if merges:  # x from the split call's partial states, a chunk a thread
                                for trip in T.unroll(MERGE_TRIPS):
                                    chunk: T.let[T.int32] = trip * ROWS * LANES + r * LANES + lane
                                    if chunk < X_CHUNKS:
                                        merge_split_states(partial_o, partial_stats, tok0, chunk // M_CHUNKS,
                                                           chunk % M_CHUNKS, num_splits, stat, o_acc, split_max,
                                                           split_sum, split_o)
                                        denom: T.let[T.float32] = T.if_then_else(stat[1] > T.float32(0), stat[1],
                                                                                 T.float32(1))
                                        for e in T.unroll(4):  # rounded to dtype, as the merge writes it
                                            partial[MERGED_AT + chunk * 4 + e] = T.Cast("float32", T.Cast(
                                                dtype, T.Shuffle([o_acc[0]], [e]) / denom))
                            # TRIP_UNROLL trips unrolled, so that their loads are in flight together
                            for trips in T.serial((TRIPS + TRIP_UNROLL - 1) // TRIP_UNROLL):
                              for trip in T.unroll(TRIP_UNROLL):
                                wi: T.let[T.int32] = (trips * TRIP_UNROLL + trip) * LANES + lane  # the chunk
                                if wi < CHUNKS:
                                    blk: T.let[T.int32] = wi * CHUNK_VALUES // BLOCK
                                    for p in T.unroll(ROWS_PER_THREAD):
                                        word[p] = w[weight_row(rb, r, p, out_columns(out_features)), wi]
                                        ws[p] = scale[weight_row(rb, r, p, out_columns(out_features)), blk]
                                        wm[p] = T.if_then_else(weight_format == "q4", wmin[weight_row(rb, r, p, out_columns(out_features)), blk],
                                                               T.float32(0))
                                    if int8_x:  # one token (TOKENS == 1)
                                        if tok0 < n:
                                            xw[0] = xq[tok0, wi]
                                            xst[0] = xstats[tok0, wi]
                                            for p in T.unroll(ROWS_PER_THREAD):
                                                acc[p] = acc[p] + ws[p] * (T.Shuffle([xst[0]], [0]) * T.Cast(
                                                    "float32", int8_dot(word, p, xw))) + wm[p] * T.Shuffle([xst[0]], [1])
                                            if normed:
                                                if r == 0:
                                                    squares[0] = squares[0] + T.Shuffle([xst[0]], [2])
                                    for j in T.unroll(TOKENS):
                                        if not int8_x and tok0 + j < n:
                                            # the word's x (and norm weights) as 4-wide loads
                                            for v in T.unroll(X_VECS):
                                                if not merges:
                                                    xv4[v] = T.Cast("float32x4", x[tok0 + j, wi * X_VECS + v])
                                                nq[v] = norm[wi * X_VECS + v] if normed else T.Broadcast(T.float32(1), 4)
                                            for e in T.unroll(CHUNK_VALUES):
                                                # the norm's weight scales W's column: applied to x once for all rows
                                                xv: T.let[T.float32] = x_value(xv4, partial, wi, e)
                                                nk: T.let[T.float32] = T.Shuffle([nq[e // 4]], [e % 4])
                                                for p in T.unroll(ROWS_PER_THREAD):
                                                    acc[p * TOKENS + j] = acc[p * TOKENS + j] + \
                                                        weight_value(word_of(word, p, e // PER_WORD), e % PER_WORD, ws[p], wm[p]) * (xv * nk)
                                                if normed:
                                                    if r == 0:  # every row reads the same x: one row sums it
                                                        squares[j] = squares[j] + xv * xv
                            # each S lanes' sums meet in lane 0 of the S (in uniform control flow: every row
                            # shuffles its squares, zero but in row 0)
                            for k in T.unroll(SHUFFLE_STEPS):
                                for a in T.unroll(ROWS_PER_THREAD * TOKENS):
                                    acc[a] = acc[a] + T.webgpu.subgroup_shuffle_down(
                                        acc[a], T.uint32(SUBGROUP_LANES // 2) >> T.uint32(k))
                                if normed:
                                    for j in T.unroll(TOKENS):
                                        squares[j] = squares[j] + T.webgpu.subgroup_shuffle_down(
                                            squares[j], T.uint32(SUBGROUP_LANES // 2) >> T.uint32(k))
                            if lane % SUBGROUP_LANES == 0:
                                for p in T.unroll(ROWS_PER_THREAD):
                                    for j in T.unroll(TOKENS):
                                        partial[((p * ROWS + r) * TOKENS + j) * LANES + lane] = acc[p * TOKENS + j]
                                for j in T.unroll(TOKENS):
                                    if normed:
                                        if r == 0:
                                            partial[DOTS + j * LANES + lane] = squares[j]
                            if lane < TOKENS:
                                if tok0 + lane < n:
                                    for p in T.unroll(COLUMNS_PER_THREAD):
                                        total[0] = T.float32(0)
                                        total[1] = T.float32(0)
                                        total[2] = T.float32(0)
                                        for ls in T.serial(LANE_SUMS):
                                            l: T.let[T.int32] = ls * SUBGROUP_LANES  # a lane that holds a sum
                                            total[0] = total[0] + partial[((dot_row(p) * ROWS + r) * TOKENS + lane) * LANES + l]
                                            if normed:
                                                total[1] = total[1] + partial[DOTS + lane * LANES + l]
                                            if swiglu:
                                                total[2] = total[2] + partial[
                                                    (((dot_row(p) + 1) * ROWS + r) * TOKENS + lane) * LANES + l]
                                            if rotates:
                                                total[2] = total[2] + partial[
                                                    ((p * ROWS + T.bitwise_xor(r, 1)) * TOKENS + lane) * LANES + l]
                                        if normed:
                                            inv_rms: T.let[T.float32] = T.rsqrt(total[1] / T.float32(in_features) + eps)
                                            total[0] = total[0] * inv_rms
                                            total[2] = total[2] * inv_rms
                                        if swiglu:
                                            total[0] = total[0] / (T.float32(1) + T.exp(-total[0])) * total[2]
                                        column: T.let[T.int32] = rb * COLUMNS_PER_GROUP + p * ROWS + r
                                        if residual:
                                            total[0] = total[0] + T.Cast("float32", resid[tok0 + lane, column])
                                        if rotates:
                                            rope_epilogue(total, column, positions[tok0], slots[tok0], pages, q,
                                                          q_heads, kv_heads, rope_exponent, rope_inv_factor,
                                                          rope_ratio, rope_low, rope_span)
                                        else:
                                            y[tok0 + lane, column] = T.Cast(out_dtype, total[0])
                                        if spec.argmax_partials:
                                            column_best[p * ROWS + r] = total[0]
                                            column_best[COLUMNS_PER_GROUP + p * ROWS + r] = T.Cast("float32", column)
                                        if quantizes_y:  # y's chunk (column_best as its staging), rounded as written
                                            column_best[p * ROWS + r] = T.Cast("float32", T.Cast(out_dtype, total[0]))
                            if quantizes_y:
                                if r == 0:
                                    if lane < XQ_WORDS:
                                        if tok0 < n:
                                            # each of the chunk's 4 words in a thread of its own (kernels.quantize_x's
                                            # rule and order): total[0] the chunk's max |y|, total[1] 127 / max,
                                            # total[2] a value; code[0] this word's bytes, code[1] the codes' sum
                                            total[0] = T.float32(0)
                                            for c in T.serial(COLUMNS_PER_GROUP):
                                                total[2] = column_best[c]
                                                total[0] = T.max(total[0], T.abs(total[2]))
                                            total[1] = T.if_then_else(total[0] > T.float32(0),
                                                                      T.float32(CODE_MAX) / total[0], T.float32(0))
                                            code[0] = T.int32(0)
                                            code[1] = T.int32(0)
                                            for c in T.unroll(COLUMNS_PER_GROUP):
                                                total[2] = column_best[c]
                                                c_code: T.let[T.int32] = T.Cast("int32", T.floor(T.float32(0.5) + total[2] * total[1]))
                                                code[1] = code[1] + c_code
                                                if lane == code_position(c)[0]:  # value c is in this thread's word
                                                    code[0] = T.bitwise_or(code[0], T.shift_left(
                                                        T.bitwise_and(c_code, BYTE), 8 * code_position(c)[1]))
                                            yq[tok0, rb * XQ_WORDS + lane] = T.reinterpret("uint32", code[0])
                                            d: T.let[T.float32] = total[0] / T.float32(CODE_MAX)
                                            ystats[tok0, rb * XQ_WORDS + lane] = T.if_then_else(
                                                lane == 0, d, T.if_then_else(lane == 1, d * T.Cast("float32", code[1]),
                                                                             T.float32(0)))
                            if spec.argmax_partials:
                                if r == 0:
                                    if lane == 0:
                                        # columns in increasing order: '>' keeps the lowest index of a
                                        # tie; no number above the start (all NaN): index out_columns(out_features)
                                        total[0] = T.float32(-3.0e38)
                                        total[1] = T.Cast("float32", out_columns(out_features))
                                        for c in T.serial(COLUMNS_PER_GROUP):
                                            total[2] = column_best[c]  # (a shared read cannot sit in a condition)
                                            total[3] = column_best[COLUMNS_PER_GROUP + c]
                                            if total[2] > total[0]:
                                                total[0] = total[2]
                                                total[1] = total[3]
                                        best[rb, 0] = total[0]
                                        best[rb, 1] = total[1]

    return matmul

