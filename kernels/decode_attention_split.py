"""Split-context (FlashDecoding-style) paged decode attention for WebGPU: partial + merge.

The sharded nest (kernels.decode_attention) launches one workgroup per (sequence, query head):
B x H_qo workgroups, 32 for Llama-3.1-8B at batch 1, on a GPU with 132 SMs. Here the context of a
sequence is also split across workgroups, and a second, small kernel merges the partial results:

    decode_attention_split_partial   grid (H_qo / HEADS, B * num_splits)
        workgroup (hx, b * num_splits + split) attends query heads hx*HEADS .. hx*HEADS+HEADS-1 of
        sequence b over the rows [split * CHUNK, (split + 1) * CHUNK) of its context, where
        CHUNK = ceil(ceil(kv_len / page_size) / num_splits) * page_size: whole pages per split
        (the last split may hold fewer rows; a split past the end holds none and writes the neutral
        state max = -5e4, denominator = 0, O = 0). It writes the split's softmax state to
        partial_o[b, h, split, :] (O scaled to the split's max, not yet divided) and
        partial_stats[b, h, split, :] = (max, denominator), in the log2 domain.
    decode_attention_split_merge     grid (H_qo / MERGE_HEADS, B)
        output[b, h] = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) d_s  with M = max_s m_s, and
        lse[b, h] = M + log2(denominator): the same contract as the tiled and sharded kernels
        (an empty context gives output 0 and lse -5e4).

`num_splits` (S) is a runtime scalar, chosen by the host per step (model_glue.attention.pick_sharded_variant); the grid
and the workspace strides follow it. The workspace is dense for the S of the call:

    partial_o      float32 [B, H_qo, num_splits, D]   B * H_qo * S * D * 4 bytes  (bound as f32x4)
    partial_stats  float32 [B, H_qo, num_splits, 2]   B * H_qo * S * 2 * 4 bytes

so one allocation sized for (B_max, S_max) serves every call with B <= B_max and S <= S_max.

Partial kernel layout: the sharded nest, with HEADS query heads per workgroup (1 by default; the
GQA group with `group_heads=True`):

    threadIdx.x = shard     in [0, NUM_SHARDS)
    threadIdx.y = lane      in [0, LANES_PER_SHARD)   LANES_PER_SHARD = head_dim / 64
    threadIdx.z = head      in [0, HEADS)             NUM_SHARDS * LANES_PER_SHARD * HEADS <= 256

Row p of a split belongs to shard p % NUM_SHARDS; a lane keeps 64 dims of q (pre-scaled by
sm_scale * log2 e, RoPE'd inline when rotary_mode == 1) and of its running O in 16 float32x4
registers (fully unrolled loops), reads K/V rows as f16x4/f32x4 vectors, and runs an online
softmax over its shard's rows. With several lanes the partial q.k dots meet in two workgroup arrays
(ping, pong) alternated in a loop unrolled by two: one barrier per row step. head_dim 64 has no
barrier in the loop. With HEADS > 1 the threads of the HEADS heads read the same K/V rows at about
the same time, so a KV group's rows come from DRAM/L2 once and from L1 HEADS times.

The shard states then merge in the workgroup, per query head. A split holds few rows per shard
(3060 tokens in 8 splits: 1.5 rows per shard), so this fixed cost matters more than in the
sharded nest, and both phases are cheaper than there:
  1. (max, denominator): lane 0 of each shard publishes its pair; STAT_GROUPS threads combine
     STAT_FAN pairs each (16 x 16 for 256 shards); every thread then combines the STAT_GROUPS
     results (2 barriers and ~32 reads per thread, where a walk over all shards costs 512).
  2. O: in ROUNDS_PER_HEAD rounds, MERGE_ROWS shards write their rescaled O rows to a stage of
     f32x4 ([MERGE_ROWS, D/4 + 1], padded so that rows start in different banks); REDUCERS
     threads (READERS per 4-dim column) add up ROWS_PER_READER rows each; a last pass adds the
     READERS partial sums per column and writes partial_o as f32x4.
  On lavapipe this cut the partial kernel's fixed cost per workgroup from ~0.33 to ~0.12 ms.

Workgroup storage (f32 words; TVM reuses the score arrays' space after the loop), at most 12.6 KiB
(build_kernel refuses > 16 KiB):
    score_ping, score_pong   HEADS * LANES_PER_SHARD * NUM_SHARDS each  <= 256   (lanes > 1 only)
    shard_max, shard_sum     HEADS * NUM_SHARDS each                    <= 256
    group_max, group_sum     HEADS * STAT_GROUPS each                   <= 16
    o_stage                  MERGE_ROWS * (D + 4)                       = 2048 + 4 * MERGE_ROWS

Group variant, feasibility: HEADS threads share each (shard, lane) slot, so NUM_SHARDS shrinks to
the largest power of two with NUM_SHARDS * LANES_PER_SHARD * HEADS <= 256 (group 3 at head_dim 64:
64 shards x 3 heads = 192 invocations; group 8 at 256: 8 shards x 4 lanes x 8 heads). Registers per
thread are those of the per-head kernel (q and O: 2 x 16 f32x4); storage stays within the bound
above (the stage is shared by the heads, one head per round). It only pays where L2 bandwidth
or hit rate limits (the GQA re-reads), and costs parallelism in the row loop: fewer shards per
head means more rows per thread, i.e. more splits for the same occupancy.
"""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.decode_attention import LANE_DIMS, MASKED_SCORE, check_sharded_shape, paged_row_helpers
from model_glue.contract import MAX_INVOCATIONS as WORKGROUP_INVOCATIONS
from model_glue.contract import PAGE_SIZE

