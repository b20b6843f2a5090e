"""Causal paged prefill attention: a chunk of new tokens attends to the cached prefix and to itself.

Inputs: q[n, H_qo, D] (RoPE applied at append, like K), the layer's pages (kernels.paged_kv layout,
the chunk's own K/V already appended), page_ids[used_pages] (the sequence's pages in order) and three
scalars: `start`, the tokens cached before the chunk (token i of the chunk sits at position
start + i and sees positions 0 .. start + i), sm_scale and `window` (0: the whole causal prefix; W > 0:
a sliding window, token i sees only positions start + i - W + 1 .. start + i). Output:
output[n, H_qo, D]. Prefill needs no lse (nothing merges it), and a prompt is one sequence, so there
is no batch axis.

FlashAttention-2 in WebGPU's default limits (256 invocations, 16 KiB of workgroup storage):

    grid (ceil(n * G / ROWS), H_kv)     G = H_qo / H_kv query heads per KV head
    tid in [0, 256): row = row_block * ROWS + tid // ROW_LANES, lane = tid % ROW_LANES

- A workgroup owns ROWS = 64 query rows of one KV head; row r is (token r // G, head r % G), so the
  K/V tile it stages serves the whole GQA group, and its rows are consecutive tokens.
- A row's ROW_LANES threads split its keys (KEY_LANES key lanes) and, above head_dim 128, its dims
  too (DIM_PARTS of D / DIM_PARTS each), so that a thread keeps at most 32 vectors of q and of O.
- K/V come in tiles of TILE_KEYS positions (two pages at head_dim 64 in f16), staged in workgroup
  memory once for all 64 rows, in `dtype` (f16 halves the bytes each read moves: the bound, see below).
  Vector c of key k sits at k * D/4 + (c XOR k % ROW_LANES):
  the lanes that read vector c of their keys at the same time hit different banks. The tile loop
  runs from the tile of the workgroup's first window start (tile 0 without a window: whole tiles
  below every row's window are never loaded, so a windowed layer costs O(n * window)) to the
  workgroup's last query position (tiles above the diagonal are never loaded), and is
  software-pipelined: tile t + 1 is read into registers while tile t is computed.
- A thread keeps its row's q (pre-scaled by sm_scale * log2 e: scores in the log2 domain) and O
  (its dims of them) in float32x4 registers and runs its own online softmax over the tile's keys
  j * KEY_LANES + key_lane: its KEYS_PER_LANE q.k dots advance together (independent FMA chains, one
  K vector read per FMA), and the tile's max rescales O once (FlashAttention-2's deferred rescale).
  With the dims split, the parts' partial dots meet through workgroup memory (one f32x4 a thread)
  and every part adds them in the same order, so the parts of a row run the same softmax.
- At the end the KEY_LANES states of a row (part) merge: (max, denominator) through workgroup memory,
  then O one 4-dim column per round, written by one lane of the part.

Workgroup storage: the K and V tiles (2 * TILE_KEYS * D/4 vectors of `dtype`) and the merge's
statistics and O stage (2 * 256 f32x4, 8 KiB; with the dims split, the partial dots in the tile
loop): 16 KiB. Each K/V vector read from workgroup memory feeds one vector FMA, so on a GPU the
kernel is bound by workgroup-memory bandwidth, not FMA. (Two rows a thread would read each K/V vector
once for both, but their q and O no longer fit the registers; hence the dims split above head_dim 128,
not 64 vectors of q and O a thread.)
"""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.paged_kv import LOG2_E, MASKED_ROW, MASKED_SCORE, VEC, lane_sum
from contract.kernels import MAX_INVOCATIONS, PAGE_SIZE, WORKGROUP_STORAGE_BYTES
from contract.model import DTYPE_BYTES

ROWS = 64  # query rows (token, head) per workgroup
ROW_LANES = MAX_INVOCATIONS // ROWS  # threads per row: KEY_LANES over its keys x DIM_PARTS over its dims
THREAD_VECTORS = 32  # f32x4 vectors of q (and as many of O) a thread keeps in registers at most
MAX_DIM_PARTS = 2  # head_dim up to 256
VEC_BYTES = 16  # an f32x4 in workgroup memory


