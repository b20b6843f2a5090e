"""The sharded family's subgroup layout: K/V rows across subgroups, head dims across a row's lanes.

Same arguments and outputs as kernels.decode_attention_sharded (the whole context with
`split=False`, one split of it with `split=True`), same paged layout (kernels.paged_kv). A workgroup
attends HEADS query heads of one KV head (the whole GQA group by default, so each K/V row is read
from memory once per group) of one sequence, over its range of rows. Grid (H_qo / HEADS, B) or
(H_qo / HEADS, B * num_splits).

Thread layout, INVOCATIONS (256 by default) per workgroup, in one dimension (threadIdx.x = tid):

    lane  = tid % ROW_LANES    the lanes that share one K/V row: lane l holds the VEC-dim vectors
                               l, l + ROW_LANES, ... (CHUNKS_PER_LANE of them), so a row's lanes
                               read it in coalesced loads
    group = tid / ROW_LANES    in [0, ROW_GROUPS), ROW_GROUPS = INVOCATIONS / ROW_LANES

ROW_LANES consecutive invocations must sit in one subgroup (the host checks the adapter's
subgroup size, model_glue.model.attention; invocations fill subgroups in index order). The q.k dot of a
row is reduced across its lanes with `subgroupShuffleDown` and handed back to every lane with
`subgroupShuffleUp`: relative shuffles, right for any subgroup size that is a multiple of
ROW_LANES. A build for an exact subgroup size (`subgroup_size`) instead runs butterflies over the
subgroup lane ids (half the shuffles, no selects), and merges the row groups of each subgroup
with shuffles before the workgroup merge. There is no barrier in the row loop.

Each trip over the range takes ROWS_PER_TRIP = ROW_GROUPS * UNROLL rows: group g reads rows
g, g + ROW_GROUPS, ... (neighbouring groups read neighbouring rows), all UNROLL rows' K and V
loads issued together, so a lane has 2 * UNROLL * CHUNKS_PER_LANE vector loads in flight. The
loop is software-pipelined: while a trip's arithmetic runs, the next trip's K/V rows and the page
ids of the trip after are already being read. The heads live in the lanes of f32 vectors (HEAD_LANES = 1, 2 or 4 heads per vector,
HEAD_VECS vectors): q is held transposed, q_t[j] = dim j of every head, so a row's partial dots for
all heads are DIMS_PER_LANE vector FMAs against the row's scalars, one shuffle tree per head vector
reduces them, and the online softmax (max, denominator, O) runs on head vectors too.

After the loop the ROW_GROUPS states merge through workgroup memory: each group publishes its
(max, denominator); every thread takes the global max M and the summed denominator (1 barrier);
then in ROUNDS rounds GROUPS_PER_ROUND groups write their rescaled O to a stage and one thread per
(head vector, dim) adds them up (2 barriers a round). Workgroup storage: 2 * ROW_GROUPS * HEAD_VECS
head vectors of statistics plus an 8 KiB stage.
"""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.paged_kv import (LOG2_E, MASKED_ROW, MASKED_SCORE, VEC, broadcast, kv_len_of, lane_of, pow2_floor,
                              rope_cos_sin, seq_offset_of)
from contract.attention import LayoutBuild, subgroup_tag
from contract.kernels import MAX_INVOCATIONS
from contract.kernels import PAGE_SIZE
from contract.model import AttentionShape

STAGE_BYTES = 8192  # the O merge stage
STATS = 2  # partial_stats[..., 0] = max, [..., 1] = denominator
MIN_DIMS_PER_LANE = 8  # two vectors: a lane's share of a row is never smaller


