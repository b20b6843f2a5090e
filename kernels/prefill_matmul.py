"""The prefill pass's matmul: a tile of tokens x a tile of weight rows per workgroup.

y[n, out] = x[n, in] @ W^T (+ resid), W q4 or q8a (contract.model, kernels.llama_common), with the same
folds as the decode matmul (kernels.decode_matmul.quantized_matmul): the RMSNorm before it (`norm_eps`) and
the gated FFN's activation after it (`glu`). The decode step keeps the one-token kernel; this one serves chunks
of many tokens, where each weight should be read once per TOKENS tokens, not once per 8.

    grid (OUT_COLUMNS / COLUMNS_PER_TILE, ceil(n / TOKENS)), TOKENS = MatmulSpec.token_tile (128, or 32
    for a short pass: a chat turn's few tokens should not pay for 128 token rows)
    tid in [0, 2 TOKENS): token quad tq = tid // 8 (tokens 4 tq .. 4 tq + 3 of the tile),
                     row quad pair rq = tid % 8 (tile rows 4 rq .. and 32 + 4 rq ..)

Per K_STEP columns of `in`, the workgroup stages x's TOKENS x K_STEP values and W's ROWS x K_STEP
dequantized weights in workgroup memory, both as f32x4 along the dimension a thread reads four of
(x_tile[k][token quad], w_tile[k][row quad]); a thread then does 8 vector FMAs (4 tokens x 8 rows)
per 3 vector loads. A thread's rows are 4 rq .. 4 rq + 3 and 32 + 4 rq .. so that with `glu`
(tile rows 0-31 are gate rows, 32-63 the up rows of the same 32 columns) each thread holds both
halves of its outputs. Weights are dequantized (and scaled by the norm's weight) once per tile.

With `norm_eps`: norm(x) @ W^T = inv_rms(x) * (x @ (W * norm)^T), and every thread sums x^2 of its
4 tokens from the x tile it reads anyway (one more vector FMA per 8), so the normalized x is never
stored. Accumulation is f32; x, y and resid are `dtype`.

Workgroup storage: x tile TOKENS * K_STEP f32 (8 KiB; 2 KiB for 32 tokens), W tile ROWS * K_STEP f32 (4 KiB).
"""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import PREFILL_TILE_ROWS, MatmulSpec
from contract.model import Q8A_BLOCK, q8a_code_position
from kernels.llama_common import BLOCK, gated, sign_extend_byte
from kernels.paged_kv import VEC

ROWS = 64  # weight rows per tile
K_STEP = 16  # columns of `in` staged per step (half a q4 block: two q4 words a row; one q8a block)
ROW_QUADS = ROWS // VEC  # 16
HALF_QUADS = ROW_QUADS // 2  # a thread's second row quad is HALF_QUADS further on
WEIGHTS_PER_TASK = 8  # weights of one row a W task dequantizes: a q4 word, two q8a words
TASKS_PER_STEP = K_STEP // WEIGHTS_PER_TASK  # W tasks of one row per step
W_TASKS = ROW_QUADS * TASKS_PER_STEP  # (row quad, eighth of the step) loads of the W tile


