"""The sequence-sharded decode attention nest ("shards" layout): one builder for the whole context or a split.

Arguments are TVM's `batch_decode_paged_kv` (Q, pages, page_table_indptr, page_table_values,
length_info, k_rope_pos_offset, q_rope_position; rotary_mode, rope_scale, rope_theta, sm_scale; the
layout is in kernels.paged_kv). A workgroup attends HEADS query heads (1, or the whole GQA group with
`group_heads`) of one sequence, over its whole context (`split=False`: it writes output[B, H_qo, D]
and lse[B, H_qo] itself, grid (H_qo / HEADS, B)), or over split `s` of `num_splits` (`split=True`:
grid (H_qo / HEADS, B * num_splits); it writes the split's softmax state to the workspace,

    partial_o[b, h, s, :]      O scaled to the split's max, not yet divided     f32 [B, H_qo, S, D]
    partial_stats[b, h, s, :]  (max, denominator), log2 domain                  f32 [B, H_qo, S, 2]

and kernels.decode_attention_merge combines the S states). A split holds whole pages:
CHUNK = ceil(ceil(kv_len / page_size) / S) * page_size rows (a split past the end holds none and
writes max -5e4, denominator 0, O = 0, which adds nothing to the merge).

Thread layout (exactly 256 invocations for HEADS = 1):

    threadIdx.x = shard  in [0, NUM_SHARDS)        NUM_SHARDS = pow2_floor(256 / (LANES_PER_SHARD * HEADS))
    threadIdx.y = lane   in [0, LANES_PER_SHARD)   LANES_PER_SHARD = head_dim / 64
    threadIdx.z = head   in [0, HEADS)

Row p of the range belongs to shard p % NUM_SHARDS, so neighbouring shards read neighbouring rows.
A lane keeps 64 dims of q (pre-scaled by sm_scale * log2 e, RoPE'd inline when rotary_mode == 1)
and of its running O in 16 float32x4 registers (fully unrolled loops keep them out of memory), reads
its 64 dims of a K or V row as 16 f16x4/f32x4 vectors, and runs an online softmax over its shard's
rows. With several lanes the partial q.k dots meet in a workgroup array; two arrays (ping, pong)
alternate in a loop unrolled by two, so TVM's barrier pass puts exactly one barrier per row step
(a write to one array can only race with a read of it two steps back). head_dim 64 has one lane per
shard and no barrier in the loop. With HEADS > 1 the heads' threads read the same K/V rows at about
the same time, so a KV group's rows come from DRAM once.

The shard states then merge in the workgroup, per query head:
  1. (max, denominator): lane 0 of each shard publishes its pair; STAT_GROUPS threads combine
     STAT_FAN pairs each; every thread combines the STAT_GROUPS results (2 barriers, ~2 sqrt(N)
     reads per thread instead of a walk over all N shards).
  2. O: in ROUNDS_PER_HEAD rounds, MERGE_ROWS shards write their rescaled O rows to a stage of
     f32x4 ([MERGE_ROWS, D/4 + 1], padded so that rows start in different banks); REDUCERS threads
     (READERS per 4-dim column) add up ROWS_PER_READER rows each; a last pass adds the READERS partial
     sums per column and writes the result.

Workgroup storage (f32 words; TVM reuses the score arrays' space after the loop), at most 12.6 KiB:
    score_ping, score_pong   HEADS * LANES_PER_SHARD * NUM_SHARDS each  <= 256   (lanes > 1 only)
    shard_max, shard_sum     HEADS * NUM_SHARDS each                    <= 256
    group_max, group_sum     HEADS * STAT_GROUPS each                   <= 16
    o_stage                  MERGE_ROWS * (D + 4)                       = 2048 + 4 * MERGE_ROWS

With HEADS > 1, NUM_SHARDS shrinks so that NUM_SHARDS * LANES_PER_SHARD * HEADS <= 256 (group 3 at
head_dim 64: 64 shards x 3 heads = 192 invocations); `check_shards_shape` says which groups fit.
"""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.paged_kv import (LOG2_E, MASKED_SCORE, VEC, kv_len_of, lane_sum, partner_chunk, pow2_floor, rope_rotate,
                              seq_offset_of)
from contract.attention import LayoutBuild
from contract.kernels import MAX_INVOCATIONS as WORKGROUP_INVOCATIONS
from contract.kernels import PAGE_SIZE
from contract.model import AttentionShape

LANE_DIMS = 64  # q and O dims each lane keeps in registers
LANE_CHUNKS = LANE_DIMS // VEC  # vectors of q and O a lane keeps in registers
STAGE_WORDS = 2048  # f32 words of the O merge stage (8 KiB)
STATS = 2  # partial_stats[..., 0] = max, [..., 1] = denominator