def subgroup_layout(head_dim: int, heads: int, row_lanes: int, unroll: int,
                    invocations: int = MAX_INVOCATIONS) -> dict[str, int]:
    """The derived thread and register counts, or ValueError for a shape the layout cannot take."""
    if head_dim % (VEC * 2) or head_dim > 256:
        raise ValueError(f"head_dim must be a multiple of {2 * VEC} up to 256, got {head_dim}")
    if row_lanes & (row_lanes - 1) or not 1 <= row_lanes <= 32:
        raise ValueError(f"row_lanes must be a power of two up to 32, got {row_lanes}")
    lanes = min(row_lanes, head_dim // MIN_DIMS_PER_LANE)
    head_lanes = 1 if heads == 1 else 2 if heads == 2 else 4
    head_vecs = -(-heads // head_lanes)
    if head_vecs * head_lanes * head_dim > 8 * 256:
        raise ValueError(f"{heads} heads of head_dim {head_dim} need more than 64 head-vector registers for q")
    if invocations > MAX_INVOCATIONS or invocations % lanes:
        raise ValueError(f"{invocations} invocations per workgroup do not hold whole rows of {lanes} lanes")
    return {"row_lanes": lanes, "chunks_per_lane": head_dim // VEC // lanes, "row_groups": invocations // lanes,
            "head_lanes": head_lanes, "head_vecs": head_vecs, "unroll": unroll, "invocations": invocations}


# The served builds. Lanes per K/V row: the adapter's subgroups must hold them, so there is a build for
# the subgroup sizes seen (4: SwiftShader, 8: lavapipe on 256-bit vectors, 32: NVIDIA, Apple, AMD RDNA;
# capped at head_dim / 8, two vectors a lane) and the host takes the widest one that fits. Each build
# is (lanes per row, exact subgroup size or None): relative builds for subgroups of at least 4, 8 and
# 32, and one for subgroups of exactly 32 (butterfly reductions, shuffle pre-merge). Rows per row group
# per trip (`unroll`), from the sweep on the H200 (docs/benchmarks.md).
SUBGROUP_BUILDS = ((4, None), (8, None), (32, None), (32, 32))
SUBGROUP_UNROLL = {64: 2, 128: 2, 256: 2}


def distinct_builds(head_dim: int, wanted=SUBGROUP_BUILDS) -> list[tuple[int, int | None]]:
    """The distinct (lanes per row, exact size) builds of a head_dim (lanes capped at head_dim / 8)."""
    capped = {(min(lanes, head_dim // MIN_DIMS_PER_LANE), exact) for lanes, exact in wanted}
    return sorted(capped, key=lambda b: (b[0], b[1] or 0))


def layout_builds(layout: str, shape: AttentionShape, *, builds=SUBGROUP_BUILDS, unroll: int | None = None,
                  invocations: int = MAX_INVOCATIONS) -> list[LayoutBuild]:
    """The builds of the "subgroup" layout for a shape (contract.attention.LAYOUTS): one per
    (lanes per row, exact subgroup size) of `builds`; `unroll` and `invocations` are the
    benchmark sweep's other parameters."""
    unroll = unroll or SUBGROUP_UNROLL[shape.head_dim]
    return [LayoutBuild(subgroup_tag(lanes, exact),
                        {"row_lanes": lanes, "unroll": unroll, "invocations": invocations, "subgroup_size": exact},
                        {"row_lanes": subgroup_layout(shape.head_dim, shape.group, lanes, unroll)["row_lanes"],
                         "subgroup_size": exact, "unroll": unroll, "heads": shape.group, "invocations": invocations})
            for lanes, exact in distinct_builds(shape.head_dim, builds)]


def decode_attention_subgroup(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window, page_size=PAGE_SIZE,
                              *, split=False, heads=None, row_lanes=32, unroll=2, invocations=MAX_INVOCATIONS,
                              subgroup_size=None):
    """The subgroup layout (module docstring). `heads`: query heads per workgroup (default: the GQA
    group); `row_lanes`: lanes per K/V row (capped at head_dim / 8; the adapter's subgroups must hold
    that many); `unroll`: rows per group per trip; `invocations`: per workgroup (256 or fewer);
    `subgroup_size`: None, or the exact subgroup size of the adapters this build is for (then the
    reductions are butterflies over subgroup lane ids, and the row groups of one subgroup merge
    their states with shuffles before the workgroup merge)."""
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{num_qo_heads} query heads do not group over {num_kv_heads} KV heads")
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    GROUP_SIZE = H_qo // H_kv
    HEADS = heads or GROUP_SIZE
    if GROUP_SIZE % HEADS:
        raise ValueError(f"{HEADS} heads per workgroup do not divide the GQA group of {GROUP_SIZE}")
    HEAD_SETS = H_qo // HEADS  # grid x
    layout = subgroup_layout(D, HEADS, row_lanes, unroll, invocations)
    INVOCATIONS = layout["invocations"]
    ROW_LANES, CHUNKS_PER_LANE, ROW_GROUPS = layout["row_lanes"], layout["chunks_per_lane"], layout["row_groups"]
    HEAD_LANES, HEAD_VECS = layout["head_lanes"], layout["head_vecs"]
    HEAD_VEC = "float32" if HEAD_LANES == 1 else f"float32x{HEAD_LANES}"
    DIMS_PER_LANE = CHUNKS_PER_LANE * VEC
    HALF_CHUNKS = CHUNKS_PER_LANE // 2  # RoPE pairs a lane's vector c with its vector c + HALF_CHUNKS
    UNROLL = unroll
    ROWS_PER_TRIP = ROW_GROUPS * UNROLL
    SHUFFLE_STEPS = ROW_LANES.bit_length() - 1
    EXACT = subgroup_size is not None
    if EXACT and (subgroup_size % ROW_LANES or INVOCATIONS % subgroup_size):
        raise ValueError(f"subgroups of {subgroup_size} do not hold whole rows of {ROW_LANES} lanes")
    # With exact subgroups, the GROUPS_PER_SUBGROUP row groups of a subgroup merge with shuffles first.
    GROUPS_PER_SUBGROUP = subgroup_size // ROW_LANES if EXACT else 1
    PRE_MERGE_STEPS = GROUPS_PER_SUBGROUP.bit_length() - 1
    MERGE_GROUPS = ROW_GROUPS // GROUPS_PER_SUBGROUP  # states the workgroup merge takes
    VEC_DTYPE = f"{dtype}x{VEC}"
    # O merge: GROUPS_PER_ROUND groups' (HEAD_VECS x D) head vectors per stage round.
    STAGE_VECS = STAGE_BYTES // (4 * HEAD_LANES)
    GROUPS_PER_ROUND = min(MERGE_GROUPS, pow2_floor(max(1, STAGE_VECS // (D * HEAD_VECS))))
    ROUNDS = MERGE_GROUPS // GROUPS_PER_ROUND
    OUT_SLOTS = D * HEAD_VECS  # (head vector, dim) sums, one per reducing thread
    OUT_PER_THREAD = -(-OUT_SLOTS // INVOCATIONS)
    SPLIT = split
    M_, D_, NEW_M, RESCALE = 0, HEAD_VECS, 2 * HEAD_VECS, 3 * HEAD_VECS  # offsets into `state`

    def vec_index(lane, j):
        """The VEC-dim vector of the row that holds a lane's j-th value."""
        return lane + (j // VEC) * ROW_LANES

    def head_vector(q_heads, hv, j):
        """Dim j of this lane's share of q for heads hv * HEAD_LANES .. as one head vector."""
        lanes = [T.Shuffle([q_heads[(hv * HEAD_LANES + i) * CHUNKS_PER_LANE + j // VEC]], [j % VEC]) for i in range(HEAD_LANES)]
        return lanes[0] if HEAD_LANES == 1 else T.Shuffle(lanes, list(range(HEAD_LANES)))

    def denominator(total):
        """An empty range sums to 0: divide by 1 instead (O is 0 there too)."""
        return T.if_then_else(total > T.float32(0), total, T.float32(1))

    @T.macro
    def locate_rows(row_at, trip, row_begin, row_end, group, b, indptr_begin, page_table_values, length_info):
        """row_at[u], row_at[UNROLL + u] = page id and slot of this group's u-th row of `trip`
        (rows past the range read page 0, any real page will do, and are masked)."""
        for u in T.unroll(UNROLL):
            pos: T.let[T.int32] = row_begin + (trip * UNROLL + u) * ROW_GROUPS + group
            seq_offset: T.let[T.int32] = seq_offset_of(pos, b, length_info, sliding_window)
            row_at[u] = T.if_then_else(pos < row_end, page_table_values[indptr_begin + seq_offset // page_size], 0)
            row_at[UNROLL + u] = seq_offset % page_size

    @T.macro
    def load_rows(k_rows, v_rows, pages, row_at, kv_head, lane):
        """This lane's vectors of the K and V rows that row_at locates, all loads issued together."""
        for u in T.unroll(UNROLL):
            for c in T.unroll(CHUNKS_PER_LANE):
                k_rows[u * CHUNKS_PER_LANE + c] = pages[row_at[u], 0, kv_head, row_at[UNROLL + u], lane + c * ROW_LANES]
        for u in T.unroll(UNROLL):
            for c in T.unroll(CHUNKS_PER_LANE):
                v_rows[u * CHUNKS_PER_LANE + c] = pages[row_at[u], 1, kv_head, row_at[UNROLL + u], lane + c * ROW_LANES]

    @T.macro
    def rotate_pair(x, c, rot, pos, chunk, rope_scale, rope_theta):
        """RoPE on x[c] and its partner x[c + HALF_CHUNKS] (dims d and d + D/2), in place."""
        rope_cos_sin(rot, pos, chunk, D, rope_scale, rope_theta)
        rot[2] = x[c] * rot[0] - x[c + HALF_CHUNKS] * rot[1]
        x[c + HALF_CHUNKS] = x[c + HALF_CHUNKS] * rot[0] + x[c] * rot[1]
        x[c] = rot[2]

    # fmt: off
    @T.prim_func(s_tir=True)
    def decode_subgroup(
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
            partial_o = T.match_buffer(out_handle, (B, H_qo, num_splits, D), "float32")
            partial_stats = T.match_buffer(stats_handle, (B, H_qo, num_splits, STATS), "float32")
        else:
            output = T.match_buffer(out_handle, (B, H_qo, D), dtype)
            lse = T.match_buffer(stats_handle, (B, H_qo), "float32")

        for hx in T.thread_binding(HEAD_SETS, thread="blockIdx.x"):
            for bs in T.thread_binding(B * num_splits if SPLIT else B, thread="blockIdx.y"):
                # One dimension: invocation tid is lane tid % ROW_LANES of row group tid // ROW_LANES,
                # and invocations fill subgroups in index order.
                for tid in T.thread_binding(INVOCATIONS, thread="threadIdx.x"):
                        with T.sblock("decode_subgroup"):
                            T.reads()  # a scheduled kernel: skip region inference over let-bound indices
                            T.writes()
                            stat_max = T.sblock_alloc_buffer((MERGE_GROUPS * HEAD_VECS,), HEAD_VEC, scope="shared")
                            stat_sum = T.sblock_alloc_buffer((MERGE_GROUPS * HEAD_VECS,), HEAD_VEC, scope="shared")
                            partner = T.sblock_alloc_buffer((3,), HEAD_VEC, scope="local")  # max, sum, scale
                            o_stage = T.sblock_alloc_buffer((GROUPS_PER_ROUND * HEAD_VECS * D,), HEAD_VEC, scope="shared")
                            q_t = T.sblock_alloc_buffer((DIMS_PER_LANE * HEAD_VECS,), HEAD_VEC, scope="local")
                            o_t = T.sblock_alloc_buffer((DIMS_PER_LANE * HEAD_VECS,), HEAD_VEC, scope="local")
                            k_rows = T.sblock_alloc_buffer((UNROLL * CHUNKS_PER_LANE,), VEC_DTYPE, scope="local")
                            v_rows = T.sblock_alloc_buffer((UNROLL * CHUNKS_PER_LANE,), VEC_DTYPE, scope="local")
                            k_next = T.sblock_alloc_buffer((UNROLL * CHUNKS_PER_LANE,), VEC_DTYPE, scope="local")
                            v_next = T.sblock_alloc_buffer((UNROLL * CHUNKS_PER_LANE,), VEC_DTYPE, scope="local")
                            k_f32 = T.sblock_alloc_buffer((UNROLL * CHUNKS_PER_LANE,), "float32x4", scope="local")
                            q_heads = T.sblock_alloc_buffer((HEAD_VECS * HEAD_LANES * CHUNKS_PER_LANE,), "float32x4", scope="local")
                            rot = T.sblock_alloc_buffer((3,), "float32x4", scope="local")  # cos, sin, rotated
                            score = T.sblock_alloc_buffer((UNROLL * HEAD_VECS,), HEAD_VEC, scope="local")
                            shuffled = T.sblock_alloc_buffer((1,), HEAD_VEC, scope="local")
                            state = T.sblock_alloc_buffer((4 * HEAD_VECS,), HEAD_VEC, scope="local")  # m, d, new m, rescale
                            acc = T.sblock_alloc_buffer((OUT_PER_THREAD,), HEAD_VEC, scope="local")
                            row_at = T.sblock_alloc_buffer((2 * UNROLL,), "int32", scope="local")  # page, slot
                            coords = T.sblock_alloc_buffer((4,), "int32", scope="local")  # b, split, row_begin, row_end

                            lane: T.let[T.int32] = tid % ROW_LANES
                            group: T.let[T.int32] = tid // ROW_LANES
                            # Coordinates in a private array: TVM's simplifier would substitute let-bound
                            # values into every index (a division by num_splits per load), not loads.
                            coords[0] = bs // num_splits if SPLIT else bs
                            coords[1] = bs % num_splits if SPLIT else 0
                            b: T.let[T.int32] = coords[0]
                            split_index: T.let[T.int32] = coords[1]
                            head0: T.let[T.int32] = hx * HEADS
                            # this invocation's lane in its subgroup (exact subgroups, laid out in invocation order)
                            subgroup_lane: T.let[T.int32] = tid % (subgroup_size or ROW_LANES)
                            kv_head: T.let[T.int32] = head0 // GROUP_SIZE
                            indptr_begin: T.let[T.int32] = page_table_indptr[b]
                            kv_len: T.let[T.int32] = kv_len_of(indptr_begin, page_table_indptr[b + 1], b, length_info,
                                                               sliding_window, page_size)
                            chunk_rows: T.let[T.int32] = (T.ceildiv(T.ceildiv(kv_len, page_size), num_splits) * page_size
                                                          if SPLIT else kv_len)
                            coords[2] = T.min(split_index * chunk_rows, kv_len)
                            coords[3] = T.min(coords[2] + chunk_rows, kv_len)
                            row_begin: T.let[T.int32] = coords[2]
                            row_end: T.let[T.int32] = coords[3]

                            # q: each head's share of this lane (RoPE'd when asked), then transposed into
                            # head vectors, pre-scaled so that scores land in the log2 domain.
                            for h in T.unroll(HEAD_VECS * HEAD_LANES):
                                for c in T.unroll(CHUNKS_PER_LANE):
                                    q_heads[h * CHUNKS_PER_LANE + c] = T.if_then_else(
                                        h < HEADS, T.Cast("float32x4", Q[b, head0 + T.min(h, HEADS - 1), lane + c * ROW_LANES]),
                                        T.Broadcast(T.float32(0), VEC))
                            if rotary_mode == 1:  # RoPE pairs stay within a lane: vectors c and c + HALF_CHUNKS
                                for h in T.unroll(HEAD_VECS * HEAD_LANES):
                                    for c in T.unroll(HALF_CHUNKS):
                                        rotate_pair(q_heads, h * CHUNKS_PER_LANE + c, rot, q_rope_position[b], lane + c * ROW_LANES,
                                                    rope_scale, rope_theta)
                            for j in T.unroll(DIMS_PER_LANE):
                                for hv in T.unroll(HEAD_VECS):
                                    q_t[j * HEAD_VECS + hv] = head_vector(q_heads, hv, j) * broadcast(sm_scale * T.float32(LOG2_E), HEAD_LANES)
                                    o_t[j * HEAD_VECS + hv] = broadcast(T.float32(0), HEAD_LANES)
                            for hv in T.unroll(HEAD_VECS):
                                state[M_ + hv] = broadcast(T.float32(MASKED_SCORE), HEAD_LANES)
                                state[D_ + hv] = broadcast(T.float32(0), HEAD_LANES)

                            # The row loop: no barrier; its trip count is uniform over the workgroup. It is
                            # software-pipelined: a trip's K/V rows are loaded during the trip before, and their
                            # page ids two trips ahead, so the loads' latency hides behind arithmetic.
                            locate_rows(row_at, 0, row_begin, row_end, group, b, indptr_begin, page_table_values, length_info)
                            load_rows(k_next, v_next, pages, row_at, kv_head, lane)
                            locate_rows(row_at, 1, row_begin, row_end, group, b, indptr_begin, page_table_values, length_info)
                            for trip in T.serial(T.ceildiv(row_end - row_begin, ROWS_PER_TRIP)):
                                for i in T.unroll(UNROLL * CHUNKS_PER_LANE):
                                    k_rows[i] = k_next[i]
                                    v_rows[i] = v_next[i]
                                load_rows(k_next, v_next, pages, row_at, kv_head, lane)  # trip + 1 (page 0 past the end)
                                locate_rows(row_at, trip + 2, row_begin, row_end, group, b, indptr_begin, page_table_values,
                                            length_info)
                                for u in T.unroll(UNROLL):
                                    for c in T.unroll(CHUNKS_PER_LANE):
                                        k_f32[u * CHUNKS_PER_LANE + c] = T.Cast("float32x4", k_rows[u * CHUNKS_PER_LANE + c])
                                if rotary_mode == 1:
                                    for u in T.unroll(UNROLL):
                                        for c in T.unroll(HALF_CHUNKS):
                                            rotate_pair(k_f32, u * CHUNKS_PER_LANE + c, rot,
                                                        k_rope_pos_offset[b] + row_begin + (trip * UNROLL + u) * ROW_GROUPS + group,
                                                        lane + c * ROW_LANES, rope_scale, rope_theta)
                                # Scores: this lane's partial dots for every head, added up across the row's lanes.
                                for u in T.unroll(UNROLL):
                                    for hv in T.unroll(HEAD_VECS):
                                        score[u * HEAD_VECS + hv] = broadcast(T.float32(0), HEAD_LANES)
                                        for j in T.unroll(DIMS_PER_LANE):
                                            score[u * HEAD_VECS + hv] = score[u * HEAD_VECS + hv] + q_t[j * HEAD_VECS + hv] * broadcast(
                                                T.Shuffle([k_f32[u * CHUNKS_PER_LANE + j // VEC]], [j % VEC]), HEAD_LANES)
                                        if EXACT:  # a butterfly: every lane ends with the row's dot
                                            for k in T.unroll(SHUFFLE_STEPS):
                                                score[u * HEAD_VECS + hv] = score[u * HEAD_VECS + hv] + T.webgpu.subgroup_shuffle(
                                                    score[u * HEAD_VECS + hv], T.Cast("uint32", T.bitwise_xor(subgroup_lane, 1 << k)))
                                        else:
                                            for k in T.unroll(SHUFFLE_STEPS):  # lane 0 ends with the row's dot ...
                                                score[u * HEAD_VECS + hv] = score[u * HEAD_VECS + hv] + T.webgpu.subgroup_shuffle_down(
                                                    score[u * HEAD_VECS + hv], T.uint32(ROW_LANES // 2) >> T.uint32(k))
                                            for k in T.unroll(SHUFFLE_STEPS):  # ... and hands it on, doubling the lanes that have it
                                                shuffled[0] = T.webgpu.subgroup_shuffle_up(score[u * HEAD_VECS + hv], T.uint32(1) << T.uint32(k))
                                                if lane >= (1 << k):
                                                    score[u * HEAD_VECS + hv] = shuffled[0]
                                        if row_begin + (trip * UNROLL + u) * ROW_GROUPS + group >= row_end:
                                            score[u * HEAD_VECS + hv] = broadcast(T.float32(MASKED_ROW), HEAD_LANES)
                                # Online softmax over the trip's UNROLL rows, on head vectors.
                                for hv in T.unroll(HEAD_VECS):
                                    state[NEW_M + hv] = state[M_ + hv]
                                    for u in T.unroll(UNROLL):
                                        state[NEW_M + hv] = T.max(state[NEW_M + hv], score[u * HEAD_VECS + hv])
                                    state[RESCALE + hv] = T.exp2(state[M_ + hv] - state[NEW_M + hv])
                                    state[M_ + hv] = state[NEW_M + hv]
                                    state[D_ + hv] = state[D_ + hv] * state[RESCALE + hv]
                                    for u in T.unroll(UNROLL):
                                        score[u * HEAD_VECS + hv] = T.exp2(score[u * HEAD_VECS + hv] - state[M_ + hv])
                                        state[D_ + hv] = state[D_ + hv] + score[u * HEAD_VECS + hv]
                                    for j in T.unroll(DIMS_PER_LANE):
                                        o_t[j * HEAD_VECS + hv] = o_t[j * HEAD_VECS + hv] * state[RESCALE + hv]
                                        for u in T.unroll(UNROLL):
                                            o_t[j * HEAD_VECS + hv] = o_t[j * HEAD_VECS + hv] + score[u * HEAD_VECS + hv] * broadcast(
                                                T.Cast("float32", T.Shuffle([v_rows[u * CHUNKS_PER_LANE + j // VEC]], [j % VEC])), HEAD_LANES)

                            # With exact subgroups, the row groups of a subgroup first merge their states
                            # (max, denominator, O) pairwise with shuffles; the first group of each
                            # subgroup then holds the subgroup's state.
                            for k in T.unroll(PRE_MERGE_STEPS):
                                for hv in T.unroll(HEAD_VECS):
                                    partner[0] = T.webgpu.subgroup_shuffle(state[M_ + hv], T.Cast(
                                        "uint32", T.bitwise_xor(subgroup_lane, ROW_LANES << k)))
                                    partner[1] = T.webgpu.subgroup_shuffle(state[D_ + hv], T.Cast(
                                        "uint32", T.bitwise_xor(subgroup_lane, ROW_LANES << k)))
                                    state[NEW_M + hv] = T.max(state[M_ + hv], partner[0])
                                    state[RESCALE + hv] = T.exp2(state[M_ + hv] - state[NEW_M + hv])
                                    partner[2] = T.exp2(partner[0] - state[NEW_M + hv])
                                    state[D_ + hv] = state[D_ + hv] * state[RESCALE + hv] + partner[1] * partner[2]
                                    for j in T.unroll(DIMS_PER_LANE):
                                        o_t[j * HEAD_VECS + hv] = o_t[j * HEAD_VECS + hv] * state[RESCALE + hv] + T.webgpu.subgroup_shuffle(
                                            o_t[j * HEAD_VECS + hv], T.Cast("uint32", T.bitwise_xor(subgroup_lane, ROW_LANES << k))) * partner[2]
                                    state[M_ + hv] = state[NEW_M + hv]
                            # Merge the (remaining) row groups' states: the max M and denominator of the range ...
                            if lane == 0 and group % GROUPS_PER_SUBGROUP == 0:
                                for hv in T.unroll(HEAD_VECS):
                                    stat_max[(group // GROUPS_PER_SUBGROUP) * HEAD_VECS + hv] = state[M_ + hv]
                                    stat_sum[(group // GROUPS_PER_SUBGROUP) * HEAD_VECS + hv] = state[D_ + hv]
                            for hv in T.unroll(HEAD_VECS):
                                state[NEW_M + hv] = broadcast(T.float32(MASKED_SCORE), HEAD_LANES)
                                for g in T.serial(MERGE_GROUPS):
                                    state[NEW_M + hv] = T.max(state[NEW_M + hv], stat_max[g * HEAD_VECS + hv])
                                state[RESCALE + hv] = broadcast(T.float32(0), HEAD_LANES)  # here: the summed denominator
                                for g in T.serial(MERGE_GROUPS):
                                    state[RESCALE + hv] = state[RESCALE + hv] + stat_sum[g * HEAD_VECS + hv] * T.exp2(
                                        stat_max[g * HEAD_VECS + hv] - state[NEW_M + hv])
                                state[M_ + hv] = T.exp2(state[M_ + hv] - state[NEW_M + hv])  # this group's share
                                for j in T.unroll(DIMS_PER_LANE):
                                    o_t[j * HEAD_VECS + hv] = o_t[j * HEAD_VECS + hv] * state[M_ + hv]
                            # ... then O, GROUPS_PER_ROUND groups per round through the stage.
                            for o in T.unroll(OUT_PER_THREAD):
                                acc[o] = broadcast(T.float32(0), HEAD_LANES)
                            for r in T.serial(ROUNDS):
                                if group % GROUPS_PER_SUBGROUP == 0 and (group // GROUPS_PER_SUBGROUP) // GROUPS_PER_ROUND == r:
                                    for j in T.unroll(DIMS_PER_LANE):
                                        for hv in T.unroll(HEAD_VECS):
                                            o_stage[(((group // GROUPS_PER_SUBGROUP) % GROUPS_PER_ROUND) * HEAD_VECS + hv) * D
                                                    + vec_index(lane, j) * VEC + j % VEC] = o_t[j * HEAD_VECS + hv]
                                for o in T.unroll(OUT_PER_THREAD):
                                    if tid + o * INVOCATIONS < OUT_SLOTS:
                                        for k in T.unroll(GROUPS_PER_ROUND):
                                            acc[o] = acc[o] + o_stage[k * HEAD_VECS * D + tid + o * INVOCATIONS]
                            # Thread (head vector hv, dim d) writes dim d of its heads.
                            for o in T.unroll(OUT_PER_THREAD):
                                out_slot: T.let[T.int32] = tid + o * INVOCATIONS
                                if out_slot < OUT_SLOTS:
                                    for hv in T.unroll(HEAD_VECS):
                                        if out_slot // D == hv:
                                            for i in T.unroll(HEAD_LANES):
                                                if hv * HEAD_LANES + i < HEADS:
                                                    if SPLIT:
                                                        partial_o[b, head0 + hv * HEAD_LANES + i, split_index, out_slot % D] = lane_of(acc[o], i, HEAD_LANES)
                                                        if out_slot % D == 0:
                                                            partial_stats[b, head0 + hv * HEAD_LANES + i, split_index, 0] = lane_of(state[NEW_M + hv], i, HEAD_LANES)
                                                            partial_stats[b, head0 + hv * HEAD_LANES + i, split_index, 1] = lane_of(state[RESCALE + hv], i, HEAD_LANES)
                                                    else:
                                                        output[b, head0 + hv * HEAD_LANES + i, out_slot % D] = T.Cast(
                                                            dtype, lane_of(acc[o], i, HEAD_LANES) / denominator(lane_of(state[RESCALE + hv], i, HEAD_LANES)))
                                                        if out_slot % D == 0:
                                                            lse[b, head0 + hv * HEAD_LANES + i] = lane_of(state[NEW_M + hv], i, HEAD_LANES) + T.log2(
                                                                denominator(lane_of(state[RESCALE + hv], i, HEAD_LANES)))
    # fmt: on
    return decode_subgroup