def quantized_matmul_tiled(spec: MatmulSpec):
    """The tiled matmul PrimFunc of `spec` (see the module docstring). `n` (tokens), `out_features`
    (W's rows, a multiple of ROWS) and `eps` are runtime values (contract.kernels.MatmulSpec.values)."""
    assert spec.tiled and spec.weights in ("q4", "q8a") and spec.out_dtype in (None, spec.dtype)
    assert ROWS == PREFILL_TILE_ROWS
    in_features, dtype = spec.in_features, spec.dtype
    TOKENS = spec.token_tile  # 128 (256 threads), or 32 for short passes (64 threads)
    TOKEN_QUADS = TOKENS // VEC
    THREADS = TOKEN_QUADS * HALF_QUADS
    X_TASKS = TOKEN_QUADS * (K_STEP // VEC)  # (token quad, k quad) loads of the x tile
    residual, normed, has_gate = spec.residual, spec.norm_eps is not None, spec.glu is not None
    COLUMNS_PER_TILE = ROWS // 2 if has_gate else ROWS
    STEPS = in_features // K_STEP
    q8a = spec.weights == "q8a"
    PER_WORD = 4 if q8a else 8  # weights a packed word
    WORDS = in_features // PER_WORD
    TASK_WORDS = WEIGHTS_PER_TASK // PER_WORD
    W_BLOCK = Q8A_BLOCK if q8a else BLOCK  # weights a scale and min
    VEC_DTYPE = f"{dtype}x{VEC}"
    assert in_features % BLOCK == 0 and X_TASKS + W_TASKS <= THREADS

    def out_columns(out_features):  # y's width
        return out_features // 2 if has_gate else out_features

    def weight_row(tile, local_row, OUT_COLUMNS):
        """The W row of a tile row: with a gate (glu), rows 0-31 are gate rows and 32-63 the up rows."""
        if has_gate:
            return T.if_then_else(local_row < COLUMNS_PER_TILE, tile * COLUMNS_PER_TILE + local_row,
                                  OUT_COLUMNS + tile * COLUMNS_PER_TILE + local_row - COLUMNS_PER_TILE)
        return tile * ROWS + local_row

    def code(words, i, j):
        """Row i's code of weight j of the task's eight: a q4 nibble, or a q8a byte (its block's
        bytes in contract.model.q8a_code_position's order; the task is half a block)."""
        if not q8a:
            return T.Cast("float32", T.bitwise_and(T.shift_right(words[i], T.uint32(4 * j)), T.uint32(15)))
        u, b = q8a_code_position(j)  # the task's words are the block's 2 task .. 2 task + 1
        return T.Cast("float32", sign_extend_byte(words[u * VEC + i], b))

    @T.prim_func(s_tir=True)
    def matmul(x_h: T.handle, norm_h: T.handle, w_h: T.handle, scale_h: T.handle, min_h: T.handle,
               resid_h: T.handle, y_h: T.handle, eps: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out_features = T.int32()
        x = T.match_buffer(x_h, (n, in_features // VEC), VEC_DTYPE)  # same bytes as [n, in]
        norm = T.match_buffer(norm_h, (in_features,), "float32")
        w = T.match_buffer(w_h, (out_features, WORDS), "uint32")
        scale = T.match_buffer(scale_h, (out_features, in_features // W_BLOCK), "float32")
        wmin = T.match_buffer(min_h, (out_features, in_features // W_BLOCK), "float32")
        resid = T.match_buffer(resid_h, (n, out_columns(out_features) // VEC), VEC_DTYPE)
        y = T.match_buffer(y_h, (n, out_columns(out_features) // VEC), VEC_DTYPE)
        for tile in T.thread_binding(out_columns(out_features) // COLUMNS_PER_TILE, thread="blockIdx.x"):
            for token_tile in T.thread_binding(T.ceildiv(n, TOKENS), thread="blockIdx.y"):
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("matmul_tiled"):
                        T.reads()
                        T.writes()
                        x_tile = T.sblock_alloc_buffer((K_STEP * TOKEN_QUADS,), "float32x4", scope="shared")
                        w_tile = T.sblock_alloc_buffer((K_STEP * ROW_QUADS,), "float32x4", scope="shared")
                        acc = T.sblock_alloc_buffer((VEC * 2,), "float32x4", scope="local")  # [token][row quad]
                        squares = T.sblock_alloc_buffer((1,), "float32x4", scope="local")  # x^2 of 4 tokens
                        loaded = T.sblock_alloc_buffer((VEC,), "float32x4", scope="local")  # 4 rows of x or W
                        result = T.sblock_alloc_buffer((2,), "float32x4", scope="local")
                        words = T.sblock_alloc_buffer((TASK_WORDS * VEC,), "uint32", scope="local")
                        scale_min = T.sblock_alloc_buffer((2 * VEC,), "float32", scope="local")

                        tq: T.let[T.int32] = tid // HALF_QUADS
                        rq: T.let[T.int32] = tid % HALF_QUADS
                        tok0: T.let[T.int32] = token_tile * TOKENS
                        for a in T.unroll(VEC * 2):
                            acc[a] = T.Broadcast(T.float32(0), VEC)
                        squares[0] = T.Broadcast(T.float32(0), VEC)

                        for step in T.serial(STEPS):
                            k0: T.let[T.int32] = step * K_STEP
                            if tid < X_TASKS:
                                # 4 tokens' x[k0 + 4 kq .. + 3], transposed into 4 vectors of one k each
                                # (tokens past n read the last token; their outputs are never written)
                                lq: T.let[T.int32] = tid // (K_STEP // VEC)
                                kq: T.let[T.int32] = tid % (K_STEP // VEC)
                                for i in T.unroll(VEC):
                                    loaded[i] = T.Cast("float32x4", x[T.min(tok0 + lq * VEC + i, n - 1), k0 // VEC + kq])
                                for kk in T.unroll(VEC):
                                    x_tile[(kq * VEC + kk) * TOKEN_QUADS + lq] = T.Shuffle(
                                        [loaded[0], loaded[1], loaded[2], loaded[3]], [kk, VEC + kk, 2 * VEC + kk, 3 * VEC + kk])
                            elif tid < X_TASKS + W_TASKS:
                                # 8 weights (a q4 word, two q8a words) of each of 4 rows, dequantized into 8 vectors
                                wq: T.let[T.int32] = (tid - X_TASKS) // TASKS_PER_STEP
                                task: T.let[T.int32] = (tid - X_TASKS) % TASKS_PER_STEP
                                word_index: T.let[T.int32] = (k0 + task * WEIGHTS_PER_TASK) // PER_WORD
                                for i in T.unroll(VEC):
                                    row: T.let[T.int32] = weight_row(tile, wq * VEC + i, out_columns(out_features))
                                    for u in T.unroll(TASK_WORDS):
                                        words[u * VEC + i] = w[row, word_index + u]
                                    scale_min[i] = scale[row, k0 // W_BLOCK]
                                    scale_min[VEC + i] = wmin[row, k0 // W_BLOCK]
                                for j in T.unroll(WEIGHTS_PER_TASK):
                                    for i in T.unroll(VEC):
                                        loaded[i] = T.Broadcast(code(words, i, j) * scale_min[i] + scale_min[VEC + i], VEC)
                                    w_tile[(task * WEIGHTS_PER_TASK + j) * ROW_QUADS + wq] = T.Shuffle(
                                        [loaded[0], loaded[1], loaded[2], loaded[3]], [0, VEC, 2 * VEC, 3 * VEC]) * T.Broadcast(
                                            norm[k0 + task * WEIGHTS_PER_TASK + j] if normed else T.float32(1), VEC)
                            # token quads wholly past n skip the arithmetic (a short prompt's last tile; on a
                            # CPU rasterizer, whose SIMD lanes are 8 neighbouring threads of one quad, that is time)
                            if tok0 + tq * VEC < n:
                                for k in T.unroll(K_STEP):
                                    xv: T.let[T.float32x4] = x_tile[k * TOKEN_QUADS + tq]
                                    for i in T.unroll(VEC):
                                        acc[i * 2] = acc[i * 2] + T.Broadcast(T.Shuffle([xv], [i]), VEC) * w_tile[
                                            k * ROW_QUADS + rq]
                                        acc[i * 2 + 1] = acc[i * 2 + 1] + T.Broadcast(T.Shuffle([xv], [i]), VEC) * w_tile[
                                            k * ROW_QUADS + HALF_QUADS + rq]
                                    if normed:
                                        squares[0] = squares[0] + xv * xv

                        for i in T.unroll(VEC):
                            token: T.let[T.int32] = tok0 + tq * VEC + i
                            if token < n:
                                inv_rms: T.let[T.float32] = T.rsqrt(T.Shuffle([squares[0]], [i]) / T.float32(in_features)
                                                                    + eps) if normed else T.float32(1)
                                result[0] = acc[i * 2] * T.Broadcast(inv_rms, VEC)
                                result[1] = acc[i * 2 + 1] * T.Broadcast(inv_rms, VEC)
                                if has_gate:  # gate columns in result[0], their up rows in result[1]
                                    y[token, tile * (COLUMNS_PER_TILE // VEC) + rq] = T.Cast(
                                        VEC_DTYPE, gated(result[0], result[1], spec.glu, VEC))
                                else:
                                    for h in T.unroll(2):
                                        quad: T.let[T.int32] = tile * ROW_QUADS + h * HALF_QUADS + rq
                                        if residual:
                                            result[h] = result[h] + T.Cast("float32x4", resid[token, quad])
                                        y[token, quad] = T.Cast(VEC_DTYPE, result[h])

    return matmul
