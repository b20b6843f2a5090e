"""Paged decode attention for WebGPU: TVM's tiled nest and a sequence-sharded nest.

Both kernels take the same arguments (TVM's `batch_decode_paged_kv` signature), so the host can
swap one for the other per step:

    Q[B, H_qo, D], pages[num_pages, 2, H_kv, page_size, D] (0 = K, 1 = V),
    page_table_indptr[B + 1], page_table_values[nnz_pages] (physical page ids, any order),
    length_info[B] (last page length) or [3, B] with a sliding window (last page length,
    window offset, sink size), k_rope_pos_offset[B], q_rope_position[B],
    output[B, H_qo, D], lse[B, H_qo] (log2 domain); rotary_mode, rope_scale, rope_theta, sm_scale.

tiled (TVM's `_attention_decode`)
    threads across the head dimension; every q.k dot is a cross-thread reduction through workgroup
    memory, and one serial trip over the context handles bdy*bdz positions, with several barriers
    per trip. Good for short contexts, where its fixed cost is low.

sharded (`decode_attention_sharded`, written here)
    One workgroup per (sequence, query head), exactly 256 invocations:

        threadIdx.x = shard  in [0, NUM_SHARDS)        NUM_SHARDS = 256 / LANES_PER_SHARD
        threadIdx.y = lane   in [0, LANES_PER_SHARD)   LANES_PER_SHARD = head_dim / 64

    Position p of the context belongs to shard p % NUM_SHARDS (so neighbouring shards read
    neighbouring K/V rows). Q and pages are bound as 4-wide vectors (`float16x4`, same bytes as
    the scalar layout), so a lane reads its 64 dims of a K or V row in 16 loads of 8 bytes;
    q and O live in 16 float32x4 registers each (fully unrolled loops keep them out of memory).
    Scalar loads ran 2-4x slower on the H200. A lane keeps 64 dims of q (pre-scaled by sm_scale*log2 e) and of its
    running O in registers, and a running (max, denominator) per shard: an online softmax over the
    shard's positions. With several lanes a q.k dot is split; the lanes' partial dots meet in a
    workgroup array. Two arrays (ping, pong) alternate in a loop unrolled by two, so TVM's barrier
    pass puts exactly one barrier per position step (the write to one array can only race with a
    read of the same array two steps back, and a barrier separates them). head_dim 64 has one lane
    per shard and no barrier in the loop.

    The shard states merge in two phases:
      1. softmax statistics: every shard publishes its max; all threads take the global max M,
         rescale their O and denominator by exp2(m - M), and publish the denominator.
      2. O: in MERGE_ROUNDS rounds, MERGE_SHARDS shards at a time write their rescaled O rows to a
         staging array ([MERGE_SHARDS, D + 1] f32, padded against bank conflicts); each of the 256
         threads then adds up a fixed (dim, row slice) of the stage. A last pass adds the
         MERGE_SPLIT slices per dim and divides by the summed denominator.

    Workgroup storage (f32 words), the same bound for every head_dim:
        score_ping, score_pong   LANES_PER_SHARD * NUM_SHARDS each = 256   (only if lanes > 1)
        shard_max, shard_sum     NUM_SHARDS each                   <= 256
        o_stage                  MERGE_SHARDS * (D + 1)            = 2048 + MERGE_SHARDS
    i.e. at most 12.4 KiB, under WebGPU's default 16 KiB (the build refuses more).
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from model_glue.contract import MAX_INVOCATIONS as WORKGROUP_INVOCATIONS
from model_glue.contract import PAGE_SIZE

LANE_DIMS = 64  # q and O dims each lane keeps in registers
LOG2_E = math.log2(math.e)
MASKED_SCORE = -5e4  # TVM's initial max; exp2(-5e4 - m) underflows to 0 for any real score
_WEBGPU = tvm.target.Target("webgpu")


def decode_attention_tiled(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window, page_size=PAGE_SIZE):
    """TVM's own paged decode kernel (threads across head_dim, cross-thread q.k reductions).

    Wrong for some GQA groups: see `tiled_query_heads_computed`.
    """
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    return _attention_decode(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window, {}, _WEBGPU, page_size)


def tiled_query_heads_computed(spec, num_kv_heads: int) -> int:
    """Query heads per KV head that TVM's tiled kernel actually computes, read from its launch.

    It spreads a KV head's GROUP query heads over threadIdx.y (bdy) x blockIdx.y (gdz = GROUP // bdy,
    grid y = H_kv * gdz), halving bdy until bdx * bdy fits 256 invocations. When bdy stops at a
    value that does not divide GROUP, gdz * bdy < GROUP and the last heads of every group are never
    written (head_dim 256 with groups 5 and 7; head_dim 128 with 9, 11, ...). The build records
    this in the manifest so the host never runs the kernel for such a shape; the reproducer for
    TVM's maintainers is docs/tvm_tiled_gqa_repro.py.
    """
    bdy = spec.workgroup_size[1]
    grid_y = spec.grid[1]
    if not isinstance(grid_y, int):
        raise ValueError(f"tiled decode kernel with a symbolic grid y: {grid_y}")
    return bdy * (grid_y // num_kv_heads)


def check_sharded_shape(num_kv_heads: int, num_qo_heads: int, head_dim: int) -> None:
    """The sharded family keeps 64 dims per lane and 1-4 lanes per shard, and needs whole GQA groups."""
    if head_dim % LANE_DIMS or head_dim > 4 * LANE_DIMS:
        raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{num_qo_heads} query heads do not group over {num_kv_heads} KV heads")


def paged_row_helpers(head_dim: int, sliding_window: bool, page_size: int = PAGE_SIZE):
    """Expression builders and TVMScript macros the sharded nest and its split variants share (run
    while TVMScript parses). rope4 and partner_chunk serve the two macros that apply RoPE; the tuple
    returned is kv_len_of, seq_offset_of, lane_sum and the four macros:

    kv_len_of(indptr_begin, indptr_end, b, length_info)  rows a sequence attends to
    seq_offset_of(pos, b, length_info)                   row -> slot: the first `sink` rows are the
                                                         sink, the rest start at the window offset
    rope4(x4, partner4, pos, chunk, rope_scale, rope_theta)  4 dims rotated at `pos` (rotate-half)
    partner_chunk(chunk)                                 the chunk RoPE pairs with `chunk`
    lane_sum(v4)                                         the 4 lanes of a vector added
    add_key_dot(dot, q_local, pages, page, kv_head, slot, chunk0, k_pos, rotary_mode, rope_scale,
                rope_theta)                              a macro: dot[0] += this lane's q chunks times
                                                         the key row's (RoPE'd when rotary_mode is 1)
    load_query(q_local, o_local, Q, b, h, chunk0, q_pos, rotary_mode, rope_scale, rope_theta, sm_scale)
                                                         a macro: this lane's q chunks into registers,
                                                         pre-scaled to the log2 domain; O zeroed
    gather_partial_dots(acc, scores, lane, shard, row0, lanes_per_shard, num_shards)
                                                         a macro: a position's partial dots from the
                                                         lanes of one shard, summed through `scores`
                                                         (rows row0.. of the ping or pong array)
    online_softmax_step(state, o_local, acc, pages, page, kv_head, slot, chunk0)
                                                         a macro: fold one score and value row into
                                                         (max, denominator, O)
    """
    D, VEC = head_dim, 4
    LANE_CHUNKS = LANE_DIMS // VEC
    HALF_CHUNKS = D // 2 // VEC  # RoPE pairs dim d with d +- D/2 (TVM's rotate-half convention)

    def kv_len_of(indptr_begin, indptr_end, b, length_info):
        num_pages = indptr_end - indptr_begin
        if sliding_window:
            return (num_pages - 1) * page_size + length_info[0, b] - length_info[1, b] + length_info[2, b]
        return (num_pages - 1) * page_size + length_info[b]

    def seq_offset_of(pos, b, length_info):
        if sliding_window:
            return T.if_then_else(pos < length_info[2, b], pos, pos - length_info[2, b] + length_info[1, b])
        return pos

    def rope4(x4, partner4, pos, chunk, rope_scale, rope_theta):
        """partner4 holds dims d + D/2 (first half) or d - D/2 (second half); a chunk never straddles
        D/2, so the sign of the rotation is one scalar per chunk. Computed in f32x4."""
        first_half = chunk < HALF_CHUNKS
        freq_dim = T.Ramp(T.if_then_else(first_half, chunk, chunk - HALF_CHUNKS) * VEC, 1, VEC)
        inv_freq = T.exp2(T.Cast("float32x4", 2 * freq_dim) * (-T.log2(rope_theta) / T.float32(D)))
        angle = T.Broadcast(T.Cast("float32", pos) * rope_scale, VEC) * inv_freq
        sign = T.if_then_else(first_half, T.float32(-1), T.float32(1))
        return x4 * T.cos(angle) + T.Broadcast(sign, VEC) * partner4 * T.sin(angle)

    def partner_chunk(chunk):
        return T.if_then_else(chunk < HALF_CHUNKS, chunk + HALF_CHUNKS, chunk - HALF_CHUNKS)

    def lane_sum(v4):
        return T.Shuffle([v4], [0]) + T.Shuffle([v4], [1]) + T.Shuffle([v4], [2]) + T.Shuffle([v4], [3])

    @T.macro
    def add_key_dot(dot, q_local, pages, page, kv_head, slot, chunk0, k_pos, rotary_mode, rope_scale, rope_theta):
        for c in T.unroll(LANE_CHUNKS):
            dot[0] = dot[0] + q_local[c] * T.if_then_else(
                rotary_mode == 1,
                rope4(T.Cast("float32x4", pages[page, 0, kv_head, slot, chunk0 + c]),
                      T.Cast("float32x4", pages[page, 0, kv_head, slot, partner_chunk(chunk0 + c)]),
                      k_pos, chunk0 + c, rope_scale, rope_theta),
                T.Cast("float32x4", pages[page, 0, kv_head, slot, chunk0 + c]),
            )

    @T.macro
    def load_query(q_local, o_local, Q, b, h, chunk0, q_pos, rotary_mode, rope_scale, rope_theta, sm_scale):
        for c in T.unroll(LANE_CHUNKS):
            q_local[c] = T.if_then_else(
                rotary_mode == 1,
                rope4(T.Cast("float32x4", Q[b, h, chunk0 + c]),
                      T.Cast("float32x4", Q[b, h, partner_chunk(chunk0 + c)]),
                      q_pos, chunk0 + c, rope_scale, rope_theta),
                T.Cast("float32x4", Q[b, h, chunk0 + c]),
            ) * T.Broadcast(sm_scale * LOG2_E, VEC)
            o_local[c] = T.Broadcast(T.float32(0), VEC)

    @T.macro
    def gather_partial_dots(acc, scores, lane, shard, row0, lanes_per_shard, num_shards):
        scores[(row0 + lane) * num_shards + shard] = acc[0]
        acc[0] = T.float32(0)
        for l in T.unroll(lanes_per_shard):
            acc[0] = acc[0] + scores[(row0 + l) * num_shards + shard]

    @T.macro
    def online_softmax_step(state, o_local, acc, pages, page, kv_head, slot, chunk0):
        m_new: T.let[T.float32] = T.max(state[0], acc[0])
        rescale: T.let[T.float32] = T.exp2(state[0] - m_new)
        p: T.let[T.float32] = T.exp2(acc[0] - m_new)
        state[1] = state[1] * rescale + p
        state[0] = m_new
        for c in T.unroll(LANE_CHUNKS):
            o_local[c] = o_local[c] * T.Broadcast(rescale, VEC) + T.Broadcast(p, VEC) * T.Cast(
                "float32x4", pages[page, 1, kv_head, slot, chunk0 + c])

    return (kv_len_of, seq_offset_of, lane_sum, add_key_dot, load_query, gather_partial_dots,
            online_softmax_step)


def decode_attention_sharded(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window, page_size=PAGE_SIZE):
    """The sequence-sharded nest (layout in the module docstring); same signature as tiled."""
    check_sharded_shape(num_kv_heads, num_qo_heads, head_dim)
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    GROUP_SIZE = H_qo // H_kv
    LANES_PER_SHARD = D // LANE_DIMS
    NUM_SHARDS = WORKGROUP_INVOCATIONS // LANES_PER_SHARD
    # K, V and q are read as 4-wide vectors (one 8-byte f16 / 16-byte f32 load instead of four).
    VEC = 4
    VEC_DTYPE = f"{dtype}x{VEC}"
    LANE_CHUNKS = LANE_DIMS // VEC  # vectors of q and O a lane keeps in registers
    # Phase-2 merge: a stage of 2048 f32 (8 KiB) holds MERGE_SHARDS rows of D values.
    MERGE_SHARDS = 2048 // D
    MERGE_ROUNDS = NUM_SHARDS // MERGE_SHARDS
    STAGE_STRIDE = D + 1
    MERGE_SPLIT = WORKGROUP_INVOCATIONS // D  # threads that share one output dim
    ROWS_PER_SPLIT = MERGE_SHARDS // MERGE_SPLIT
    SPLIT_LANES = LANES_PER_SHARD > 1

    (kv_len_of, seq_offset_of, lane_sum, add_key_dot, load_query, gather_partial_dots,
     online_softmax_step) = paged_row_helpers(D, sliding_window, page_size)

    # fmt: off
    @T.prim_func(s_tir=True)
    def decode_sharded(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D // VEC), VEC_DTYPE)  # same bytes as [B, H_qo, D]
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, page_size, D // VEC), VEC_DTYPE)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32")
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32")
        length_info = T.match_buffer(var_length_info, (3, B) if sliding_window else (B,), "int32")
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32")
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32")
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")

        for b in T.thread_binding(B, thread="blockIdx.x"):
            for h in T.thread_binding(H_qo, thread="blockIdx.y"):
                for lane in T.thread_binding(LANES_PER_SHARD, thread="threadIdx.y"):
                    for shard in T.thread_binding(NUM_SHARDS, thread="threadIdx.x"):
                        with T.sblock("decode_sharded"):
                            T.reads()  # a scheduled kernel: skip region inference over let-bound indices
                            T.writes()
                            score_ping = T.sblock_alloc_buffer((LANES_PER_SHARD * NUM_SHARDS,), "float32", scope="shared")
                            score_pong = T.sblock_alloc_buffer((LANES_PER_SHARD * NUM_SHARDS,), "float32", scope="shared")
                            shard_max = T.sblock_alloc_buffer((NUM_SHARDS,), "float32", scope="shared")
                            shard_sum = T.sblock_alloc_buffer((NUM_SHARDS,), "float32", scope="shared")
                            o_stage = T.sblock_alloc_buffer((MERGE_SHARDS * STAGE_STRIDE,), "float32", scope="shared")
                            q_local = T.sblock_alloc_buffer((LANE_CHUNKS,), "float32x4", scope="local")
                            o_local = T.sblock_alloc_buffer((LANE_CHUNKS,), "float32x4", scope="local")
                            dot = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                            state = T.sblock_alloc_buffer((4,), "float32", scope="local")  # m, d, M, d_total
                            acc = T.sblock_alloc_buffer((1,), "float32", scope="local")

                            kv_head: T.let[T.int32] = h // GROUP_SIZE
                            dim0: T.let[T.int32] = lane * LANE_DIMS
                            chunk0: T.let[T.int32] = lane * LANE_CHUNKS
                            indptr_begin: T.let[T.int32] = page_table_indptr[b]
                            indptr_end: T.let[T.int32] = page_table_indptr[b + 1]
                            kv_len: T.let[T.int32] = T.if_then_else(
                                indptr_begin < indptr_end, kv_len_of(indptr_begin, indptr_end, b, length_info), 0)
                            q_pos: T.let[T.int32] = q_rope_position[b]

                            # q in registers, pre-scaled so scores land in the log2 domain.
                            load_query(q_local, o_local, Q, b, h, chunk0, q_pos, rotary_mode, rope_scale, rope_theta,
                                       sm_scale)
                            state[0] = T.float32(MASKED_SCORE)
                            state[1] = T.float32(0)

                            # Main loop: two position steps per trip (ping, then pong).
                            for trip in T.serial(T.ceildiv(kv_len, 2 * NUM_SHARDS)):
                                for half in T.unroll(2):
                                    pos: T.let[T.int32] = (trip * 2 + half) * NUM_SHARDS + shard
                                    in_context: T.let[T.bool] = pos < kv_len
                                    seq_offset: T.let[T.int32] = seq_offset_of(pos, b, length_info)
                                    page: T.let[T.int32] = T.if_then_else(
                                        in_context, page_table_values[indptr_begin + seq_offset // page_size], 0)
                                    slot: T.let[T.int32] = seq_offset % page_size
                                    k_pos: T.let[T.int32] = k_rope_pos_offset[b] + pos
                                    dot[0] = T.Broadcast(T.float32(0), VEC)
                                    if in_context:
                                        add_key_dot(dot, q_local, pages, page, kv_head, slot, chunk0, k_pos,
                                                    rotary_mode, rope_scale, rope_theta)
                                    acc[0] = lane_sum(dot[0])
                                    if SPLIT_LANES:
                                        # Partial dots meet in ping (even steps) or pong (odd steps).
                                        if half == 0:
                                            gather_partial_dots(acc, score_ping, lane, shard, 0, LANES_PER_SHARD, NUM_SHARDS)
                                        else:
                                            gather_partial_dots(acc, score_pong, lane, shard, 0, LANES_PER_SHARD, NUM_SHARDS)
                                    if in_context:  # online softmax over this shard's positions
                                        online_softmax_step(state, o_local, acc, pages, page, kv_head, slot, chunk0)

                            # Merge phase 1: global max, rescale, publish denominators.
                            if lane == 0:
                                shard_max[shard] = state[0]
                            state[2] = T.float32(MASKED_SCORE)
                            for s in T.serial(NUM_SHARDS):
                                state[2] = T.max(state[2], shard_max[s])
                            shard_scale: T.let[T.float32] = T.exp2(state[0] - state[2])
                            for c in T.unroll(LANE_CHUNKS):
                                o_local[c] = o_local[c] * T.Broadcast(shard_scale, VEC)
                            if lane == 0:
                                shard_sum[shard] = state[1] * shard_scale
                            state[3] = T.float32(0)
                            for s in T.serial(NUM_SHARDS):
                                state[3] = state[3] + shard_sum[s]

                            # Merge phase 2: sum O rows, MERGE_SHARDS shards per round.
                            tid: T.let[T.int32] = lane * NUM_SHARDS + shard
                            out_dim: T.let[T.int32] = tid % D
                            split: T.let[T.int32] = tid // D
                            acc[0] = T.float32(0)
                            for r in T.serial(MERGE_ROUNDS):
                                if shard // MERGE_SHARDS == r:
                                    for c in T.unroll(LANE_CHUNKS):
                                        for i in T.unroll(VEC):
                                            o_stage[(shard % MERGE_SHARDS) * STAGE_STRIDE + dim0 + c * VEC + i] = T.Shuffle([o_local[c]], [i])
                                for row in T.serial(ROWS_PER_SPLIT):
                                    acc[0] = acc[0] + o_stage[(split * ROWS_PER_SPLIT + row) * STAGE_STRIDE + out_dim]
                            # Add up the MERGE_SPLIT slices of each dim (reusing the stage).
                            o_stage[split * STAGE_STRIDE + out_dim] = acc[0]
                            if split == 0:
                                acc[0] = T.float32(0)
                                for s in T.serial(MERGE_SPLIT):
                                    acc[0] = acc[0] + o_stage[s * STAGE_STRIDE + out_dim]
                                # An empty context gives output 0 and lse -5e4, as tiled does.
                                denom: T.let[T.float32] = T.if_then_else(state[3] > T.float32(0), state[3], T.float32(1))
                                output[b, h, out_dim] = T.Cast(dtype, acc[0] / denom)
                                if out_dim == 0:
                                    lse[b, h] = state[2] + T.log2(denom)
    # fmt: on
    return decode_sharded