VEC = 4  # K, V, q and O move as 4-wide vectors (one 8-byte f16 / 16-byte f32 access, not four)
STAGE_WORDS = 2048  # f32 words of the O merge stage (8 KiB)
STATS = 2  # partial_stats[..., 0] = max, [..., 1] = denominator


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def decode_attention_split_partial(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window,
                                   page_size=PAGE_SIZE, group_heads=False):
    """The partial kernel (layout in the module docstring): one split of one (sequence, head set).

    Arguments as TVM's `batch_decode_paged_kv` (Q, pages, page_table_indptr, page_table_values,
    length_info, k_rope_pos_offset, q_rope_position; rotary_mode, rope_scale, rope_theta,
    sm_scale) plus the scalar `num_splits`; outputs partial_o and partial_stats (workspace).
    `group_heads`: one workgroup per (sequence, KV head, split) serving the whole GQA group.
    """
    check_sharded_shape(num_kv_heads, num_qo_heads, head_dim)
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    GROUP_SIZE = H_qo // H_kv
    HEADS = GROUP_SIZE if group_heads else 1  # query heads one workgroup serves (threadIdx.z)
    HEAD_SETS = H_qo // HEADS  # grid x
    LANES_PER_SHARD = D // LANE_DIMS
    # A power of two, so the O merge rounds below divide evenly (group 3: 64 shards x 3 heads).
    NUM_SHARDS = _pow2_floor(WORKGROUP_INVOCATIONS // (LANES_PER_SHARD * HEADS))
    INVOCATIONS = NUM_SHARDS * LANES_PER_SHARD * HEADS
    VEC_DTYPE = f"{dtype}x{VEC}"
    LANE_CHUNKS = LANE_DIMS // VEC  # vectors of q and O a lane keeps in registers
    SPLIT_LANES = LANES_PER_SHARD > 1
    SCORE_WORDS = HEADS * LANES_PER_SHARD * NUM_SHARDS
    # Merge phase 1: the shards' (max, denominator) pairs are combined in two levels, STAT_FAN
    # pairs per thread, then the STAT_GROUPS results by every thread (2 barriers, ~2 sqrt(N) reads
    # per thread instead of a serial walk over all N shards).
    STAT_FAN = 1 << (NUM_SHARDS.bit_length() // 2)
    STAT_GROUPS = NUM_SHARDS // STAT_FAN
    # Merge phase 2: O rows go through a stage of MERGE_ROWS rows of D f32 (8 KiB), as f32x4, one
    # head at a time, ROUNDS_PER_HEAD rounds per head. REDUCERS threads (the rest idle) sum it:
    # READERS per 4-dim column, ROWS_PER_READER rows each per round.
    COLS = D // VEC
    MERGE_ROWS = STAGE_WORDS // D
    STAGE_STRIDE = COLS + 1  # f32x4 per stage row, padded: rows start in different banks
    ROUNDS_PER_HEAD = NUM_SHARDS // MERGE_ROWS
    REDUCERS = _pow2_floor(INVOCATIONS)
    READERS = REDUCERS // COLS
    ROWS_PER_READER = MERGE_ROWS // READERS
    if ROUNDS_PER_HEAD < 1 or ROWS_PER_READER < 1:
        raise ValueError(f"group of {HEADS} heads does not fit the O merge stage at head_dim {D}")

    (kv_len_of, seq_offset_of, lane_sum, add_key_dot, load_query, gather_partial_dots,
     online_softmax_step) = paged_row_helpers(D, sliding_window, page_size)

    # fmt: off
    @T.prim_func(s_tir=True)
    def decode_split_partial(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        partial_o_handle: T.handle, partial_stats_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
        num_splits: T.int32,
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
        partial_o = T.match_buffer(partial_o_handle, (B, H_qo, num_splits, COLS), "float32x4")  # [.., D] f32
        partial_stats = T.match_buffer(partial_stats_handle, (B, H_qo, num_splits, STATS), "float32")

        # Head sets on x: the query heads of one KV group sit next to each other in launch order,
        # so their (shared) K/V rows are read while still in L2.
        for hx in T.thread_binding(HEAD_SETS, thread="blockIdx.x"):
            for bs in T.thread_binding(B * num_splits, thread="blockIdx.y"):
                for head in T.thread_binding(HEADS, thread="threadIdx.z"):
                    for lane in T.thread_binding(LANES_PER_SHARD, thread="threadIdx.y"):
                        for shard in T.thread_binding(NUM_SHARDS, thread="threadIdx.x"):
                            with T.sblock("decode_split_partial"):
                                T.reads()  # a scheduled kernel: skip region inference over let-bound indices
                                T.writes()
                                score_ping = T.sblock_alloc_buffer((SCORE_WORDS,), "float32", scope="shared")
                                score_pong = T.sblock_alloc_buffer((SCORE_WORDS,), "float32", scope="shared")
                                shard_max = T.sblock_alloc_buffer((HEADS * NUM_SHARDS,), "float32", scope="shared")
                                shard_sum = T.sblock_alloc_buffer((HEADS * NUM_SHARDS,), "float32", scope="shared")
                                group_max = T.sblock_alloc_buffer((HEADS * STAT_GROUPS,), "float32", scope="shared")
                                group_sum = T.sblock_alloc_buffer((HEADS * STAT_GROUPS,), "float32", scope="shared")
                                o_stage = T.sblock_alloc_buffer((MERGE_ROWS * STAGE_STRIDE,), "float32x4", scope="shared")
                                q_local = T.sblock_alloc_buffer((LANE_CHUNKS,), "float32x4", scope="local")
                                o_local = T.sblock_alloc_buffer((LANE_CHUNKS,), "float32x4", scope="local")
                                dot = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                                state = T.sblock_alloc_buffer((4,), "float32", scope="local")  # m, d, M, d_total
                                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                acc4 = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                                coords = T.sblock_alloc_buffer((4,), "int32", scope="local")  # b, split, row_begin, row_end

                                # The split's coordinates live in a private array: TVM's simplifier would
                                # substitute let-bound values into every index (a division by the runtime
                                # num_splits per K/V load), but leaves loads from memory alone.
                                coords[0] = bs // num_splits
                                coords[1] = bs % num_splits
                                b: T.let[T.int32] = coords[0]
                                split: T.let[T.int32] = coords[1]
                                h: T.let[T.int32] = hx * HEADS + head
                                kv_head: T.let[T.int32] = h // GROUP_SIZE
                                chunk0: T.let[T.int32] = lane * LANE_CHUNKS
                                indptr_begin: T.let[T.int32] = page_table_indptr[b]
                                indptr_end: T.let[T.int32] = page_table_indptr[b + 1]
                                kv_len: T.let[T.int32] = T.if_then_else(
                                    indptr_begin < indptr_end, T.max(kv_len_of(indptr_begin, indptr_end, b, length_info), 0), 0)
                                # Whole pages of rows per split; splits past the end get no rows.
                                chunk_rows: T.let[T.int32] = T.ceildiv(T.ceildiv(kv_len, page_size), num_splits) * page_size
                                coords[2] = T.min(split * chunk_rows, kv_len)
                                coords[3] = T.min(coords[2] + chunk_rows, kv_len)
                                row_begin: T.let[T.int32] = coords[2]  # a multiple of page_size when the split has rows
                                row_end: T.let[T.int32] = coords[3]
                                q_pos: T.let[T.int32] = q_rope_position[b]

                                # q in registers, pre-scaled so scores land in the log2 domain.
                                load_query(q_local, o_local, Q, b, h, chunk0, q_pos, rotary_mode, rope_scale, rope_theta,
                                           sm_scale)
                                state[0] = T.float32(MASKED_SCORE)
                                state[1] = T.float32(0)

                                # Main loop over the split's rows: two row steps per trip (ping, then pong).
                                for trip in T.serial(T.ceildiv(row_end - row_begin, 2 * NUM_SHARDS)):
                                    for half in T.unroll(2):
                                        step: T.let[T.int32] = (trip * 2 + half) * NUM_SHARDS + shard
                                        pos: T.let[T.int32] = row_begin + step
                                        in_split: T.let[T.bool] = pos < row_end
                                        # Without a window, row = slot and the split starts on a page boundary.
                                        seq_offset: T.let[T.int32] = seq_offset_of(pos, b, length_info)
                                        logical_page: T.let[T.int32] = (seq_offset // page_size if sliding_window
                                                                        else row_begin // page_size + step // page_size)
                                        page: T.let[T.int32] = T.if_then_else(
                                            in_split, page_table_values[indptr_begin + logical_page], 0)
                                        slot: T.let[T.int32] = seq_offset % page_size if sliding_window else step % page_size
                                        k_pos: T.let[T.int32] = k_rope_pos_offset[b] + pos
                                        dot[0] = T.Broadcast(T.float32(0), VEC)
                                        if in_split:
                                            add_key_dot(dot, q_local, pages, page, kv_head, slot, chunk0, k_pos,
                                                        rotary_mode, rope_scale, rope_theta)
                                        acc[0] = lane_sum(dot[0])
                                        if SPLIT_LANES:
                                            # Partial dots meet in ping (even steps) or pong (odd steps).
                                            # this head's lane rows start at head * LANES_PER_SHARD
                                            if half == 0:
                                                gather_partial_dots(acc, score_ping, lane, shard, head * LANES_PER_SHARD,
                                                                    LANES_PER_SHARD, NUM_SHARDS)
                                            else:
                                                gather_partial_dots(acc, score_pong, lane, shard, head * LANES_PER_SHARD,
                                                                    LANES_PER_SHARD, NUM_SHARDS)
                                        if in_split:  # online softmax over this shard's rows
                                            online_softmax_step(state, o_local, acc, pages, page, kv_head, slot, chunk0)

                                # Merge phase 1 (per head): the split's max M and denominator.
                                if lane == 0:
                                    shard_max[head * NUM_SHARDS + shard] = state[0]
                                    shard_sum[head * NUM_SHARDS + shard] = state[1]
                                if lane == 0 and shard < STAT_GROUPS:
                                    first: T.let[T.int32] = head * NUM_SHARDS + shard * STAT_FAN
                                    acc[0] = T.float32(MASKED_SCORE)
                                    for i in T.unroll(STAT_FAN):
                                        acc[0] = T.max(acc[0], shard_max[first + i])
                                    group_max[head * STAT_GROUPS + shard] = acc[0]
                                    acc[0] = T.float32(0)
                                    for i in T.unroll(STAT_FAN):
                                        acc[0] = acc[0] + shard_sum[first + i] * T.exp2(shard_max[first + i] - group_max[head * STAT_GROUPS + shard])
                                    group_sum[head * STAT_GROUPS + shard] = acc[0]
                                state[2] = T.float32(MASKED_SCORE)
                                for g in T.unroll(STAT_GROUPS):
                                    state[2] = T.max(state[2], group_max[head * STAT_GROUPS + g])
                                state[3] = T.float32(0)
                                for g in T.unroll(STAT_GROUPS):
                                    state[3] = state[3] + group_sum[head * STAT_GROUPS + g] * T.exp2(group_max[head * STAT_GROUPS + g] - state[2])
                                shard_scale: T.let[T.float32] = T.exp2(state[0] - state[2])
                                for c in T.unroll(LANE_CHUNKS):
                                    o_local[c] = o_local[c] * T.Broadcast(shard_scale, VEC)
                                # An empty split leaves (-5e4, 0) and O = 0: the merge's neutral state.
                                if lane == 0 and shard == 0:
                                    partial_stats[b, h, split, 0] = state[2]
                                    partial_stats[b, h, split, 1] = state[3]

                                # Merge phase 2: sum each head's O rows (f32x4), MERGE_ROWS shards per round.
                                tid: T.let[T.int32] = (head * LANES_PER_SHARD + lane) * NUM_SHARDS + shard
                                col: T.let[T.int32] = tid % COLS
                                reader: T.let[T.int32] = tid // COLS
                                # One head at a time (a serial loop: the code does not grow with HEADS).
                                for hh in T.serial(HEADS):
                                    acc4[0] = T.Broadcast(T.float32(0), VEC)
                                    for r in T.serial(ROUNDS_PER_HEAD):
                                        if head == hh and shard // MERGE_ROWS == r:
                                            for c in T.unroll(LANE_CHUNKS):
                                                o_stage[(shard % MERGE_ROWS) * STAGE_STRIDE + chunk0 + c] = o_local[c]
                                        if tid < REDUCERS:
                                            for rr in T.unroll(ROWS_PER_READER):
                                                acc4[0] = acc4[0] + o_stage[(reader * ROWS_PER_READER + rr) * STAGE_STRIDE + col]
                                    # Add up the READERS partial sums of each column, reusing the stage.
                                    if tid < REDUCERS:
                                        o_stage[reader * STAGE_STRIDE + col] = acc4[0]
                                    if tid < COLS:
                                        for i in T.unroll(READERS - 1):
                                            acc4[0] = acc4[0] + o_stage[(i + 1) * STAGE_STRIDE + col]
                                        partial_o[b, hx * HEADS + hh, split, col] = acc4[0]
    # fmt: on
    return decode_split_partial


def decode_attention_split_merge(num_qo_heads, head_dim, dtype):
    """output[B, H_qo, D] (dtype) and lse[B, H_qo] (log2) from the num_splits partial states.

    threadIdx.x = 4-dim chunk of the head (D / 4), threadIdx.y = head within MERGE_HEADS; grid
    (H_qo / MERGE_HEADS, B). Every thread walks the S (max, denominator) pairs of its head (tiny,
    served from cache) and its own f32x4 column of partial_o. No workgroup storage, no barrier.
    """
    H_qo, D = num_qo_heads, head_dim
    if D % VEC:
        raise ValueError(f"head_dim must be a multiple of {VEC}")
    CHUNKS = D // VEC
    # Most heads per workgroup that divide H_qo within 256 invocations (no bounds checks).
    MERGE_HEADS = max(n for n in range(1, WORKGROUP_INVOCATIONS // CHUNKS + 1) if H_qo % n == 0)
    HEAD_SETS = H_qo // MERGE_HEADS
    VEC_DTYPE = f"{dtype}x{VEC}"

    # fmt: off
    @T.prim_func(s_tir=True)
    def decode_split_merge(
        partial_o_handle: T.handle, partial_stats_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle, num_splits: T.int32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        B = T.int32()
        partial_o = T.match_buffer(partial_o_handle, (B, H_qo, num_splits, CHUNKS), "float32x4")
        partial_stats = T.match_buffer(partial_stats_handle, (B, H_qo, num_splits, STATS), "float32")
        output = T.match_buffer(output_handle, (B, H_qo, CHUNKS), VEC_DTYPE)  # same bytes as [B, H_qo, D]
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        for hx in T.thread_binding(HEAD_SETS, thread="blockIdx.x"):
            for b in T.thread_binding(B, thread="blockIdx.y"):
                for hy in T.thread_binding(MERGE_HEADS, thread="threadIdx.y"):
                    for c in T.thread_binding(CHUNKS, thread="threadIdx.x"):
                        with T.sblock("decode_split_merge"):
                            T.reads()
                            T.writes()
                            stat = T.sblock_alloc_buffer((2,), "float32", scope="local")  # M, denominator
                            o_acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                            h: T.let[T.int32] = hx * MERGE_HEADS + hy
                            stat[0] = T.float32(MASKED_SCORE)
                            for s in T.serial(num_splits):
                                stat[0] = T.max(stat[0], partial_stats[b, h, s, 0])
                            stat[1] = T.float32(0)
                            o_acc[0] = T.Broadcast(T.float32(0), VEC)
                            for s in T.serial(num_splits):
                                # Empty splits carry (-5e4, 0, O = 0) and add nothing.
                                w: T.let[T.float32] = T.exp2(partial_stats[b, h, s, 0] - stat[0])
                                stat[1] = stat[1] + partial_stats[b, h, s, 1] * w
                                o_acc[0] = o_acc[0] + partial_o[b, h, s, c] * T.Broadcast(w, VEC)
                            # An empty context gives output 0 and lse -5e4, as tiled and sharded do.
                            denom: T.let[T.float32] = T.if_then_else(stat[1] > T.float32(0), stat[1], T.float32(1))
                            output[b, h, c] = T.Cast(VEC_DTYPE, o_acc[0] / T.Broadcast(denom, VEC))
                            if c == 0:
                                lse[b, h] = stat[0] + T.log2(denom)
    # fmt: on
    return decode_split_merge