def dim_parts(head_dim: int) -> int:
    """How many threads of a row split its dims: 1 up to head_dim 128, 2 above (at most 256)."""
    cols = head_dim // VEC
    parts = -(-cols // THREAD_VECTORS)
    if head_dim % VEC or parts > MAX_DIM_PARTS or cols % parts:
        raise ValueError(f"prefill attention keeps D / 4 vectors of q and O per row in at most {MAX_DIM_PARTS} "
                         f"threads' registers ({THREAD_VECTORS} each): head_dim {head_dim} must be a multiple of 4 "
                         f"(of 8 above 128), at most {MAX_DIM_PARTS * THREAD_VECTORS * VEC}")
    return parts


def prefill_layout(head_dim: int, dtype: str, page_size: int = PAGE_SIZE) -> dict:
    """The largest K/V tile (keys) whose K and V (in `dtype`) fit the default 16 KiB beside the
    merge's stage, and the storage it takes."""
    parts = dim_parts(head_dim)
    cols, key_lanes = head_dim // VEC, ROW_LANES // parts
    for tile_keys in (32, 16, 8, 4):
        storage = 2 * tile_keys * cols * VEC * DTYPE_BYTES[dtype] + 2 * MAX_INVOCATIONS * VEC_BYTES
        whole_pages = tile_keys % page_size == 0 or page_size % tile_keys == 0
        # with the dims split, a thread's partial dots of a tile travel as one f32x4
        exchange_fits = parts == 1 or tile_keys // key_lanes <= VEC
        if whole_pages and tile_keys % key_lanes == 0 and exchange_fits and storage <= WORKGROUP_STORAGE_BYTES:
            return {"tile_keys": tile_keys, "workgroup_storage": storage}
    raise ValueError(f"no K/V tile of head_dim {head_dim} fits {WORKGROUP_STORAGE_BYTES} bytes")


def prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int = PAGE_SIZE):
    """The causal paged prefill attention PrimFunc of one shape (see the module docstring)."""
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    G = H_qo // H_kv
    COLS = D // VEC  # f32x4 vectors per q, K, V or O row
    DIM_PARTS = dim_parts(D)
    PART_COLS = COLS // DIM_PARTS  # the vectors of q and O a thread keeps
    KEY_LANES = ROW_LANES // DIM_PARTS
    TILE_KEYS = prefill_layout(D, dtype, page_size)["tile_keys"]
    KEYS_PER_LANE = TILE_KEYS // KEY_LANES
    TILE_VECTORS = TILE_KEYS * COLS  # of K (and as many of V) per tile
    STAGE_TRIPS = (2 * TILE_VECTORS + MAX_INVOCATIONS - 1) // MAX_INVOCATIONS
    VEC_DTYPE = f"{dtype}x{VEC}"
    # the one workgroup array: K and V tiles in the loop; every thread's statistics, then O stage, after it
    K_AT, V_AT = 0, TILE_VECTORS
    STATE_AT, STAGE_AT = 0, MAX_INVOCATIONS  # the partial dots (dims split) go where the statistics go later
    assert H_qo % H_kv == 0 and (DIM_PARTS == 1 or KEYS_PER_LANE <= VEC)

    def tile_slot(key, c):
        """Where vector c of a tile's key lives (XOR-swizzled by the lane that reads the key)."""
        return key * COLS + T.bitwise_xor(c, key % ROW_LANES)

    def packed_dots(dot):
        """This thread's KEYS_PER_LANE (at most 4) partial dots as one f32x4 (repeated to fill it)."""
        return T.Shuffle([T.Broadcast(lane_sum(dot[j]), 2) for j in range(KEYS_PER_LANE)],
                         [2 * (i % KEYS_PER_LANE) for i in range(VEC)])

    @T.macro
    def fetch_tile(staged, pages, page_ids, tile, tid, kv_head):
        """This thread's share of a tile's K and V vectors, from the pages into registers: element
        e = trip * 256 + tid is K (e < TILE_VECTORS) or V, of key e % TILE_VECTORS // COLS, vector e % COLS."""
        for trip in T.unroll(STAGE_TRIPS):
            if trip * MAX_INVOCATIONS + tid < 2 * TILE_VECTORS:
                staged[trip] = pages[page_ids[(tile * TILE_KEYS + (trip * MAX_INVOCATIONS + tid) % TILE_VECTORS // COLS)
                                              // page_size],
                                     (trip * MAX_INVOCATIONS + tid) // TILE_VECTORS, kv_head,
                                     (tile * TILE_KEYS + (trip * MAX_INVOCATIONS + tid) % TILE_VECTORS // COLS) % page_size,
                                     (trip * MAX_INVOCATIONS + tid) % COLS]

    @T.prim_func(s_tir=True)
    def prefill(q_handle: T.handle, pages_handle: T.handle, page_ids_handle: T.handle, out_handle: T.handle,
                start: T.int32, sm_scale: T.float32, window: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        num_pages = T.int32()
        used_pages = T.int32()
        q = T.match_buffer(q_handle, (n, H_qo, COLS), VEC_DTYPE)  # same bytes as [n, H_qo, D]
        pages = T.match_buffer(pages_handle, (num_pages, 2, H_kv, page_size, COLS), VEC_DTYPE)
        page_ids = T.match_buffer(page_ids_handle, (used_pages,), "int32")
        output = T.match_buffer(out_handle, (n, H_qo, COLS), VEC_DTYPE)
        for row_block in T.thread_binding(T.ceildiv(n * G, ROWS), thread="blockIdx.x"):
            for kv_head in T.thread_binding(H_kv, thread="blockIdx.y"):
                for tid in T.thread_binding(MAX_INVOCATIONS, thread="threadIdx.x"):
                    with T.sblock("prefill_attention"):
                        T.reads()  # a scheduled kernel: skip region inference over let-bound indices
                        T.writes()
                        tiles_mem = T.sblock_alloc_buffer((2 * TILE_VECTORS,), VEC_DTYPE, scope="shared")
                        smem = T.sblock_alloc_buffer((2 * MAX_INVOCATIONS,), "float32x4", scope="shared")
                        q_reg = T.sblock_alloc_buffer((PART_COLS,), "float32x4", scope="local")
                        o_reg = T.sblock_alloc_buffer((PART_COLS,), "float32x4", scope="local")
                        staged = T.sblock_alloc_buffer((STAGE_TRIPS,), VEC_DTYPE, scope="local")  # the next tile
                        dot = T.sblock_alloc_buffer((KEYS_PER_LANE,), "float32x4", scope="local")
                        score = T.sblock_alloc_buffer((KEYS_PER_LANE,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                        # m, denominator, the tile's new max, O's rescale; then the row's max and sum
                        state = T.sblock_alloc_buffer((6,), "float32", scope="local")

                        lane: T.let[T.int32] = tid % ROW_LANES
                        part: T.let[T.int32] = lane // KEY_LANES  # which D / DIM_PARTS dims of the row
                        key_lane: T.let[T.int32] = lane % KEY_LANES
                        row: T.let[T.int32] = row_block * ROWS + tid // ROW_LANES
                        # rows past the chunk compute a copy of its last token and write nothing
                        token: T.let[T.int32] = T.min(row // G, n - 1)
                        head: T.let[T.int32] = kv_head * G + row % G
                        kv_len: T.let[T.int32] = start + n
                        position: T.let[T.int32] = start + token
                        # the row's first key (its window's start; may be negative)
                        lowest: T.let[T.int32] = T.Select(window > 0, position - window + 1, 0)
                        block_last_token: T.let[T.int32] = T.min((row_block * ROWS + ROWS - 1) // G, n - 1)
                        # the tile of the workgroup's first row's window start: every tile below it is masked for every row
                        first_tile: T.let[T.int32] = T.Select(
                            window > 0, T.max(start + row_block * ROWS // G - window + 1, 0), 0) // TILE_KEYS
                        tiles: T.let[T.int32] = T.ceildiv(start + block_last_token + 1, TILE_KEYS)

                        for c in T.unroll(PART_COLS):
                            q_reg[c] = T.Cast("float32x4", q[token, head, part * PART_COLS + c]) * T.Broadcast(
                                sm_scale * T.float32(LOG2_E), VEC)
                            o_reg[c] = T.Broadcast(T.float32(0), VEC)
                        state[0] = T.float32(MASKED_SCORE)
                        state[1] = T.float32(0)

                        fetch_tile(staged, pages, page_ids, first_tile, tid, kv_head)
                        for step in T.serial(tiles - first_tile):
                            tile: T.let[T.int32] = first_tile + step
                            key0: T.let[T.int32] = tile * TILE_KEYS
                            # Stage the tile as f32 (V past the context as 0, so a stale slot can never
                            # reach O, even times a zero weight), then start reading the next one.
                            for trip in T.unroll(STAGE_TRIPS):
                                e: T.let[T.int32] = trip * MAX_INVOCATIONS + tid
                                if e < 2 * TILE_VECTORS:
                                    key: T.let[T.int32] = e % TILE_VECTORS // COLS
                                    c: T.let[T.int32] = e % COLS
                                    if e < TILE_VECTORS:
                                        tiles_mem[K_AT + tile_slot(key, c)] = staged[trip]
                                    else:
                                        tiles_mem[V_AT + tile_slot(key, c)] = T.if_then_else(
                                            key0 + key < kv_len, staged[trip], T.Broadcast(T.Cast(dtype, 0), VEC))
                            if tile + 1 < tiles:
                                fetch_tile(staged, pages, page_ids, tile + 1, tid, kv_head)
                            # Scores of this lane's keys j * KEY_LANES + key_lane, masked above the
                            # diagonal and below the row's window.
                            for j in T.unroll(KEYS_PER_LANE):
                                dot[j] = T.Broadcast(T.float32(0), VEC)
                            for c in T.unroll(PART_COLS):
                                for j in T.unroll(KEYS_PER_LANE):
                                    dot[j] = dot[j] + q_reg[c] * T.Cast(
                                        "float32x4", tiles_mem[K_AT + tile_slot(j * KEY_LANES + key_lane, part * PART_COLS + c)])
                            if DIM_PARTS == 1:
                                for j in T.unroll(KEYS_PER_LANE):
                                    score[j] = lane_sum(dot[j])
                            else:
                                # each part's partial dots through workgroup memory, added in part order by every part
                                smem[STATE_AT + tid] = packed_dots(dot)
                                for j in T.unroll(KEYS_PER_LANE):
                                    score[j] = T.Shuffle([smem[STATE_AT + tid - lane + key_lane]], [j])
                                    for p in T.unroll(1, DIM_PARTS):
                                        score[j] = score[j] + T.Shuffle([smem[STATE_AT + tid - lane + p * KEY_LANES + key_lane]], [j])
                            for j in T.unroll(KEYS_PER_LANE):
                                score[j] = T.if_then_else((key0 + j * KEY_LANES + key_lane <= position)
                                                          & (key0 + j * KEY_LANES + key_lane >= lowest),
                                                          score[j], T.float32(MASKED_ROW))
                            # Online softmax: one rescale of O per tile.
                            state[2] = state[0]
                            for j in T.unroll(KEYS_PER_LANE):
                                state[2] = T.max(state[2], score[j])
                            state[3] = T.exp2(state[0] - state[2])
                            state[1] = state[1] * state[3]
                            state[0] = state[2]
                            for j in T.unroll(KEYS_PER_LANE):
                                score[j] = T.exp2(score[j] - state[0])
                                state[1] = state[1] + score[j]
                            for c in T.unroll(PART_COLS):
                                acc[0] = o_reg[c] * T.Broadcast(state[3], VEC)
                                for j in T.unroll(KEYS_PER_LANE):
                                    acc[0] = acc[0] + T.Broadcast(score[j], VEC) * T.Cast(
                                        "float32x4", tiles_mem[V_AT + tile_slot(j * KEY_LANES + key_lane, part * PART_COLS + c)])
                                o_reg[c] = acc[0]

                        # Merge the KEY_LANES states of the row's part. The lane that saw the row's own
                        # position makes the denominator positive; a lane that saw no key has max -5e4
                        # and weight 0.
                        smem[STATE_AT + tid] = T.Shuffle([T.Broadcast(state[0], 2), T.Broadcast(state[1], 2)], [0, 2, 0, 2])
                        state[4] = T.float32(MASKED_SCORE)
                        for l in T.unroll(KEY_LANES):
                            state[4] = T.max(state[4], T.Shuffle([smem[STATE_AT + tid - key_lane + l]], [0]))
                        state[5] = T.float32(0)
                        for l in T.unroll(KEY_LANES):
                            state[5] = state[5] + T.Shuffle([smem[STATE_AT + tid - key_lane + l]], [1]) * T.exp2(
                                T.Shuffle([smem[STATE_AT + tid - key_lane + l]], [0]) - state[4])
                        state[3] = T.exp2(state[0] - state[4]) / state[5]
                        for c in T.unroll(PART_COLS):
                            smem[STAGE_AT + tid] = o_reg[c] * T.Broadcast(state[3], VEC)
                            if (key_lane == c % KEY_LANES) & (row < n * G):
                                acc[0] = smem[STAGE_AT + tid - key_lane]
                                for l in T.unroll(1, KEY_LANES):
                                    acc[0] = acc[0] + smem[STAGE_AT + tid - key_lane + l]
                                output[token, head, part * PART_COLS + c] = T.Cast(VEC_DTYPE, acc[0])

    return prefill
