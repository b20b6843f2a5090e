"""TIR kernels for a Llama-shaped model with 4-bit weights (every kernel but attention).

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

from contract.kernels import MATMUL_ROWS, PAGE_SIZE, MatmulSpec
from kernels.decode_attention_merge import MERGE_UNROLL, merge_split_states
from kernels.quantize_x import BYTE, CHUNK as XQ_CHUNK, CODE_MAX, WORDS_PER_CHUNK as XQ_WORDS, code_position

THREADS = 256
BLOCK = 32  # quantization block: one scale (and min) per 32 weights
# The decode matmul's loads (fitted on the H200, docs/benchmarks.md): a lane reads two neighbouring
# packed words of a row at once (8 bytes: a warp's load spans 256 contiguous bytes) and has four
# such loads a row in flight (its trip loop unrolled by 4).
WORDS_PER_LOAD = 2
TRIP_UNROLL = 4
LOW_NIBBLES = 0x0F0F0F0F  # int8_x: a q4 word's even elements, one a byte (the odd ones after a shift by 4)


def _sign_extend_byte(word, k):
    """Byte k of a u32 as a signed int32 (shift it to the top, then arithmetic-shift down)."""
    return T.shift_right(T.shift_left(T.reinterpret("int32", word), 24 - 8 * k), 24)


def embedding_q8(dim: int, dtype: str):
    """out[i, :] = dequantized row ids[i] of the Q8 embedding. One workgroup per token; the
    vocabulary is a runtime size."""
    WORDS = dim // 4
    WORD_TRIPS = (WORDS + THREADS - 1) // THREADS

    @T.prim_func(s_tir=True)
    def embedding(ids_h: T.handle, q8_h: T.handle, scale_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        vocab = T.int32()
        ids = T.match_buffer(ids_h, (n,), "int32")
        q8 = T.match_buffer(q8_h, (vocab, WORDS), "uint32")
        scale = T.match_buffer(scale_h, (vocab, dim // BLOCK), "float32")
        out = T.match_buffer(out_h, (n, dim), dtype)
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("embedding"):
                    T.reads()
                    T.writes()
                    row: T.let[T.int32] = ids[i]
                    for trip in T.serial(WORD_TRIPS):
                        w: T.let[T.int32] = trip * THREADS + t
                        if w < WORDS:
                            word: T.let[T.uint32] = q8[row, w]
                            s: T.let[T.float32] = scale[row, w * 4 // BLOCK]
                            for k in T.unroll(4):
                                out[i, w * 4 + k] = T.Cast(dtype, T.Cast("float32", _sign_extend_byte(word, k)) * s)

    return embedding


def rms_norm(dim: int, dtype: str):
    """out = x / sqrt(mean(x^2) + eps) * weight, one workgroup per row (CPU rasterizers only: GPUs
    fold the norm into the matmul that consumes it)."""
    TRIPS = (dim + THREADS - 1) // THREADS
    LEVELS = THREADS.bit_length() - 1

    @T.prim_func(s_tir=True)
    def rms_norm_kernel(x_h: T.handle, weight_h: T.handle, out_h: T.handle, eps: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        x = T.match_buffer(x_h, (n, dim), dtype)
        weight = T.match_buffer(weight_h, (dim,), "float32")
        out = T.match_buffer(out_h, (n, dim), dtype)
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("rms_norm"):
                    T.reads()
                    T.writes()
                    partial = T.sblock_alloc_buffer((THREADS,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for trip in T.unroll(TRIPS):
                        if trip * THREADS + t < dim:
                            v: T.let[T.float32] = T.Cast("float32", x[i, trip * THREADS + t])
                            acc[0] = acc[0] + v * v
                    partial[t] = acc[0]
                    for level in T.unroll(LEVELS):
                        half: T.let[T.int32] = T.shift_right(THREADS // 2, level)
                        if t < half:
                            partial[t] = partial[t] + partial[t + half]
                    inv_rms: T.let[T.float32] = T.rsqrt(partial[0] / T.float32(dim) + eps)
                    for trip in T.unroll(TRIPS):
                        if trip * THREADS + t < dim:
                            out[i, trip * THREADS + t] = T.Cast(
                                dtype, T.Cast("float32", x[i, trip * THREADS + t]) * inv_rms * weight[trip * THREADS + t])

    return rms_norm_kernel


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
        return T.Cast("float32", _sign_extend_byte(word, k)) * s

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


def rope_inv_freq(pair, exponent, scaling=None):
    """The rotation frequency of adjacent pair `pair` of a head, f32, from the runtime values of
    contract.kernels.rope_values: theta^(-2 pair / D) = exp2(2 pair * exponent), then (`scaling`: the
    values inv_factor, ratio, low, span) Llama 3's scaling, (1 - s) * inv_factor + s times it,
    s = clamp((ratio * inv_freq - low) / span, 0, 1) with ratio = original context / (2 pi) and
    span = high - low (contract.model.rope_frequency_divisors)."""
    inv_freq = T.exp2(T.Cast("float32", 2 * pair) * exponent)
    if scaling is None:
        return inv_freq
    inv_factor, ratio, low, span = scaling
    smooth = T.min(T.max((inv_freq * ratio - low) / span, T.float32(0)), T.float32(1))
    return inv_freq * ((T.float32(1) - smooth) * inv_factor + smooth)


def rope_and_append(head_dim: int, dtype: str, scaled: bool, page_size: int = PAGE_SIZE):
    """Adjacent-pair RoPE on q and k of a fused qkv row, then K and V written into their page slot.
    The head counts and RoPE's base and scaling are runtime values (contract.kernels.rope_values);
    whether there is a scaling is compiled in (`scaled`).

    qkv[n, (H + 2 H_kv) * D] -> q[n, H, D] (rotated), pages[slot // 16, 0|1, kv_head, slot % 16, :].
    GGUFs permute their Q/K weights for adjacent pairs (x[2i], x[2i+1]). With Llama 3's
    `rope_scaling` (factor, low, high, original context) a pair's frequency is scaled by
    (1 - s) / factor + s, s = clamp((original / wavelength - low) / (high - low), 0, 1)
    (contract.model.rope_frequency_divisors).
    """
    D = head_dim

    @T.prim_func(s_tir=True)
    def rope_append(qkv_h: T.handle, positions_h: T.handle, slots_h: T.handle, pages_h: T.handle, q_h: T.handle,
                    rope_exponent: T.float32, rope_inv_factor: T.float32, rope_ratio: T.float32,
                    rope_low: T.float32, rope_span: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        num_pages = T.int32()
        q_heads = T.int32()
        kv_heads = T.int32()
        pages = T.match_buffer(pages_h, (num_pages, 2, kv_heads, page_size, D), dtype)
        q = T.match_buffer(q_h, (n, q_heads, D), dtype)
        qkv = T.match_buffer(qkv_h, (n, (q_heads + 2 * kv_heads) * D), dtype)
        positions = T.match_buffer(positions_h, (n,), "int32")
        slots = T.match_buffer(slots_h, (n,), "int32")
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("rope_append"):
                    T.reads()
                    T.writes()
                    page: T.let[T.int32] = slots[i] // page_size
                    slot: T.let[T.int32] = slots[i] % page_size
                    for trip in T.serial(T.ceildiv((q_heads + kv_heads) * (D // 2), THREADS)):
                        p: T.let[T.int32] = trip * THREADS + t
                        if p < (q_heads + kv_heads) * (D // 2):  # rotated pairs: q heads, then k heads
                            head: T.let[T.int32] = p // (D // 2)
                            pair: T.let[T.int32] = p % (D // 2)
                            x0: T.let[T.float32] = T.Cast("float32", qkv[i, head * D + 2 * pair])
                            x1: T.let[T.float32] = T.Cast("float32", qkv[i, head * D + 2 * pair + 1])
                            inv_freq: T.let[T.float32] = rope_inv_freq(
                                pair, rope_exponent, (rope_inv_factor, rope_ratio, rope_low, rope_span) if scaled else None)
                            angle: T.let[T.float32] = T.Cast("float32", positions[i]) * inv_freq
                            c: T.let[T.float32] = T.cos(angle)
                            sn: T.let[T.float32] = T.sin(angle)
                            if head < q_heads:
                                q[i, head, 2 * pair] = T.Cast(dtype, x0 * c - x1 * sn)
                                q[i, head, 2 * pair + 1] = T.Cast(dtype, x0 * sn + x1 * c)
                            else:
                                pages[page, 0, head - q_heads, slot, 2 * pair] = T.Cast(dtype, x0 * c - x1 * sn)
                                pages[page, 0, head - q_heads, slot, 2 * pair + 1] = T.Cast(dtype, x0 * sn + x1 * c)
                    for trip in T.serial(T.ceildiv(kv_heads * D, THREADS)):
                        e: T.let[T.int32] = trip * THREADS + t
                        if e < kv_heads * D:
                            pages[page, 1, e // D, slot, e % D] = qkv[i, (q_heads + kv_heads) * D + e]

    return rope_append


def swiglu(dtype: str):
    """h[n, j] = silu(gate_up[n, j]) * gate_up[n, ffn + j] (CPU rasterizers only: GPUs fold it into
    the gate/up matmul's epilogue); the FFN width is a runtime size."""

    @T.prim_func(s_tir=True)
    def swiglu_kernel(gate_up_h: T.handle, h_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        ffn_dim = T.int32()
        h = T.match_buffer(h_h, (n, ffn_dim), dtype)
        gate_up = T.match_buffer(gate_up_h, (n, 2 * ffn_dim), dtype)
        for jb in T.thread_binding(T.ceildiv(ffn_dim, THREADS), thread="blockIdx.x"):
            for i in T.thread_binding(n, thread="blockIdx.y"):
                for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("swiglu"):
                        T.reads()
                        T.writes()
                        j: T.let[T.int32] = jb * THREADS + t
                        if j < ffn_dim:
                            g: T.let[T.float32] = T.Cast("float32", gate_up[i, j])
                            h[i, j] = T.Cast(dtype, g / (T.float32(1) + T.exp(-g)) * T.Cast("float32", gate_up[i, ffn_dim + j]))

    return swiglu_kernel


def _best_pair_tree():
    """A TVMScript macro: the workgroup's (value, index) pairs, values in best[0:THREADS] and
    indices in best[THREADS:], reduce into best[0], best[THREADS]: the largest value, the lowest
    index on ties. val[o:o + 4] is the thread's scratch."""
    levels = THREADS.bit_length() - 1

    @T.macro
    def best_pair_tree(best, val, t, o):
        for level in T.unroll(levels):
            half: T.let[T.int32] = T.shift_right(THREADS // 2, level)
            # Every thread reads (unconditionally: TVM places barriers outside conditions), then
            # the lower half keeps the better pair.
            partner: T.let[T.int32] = T.min(t + half, THREADS - 1)
            val[o] = best[partner]
            val[o + 1] = best[THREADS + partner]
            val[o + 2] = best[t]
            val[o + 3] = best[THREADS + t]
            if t < half:
                if (val[o] > val[o + 2]) | ((val[o] == val[o + 2]) & (val[o + 1] < val[o + 3])):
                    best[t] = val[o]
                    best[THREADS + t] = val[o + 1]

    return best_pair_tree


def argmax_partials():
    """out[0] = the index of the largest logit, from the head's `groups` workgroup bests
    (quantized_matmul with argmax_partials: best[g] = (value, index), the lowest index of a tie
    within the group). Groups in column order, so '>' and the tree's tie rule keep numpy's argmax:
    the lowest index of the largest value. Reading the pairs (one per 8-32 logits), not every
    logit, is what makes this dispatch short. Logits with no number above -3e38 (an f16
    overflow's NaNs) give `vocab`, past every real id (the text shows it as "<id N>"). Both sizes
    are runtime values."""
    best_pair_tree = _best_pair_tree()

    @T.prim_func(s_tir=True)
    def argmax_kernel(best_h: T.handle, out_h: T.handle, vocab: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        groups = T.int32()
        best = T.match_buffer(best_h, (groups, 2), "float32")
        out = T.match_buffer(out_h, (1,), "int32")
        for g in T.thread_binding(1, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("argmax"):
                    T.reads()
                    T.writes()
                    # (value, index) pairs; indices kept as f32 (exact below 2^24) so one shared
                    # array holds both (TVM's storage planner rejected mixed-type shared arrays here).
                    pairs = T.sblock_alloc_buffer((2 * THREADS,), "float32", scope="shared")
                    val = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    val[0] = T.float32(-3.0e38)
                    val[1] = T.Cast("float32", vocab)
                    for trip in T.serial(T.ceildiv(groups, THREADS)):
                        k: T.let[T.int32] = trip * THREADS + t  # increasing, so '>' keeps the first max
                        if k < groups:
                            if best[k, 0] > val[0]:
                                val[0] = best[k, 0]
                                val[1] = best[k, 1]
                    pairs[t] = val[0]
                    pairs[THREADS + t] = val[1]
                    best_pair_tree(pairs, val, t, 0)
                    if t == 0:
                        out[0] = T.Cast("int32", pairs[THREADS])

    return argmax_kernel


def sample_top_k_top_p(max_top_k: int):
    """out[0] = a token drawn from the logits, filtered by top-k then top-p, at a temperature.

    One workgroup. Round r finds the r-th largest logit as the largest (value, index) pair that
    ranks below round r-1's in the order value descending, index ascending; top_k rounds give
    the candidates already sorted. Thread 0 then weights them exp((v - v_max) / temperature),
    keeps the shortest prefix whose mass reaches top_p of the total (at least one), and picks
    the first candidate whose running mass exceeds `draw` (uniform in [0, 1)) times the kept mass.
    Only the id leaves the GPU; the host makes `draw` with its seeded generator.
    Requires 1 <= top_k <= max_top_k and temperature > 0 (greedy decoding is `argmax`). The
    vocabulary is a runtime size.
    """
    best_pair_tree = _best_pair_tree()
    LOWEST = -3.0e38

    @T.prim_func(s_tir=True)
    def sample_kernel(logits_h: T.handle, out_h: T.handle, top_k: T.int32, temperature: T.float32,
                      top_p: T.float32, draw: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        vocab = T.int32()
        logits = T.match_buffer(logits_h, (1, vocab), "float32")
        out = T.match_buffer(out_h, (1,), "int32")
        for g in T.thread_binding(1, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("sample"):
                    T.reads()
                    T.writes()
                    # (value, index) pairs in one f32 array (indices exact below 2^24), as in argmax.
                    best = T.sblock_alloc_buffer((2 * THREADS,), "float32", scope="shared")
                    chosen = T.sblock_alloc_buffer((2 * max_top_k,), "float32", scope="shared")
                    # val: 0-1 this thread's best eligible pair, 2-3 the previous round's pick,
                    # 4-7 a reduction's two pairs; acc: thread 0's sums.
                    val = T.sblock_alloc_buffer((8,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    pick = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    val[2] = T.float32(3.0e38)
                    val[3] = T.float32(-1)
                    for r in T.serial(top_k):
                        val[0] = T.float32(LOWEST)
                        val[1] = T.Cast("float32", vocab)  # no index: ranks after every real one
                        for trip in T.serial(T.ceildiv(vocab, THREADS)):
                            k: T.let[T.int32] = trip * THREADS + t  # increasing: '>' keeps the first
                            if k < vocab:
                                v: T.let[T.float32] = logits[0, k]
                                kf: T.let[T.float32] = T.Cast("float32", k)
                                if (v < val[2]) | ((v == val[2]) & (kf > val[3])):
                                    if v > val[0]:
                                        val[0] = v
                                        val[1] = kf
                        best[t] = val[0]
                        best[THREADS + t] = val[1]
                        best_pair_tree(best, val, t, 4)
                        if t == 0:
                            chosen[r] = best[0]
                            chosen[max_top_k + r] = best[THREADS]
                        val[2] = best[0]  # every thread reads the pick before the next round's writes
                        val[3] = best[THREADS]
                    if t == 0:
                        # acc: 0 total mass, 1 kept mass, 2 running mass; pick: kept count, then the draw
                        acc[0] = T.float32(0)
                        for j in T.serial(top_k):
                            acc[0] = acc[0] + T.exp((chosen[j] - chosen[0]) / temperature)
                        acc[1] = T.float32(0)
                        pick[0] = 0
                        for j in T.serial(top_k):
                            if (pick[0] == 0) | (acc[1] < top_p * acc[0]):
                                acc[1] = acc[1] + T.exp((chosen[j] - chosen[0]) / temperature)
                                pick[0] = j + 1
                        acc[2] = T.float32(0)
                        acc[3] = draw * acc[1]
                        out[0] = T.Cast("int32", chosen[max_top_k + pick[0] - 1])  # rounding: the last kept
                        for j in T.serial(top_k):
                            if j < pick[0]:
                                acc[2] = acc[2] + T.exp((chosen[j] - chosen[0]) / temperature)
                                if acc[2] > acc[3]:
                                    out[0] = T.Cast("int32", chosen[max_top_k + j])
                                    pick[0] = 0  # stop: later candidates fail j < 0

    return sample_kernel