def shards_layout(head_dim: int, heads: int) -> dict[str, int]:
    """The thread counts of the shards layout, or ValueError when `heads` heads do not fit it."""
    if head_dim % LANE_DIMS or head_dim > 4 * LANE_DIMS:
        raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")
    lanes = head_dim // LANE_DIMS
    if lanes * heads > WORKGROUP_INVOCATIONS:
        raise ValueError(f"{heads} heads of head_dim {head_dim} do not fit {WORKGROUP_INVOCATIONS} invocations")
    shards = pow2_floor(WORKGROUP_INVOCATIONS // (lanes * heads))
    merge_rows = STAGE_WORDS // head_dim
    reducers = pow2_floor(shards * lanes * heads)
    if shards < merge_rows or reducers < head_dim // VEC or reducers // (head_dim // VEC) > merge_rows:
        raise ValueError(f"a group of {heads} heads does not fit the O merge stage at head_dim {head_dim}")
    return {"lanes_per_shard": lanes, "num_shards": shards, "invocations": shards * lanes * heads}


def check_shards_shape(num_kv_heads: int, num_qo_heads: int, head_dim: int, group_heads: bool = False) -> None:
    """ValueError unless the shards layout serves this shape (whole GQA groups; the group fits)."""
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{num_qo_heads} query heads do not group over {num_kv_heads} KV heads")
    shards_layout(head_dim, num_qo_heads // num_kv_heads if group_heads else 1)


def layout_builds(layout: str, shape: AttentionShape) -> list[LayoutBuild]:
    """The builds of the "shards" (one query head per workgroup) and "shards_group" (a whole GQA
    group per workgroup) layouts for a shape (contract.attention.LAYOUTS): one each, none where the
    shape does not fit."""
    group_heads = layout == "shards_group"
    try:
        check_shards_shape(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, group_heads)
    except ValueError:
        return []
    return [LayoutBuild(None, {"group_heads": group_heads}, {"heads": shape.group if group_heads else 1})]


def decode_attention_sharded(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window, page_size=PAGE_SIZE,
                             *, split=False, group_heads=False):
    """The shards layout (module docstring): the whole context (`split=False`) or one split of it."""
    check_shards_shape(num_kv_heads, num_qo_heads, head_dim, group_heads)
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    GROUP_SIZE = H_qo // H_kv
    HEADS = GROUP_SIZE if group_heads else 1  # query heads one workgroup serves (threadIdx.z)
    HEAD_SETS = H_qo // HEADS  # grid x
    layout = shards_layout(D, HEADS)
    LANES_PER_SHARD, NUM_SHARDS, INVOCATIONS = layout["lanes_per_shard"], layout["num_shards"], layout["invocations"]
    VEC_DTYPE = f"{dtype}x{VEC}"
    SPLIT_LANES = LANES_PER_SHARD > 1
    SCORE_WORDS = HEADS * LANES_PER_SHARD * NUM_SHARDS
    # Merge phase 1: STAT_FAN pairs per thread, then the STAT_GROUPS results by every thread.
    STAT_FAN = 1 << (NUM_SHARDS.bit_length() // 2)
    STAT_GROUPS = NUM_SHARDS // STAT_FAN
    # Merge phase 2: MERGE_ROWS rows of D f32 per round (8 KiB), one head at a time; REDUCERS
    # threads (the rest idle) sum it, READERS per 4-dim column, ROWS_PER_READER rows each per round.
    COLS = D // VEC
    MERGE_ROWS = STAGE_WORDS // D
    STAGE_STRIDE = COLS + 1  # f32x4 per stage row, padded: rows start in different banks
    ROUNDS_PER_HEAD = NUM_SHARDS // MERGE_ROWS
    REDUCERS = pow2_floor(INVOCATIONS)
    READERS = REDUCERS // COLS
    ROWS_PER_READER = MERGE_ROWS // READERS
    SPLIT = split

    # fmt: off
    @T.prim_func(s_tir=True)
    def decode_sharded(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        out_handle: T.handle, stats_handle: T.handle,
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
        if SPLIT:
            partial_o = T.match_buffer(out_handle, (B, H_qo, num_splits, COLS), "float32x4")  # [.., D] f32
            partial_stats = T.match_buffer(stats_handle, (B, H_qo, num_splits, STATS), "float32")
        else:
            output = T.match_buffer(out_handle, (B, H_qo, COLS), VEC_DTYPE)  # same bytes as [B, H_qo, D]
            lse = T.match_buffer(stats_handle, (B, H_qo), "float32")

        # Head sets on x: the query heads of one KV group sit next to each other in launch order,
        # so their (shared) K/V rows are read while still in L2.
        for hx in T.thread_binding(HEAD_SETS, thread="blockIdx.x"):
            for bs in T.thread_binding(B * num_splits if SPLIT else B, thread="blockIdx.y"):
                for head in T.thread_binding(HEADS, thread="threadIdx.z"):
                    for lane in T.thread_binding(LANES_PER_SHARD, thread="threadIdx.y"):
                        for shard in T.thread_binding(NUM_SHARDS, thread="threadIdx.x"):
                            with T.sblock("decode_sharded"):
                                T.reads()  # a scheduled kernel: skip region inference over let-bound indices
                                T.writes()
                                score_ping = T.sblock_alloc_buffer((SCORE_WORDS,), "float32", scope="shared")
                                score_pong = T.sblock_alloc_buffer((SCORE_WORDS,), "float32", scope="shared")
                                shard_max = T.sblock_alloc_buffer((HEADS * NUM_SHARDS,), "float32", scope="shared")
                                shard_sum = T.sblock_alloc_buffer((HEADS * NUM_SHARDS,), "float32", scope="shared")
                                group_max = T.sblock_alloc_buffer((HEADS * STAT_GROUPS,), "float32", scope="shared")
                                group_sum = T.sblock_alloc_buffer((HEADS * STAT_GROUPS,), "float32", scope="shared")
                                head_denom = T.sblock_alloc_buffer((HEADS,), "float32", scope="shared")
                                o_stage = T.sblock_alloc_buffer((MERGE_ROWS * STAGE_STRIDE,), "float32x4", scope="shared")
                                q_local = T.sblock_alloc_buffer((LANE_CHUNKS,), "float32x4", scope="local")
                                o_local = T.sblock_alloc_buffer((LANE_CHUNKS,), "float32x4", scope="local")
                                dot = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                                rot = T.sblock_alloc_buffer((2,), "float32x4", scope="local")  # RoPE's cos, sin
                                rotated = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                                state = T.sblock_alloc_buffer((4,), "float32", scope="local")  # m, d, M, d_total
                                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                acc4 = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                                coords = T.sblock_alloc_buffer((4,), "int32", scope="local")  # b, split, row_begin, row_end

                                # The split's coordinates live in a private array: TVM's simplifier would
                                # substitute let-bound values into every index (a division by the runtime
                                # num_splits per K/V load), but leaves loads from memory alone.
                                coords[0] = bs // num_splits if SPLIT else bs
                                coords[1] = bs % num_splits if SPLIT else 0
                                b: T.let[T.int32] = coords[0]
                                split_index: T.let[T.int32] = coords[1]
                                h: T.let[T.int32] = hx * HEADS + head
                                kv_head: T.let[T.int32] = h // GROUP_SIZE
                                chunk0: T.let[T.int32] = lane * LANE_CHUNKS
                                indptr_begin: T.let[T.int32] = page_table_indptr[b]
                                kv_len: T.let[T.int32] = kv_len_of(indptr_begin, page_table_indptr[b + 1], b, length_info,
                                                                   sliding_window, page_size)
                                # Whole pages of rows per split; splits past the end get no rows.
                                chunk_rows: T.let[T.int32] = (T.ceildiv(T.ceildiv(kv_len, page_size), num_splits) * page_size
                                                              if SPLIT else kv_len)
                                coords[2] = T.min(split_index * chunk_rows, kv_len)
                                coords[3] = T.min(coords[2] + chunk_rows, kv_len)
                                row_begin: T.let[T.int32] = coords[2]  # a multiple of page_size when the split has rows
                                row_end: T.let[T.int32] = coords[3]
                                q_pos: T.let[T.int32] = q_rope_position[b]

                                # q in registers, pre-scaled so scores land in the log2 domain; O zeroed.
                                for c in T.unroll(LANE_CHUNKS):
                                    q_local[c] = T.Cast("float32x4", Q[b, h, chunk0 + c])
                                    o_local[c] = T.Broadcast(T.float32(0), VEC)
                                if rotary_mode == 1:
                                    for c in T.unroll(LANE_CHUNKS):
                                        rope_rotate(rotated, q_local[c], T.Cast("float32x4", Q[b, h, partner_chunk(chunk0 + c, D)]),
                                                    q_pos, chunk0 + c, D, rope_scale, rope_theta, rot)
                                        q_local[c] = rotated[0]
                                for c in T.unroll(LANE_CHUNKS):
                                    q_local[c] = q_local[c] * T.Broadcast(sm_scale * T.float32(LOG2_E), VEC)
                                state[0] = T.float32(MASKED_SCORE)
                                state[1] = T.float32(0)

                                # Main loop over the range's rows: two row steps per trip (ping, then pong).
                                for trip in T.serial(T.ceildiv(row_end - row_begin, 2 * NUM_SHARDS)):
                                    for half in T.unroll(2):
                                        step: T.let[T.int32] = (trip * 2 + half) * NUM_SHARDS + shard
                                        pos: T.let[T.int32] = row_begin + step
                                        in_range: T.let[T.bool] = pos < row_end
                                        # Without a window, offset = row and the range starts on a page boundary.
                                        seq_offset: T.let[T.int32] = seq_offset_of(pos, b, length_info, sliding_window)
                                        logical_page: T.let[T.int32] = (seq_offset // page_size if sliding_window
                                                                        else row_begin // page_size + step // page_size)
                                        page: T.let[T.int32] = T.if_then_else(
                                            in_range, page_table_values[indptr_begin + logical_page], 0)
                                        slot: T.let[T.int32] = seq_offset % page_size if sliding_window else step % page_size
                                        k_pos: T.let[T.int32] = k_rope_pos_offset[b] + pos
                                        dot[0] = T.Broadcast(T.float32(0), VEC)
                                        if in_range:
                                            if rotary_mode == 1:
                                                for c in T.unroll(LANE_CHUNKS):
                                                    rope_rotate(rotated, T.Cast("float32x4", pages[page, 0, kv_head, slot, chunk0 + c]),
                                                                T.Cast("float32x4", pages[page, 0, kv_head, slot, partner_chunk(chunk0 + c, D)]),
                                                                k_pos, chunk0 + c, D, rope_scale, rope_theta, rot)
                                                    dot[0] = dot[0] + q_local[c] * rotated[0]
                                            else:
                                                for c in T.unroll(LANE_CHUNKS):
                                                    dot[0] = dot[0] + q_local[c] * T.Cast("float32x4", pages[page, 0, kv_head, slot, chunk0 + c])
                                        acc[0] = lane_sum(dot[0])
                                        if SPLIT_LANES:
                                            # Partial dots meet in ping (even steps) or pong (odd steps);
                                            # this head's lane rows start at head * LANES_PER_SHARD.
                                            if half == 0:
                                                score_ping[((head * LANES_PER_SHARD) + lane) * NUM_SHARDS + shard] = acc[0]
                                                acc[0] = T.float32(0)
                                                for l in T.unroll(LANES_PER_SHARD):
                                                    acc[0] = acc[0] + score_ping[((head * LANES_PER_SHARD) + l) * NUM_SHARDS + shard]
                                            else:
                                                score_pong[((head * LANES_PER_SHARD) + lane) * NUM_SHARDS + shard] = acc[0]
                                                acc[0] = T.float32(0)
                                                for l in T.unroll(LANES_PER_SHARD):
                                                    acc[0] = acc[0] + score_pong[((head * LANES_PER_SHARD) + l) * NUM_SHARDS + shard]
                                        if in_range:  # online softmax over this shard's rows
                                            m_new: T.let[T.float32] = T.max(state[0], acc[0])
                                            rescale: T.let[T.float32] = T.exp2(state[0] - m_new)
                                            p: T.let[T.float32] = T.exp2(acc[0] - m_new)
                                            state[1] = state[1] * rescale + p
                                            state[0] = m_new
                                            for c in T.unroll(LANE_CHUNKS):
                                                o_local[c] = o_local[c] * T.Broadcast(rescale, VEC) + T.Broadcast(p, VEC) * T.Cast(
                                                    "float32x4", pages[page, 1, kv_head, slot, chunk0 + c])

                                # Merge phase 1 (per head): the range's max M and denominator.
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
                                # The whole context's result is divided here; a split leaves that to the merge
                                # (an empty range leaves (-5e4, 0) and O = 0: the merge's neutral state).
                                denom: T.let[T.float32] = T.if_then_else(state[3] > T.float32(0), state[3], T.float32(1))
                                if lane == 0 and shard == 0:
                                    if SPLIT:
                                        partial_stats[b, h, split_index, 0] = state[2]
                                        partial_stats[b, h, split_index, 1] = state[3]
                                    else:
                                        lse[b, h] = state[2] + T.log2(denom)
                                        head_denom[head] = denom

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
                                        if SPLIT:
                                            partial_o[b, hx * HEADS + hh, split_index, col] = acc4[0]
                                        else:  # head hh's denominator (this thread may serve another head)
                                            output[b, hx * HEADS + hh, col] = T.Cast(
                                                VEC_DTYPE, acc4[0] / T.Broadcast(head_denom[hh], VEC))
    # fmt: on
    return decode_sharded
