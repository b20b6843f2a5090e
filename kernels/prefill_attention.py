"""Causal paged prefill attention: a chunk of new tokens attends to the cached prefix and to itself.

Inputs: q[n, H_qo, D] (RoPE applied at append, like K), the layer's pages (kernels.paged_kv layout,
the chunk's own K/V already appended), page_ids[used_pages] (the sequence's pages in order) and two
scalars: `start`, the tokens cached before the chunk (token i of the chunk sits at position
start + i and sees positions 0 .. start + i), and sm_scale. Output: output[n, H_qo, D]. Prefill needs
no lse (nothing merges it), and a prompt is one sequence, so there is no batch axis.

FlashAttention-2 in WebGPU's default limits (256 invocations, 16 KiB of workgroup storage):

    grid (ceil(n * G / ROWS), H_kv)     G = H_qo / H_kv query heads per KV head
    tid in [0, 256): row = row_block * ROWS + tid // KEY_LANES, lane = tid % KEY_LANES

- A workgroup owns ROWS = 64 query rows of one KV head; row r is (token r // G, head r % G), so the
  K/V tile it stages serves the whole GQA group, and its rows are consecutive tokens.
- K/V come in tiles of TILE_KEYS positions (two pages at head_dim 64 in f16), staged in workgroup
  memory once for all 64 rows, in `dtype` (f16 halves the bytes each read moves: the bound, see below).
  Vector c of key k sits at k * D/4 + (c XOR k % KEY_LANES):
  the KEY_LANES lanes that read vector c of their keys at the same time hit different banks. The
  tile loop stops at the workgroup's last query position (tiles above the diagonal are never
  loaded) and is software-pipelined: tile t + 1 is read into registers while tile t is computed.
- A thread keeps its row's q (pre-scaled by sm_scale * log2 e: scores in the log2 domain) and O in
  float32x4 registers and runs its own online softmax over the tile's keys j * KEY_LANES + lane: its
  KEYS_PER_LANE q.k dots advance together (independent FMA chains, one K vector read per FMA), and
  the tile's max rescales O once (FlashAttention-2's deferred rescale).
- At the end the KEY_LANES states of a row merge: (max, denominator) through workgroup memory, then
  O one 4-dim column per round, written by one lane of the row.

Workgroup storage: the K and V tiles (2 * TILE_KEYS * D/4 vectors of `dtype`) and the merge's
statistics and O stage (2 * 256 f32x4, 8 KiB): 16 KiB. Each K/V vector read from workgroup memory
feeds one vector FMA, so on a GPU the kernel is bound by workgroup-memory bandwidth, not FMA.
(Holding two rows a thread, to read each K/V vector once for both, measured slower on the H200:
their q and O no longer fit the registers.)
"""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.paged_kv import LOG2_E, MASKED_ROW, MASKED_SCORE, VEC, lane_sum
from contract.kernels import MAX_INVOCATIONS, PAGE_SIZE, WORKGROUP_STORAGE_BYTES
from contract.model import DTYPE_BYTES

ROWS = 64  # query rows (token, head) per workgroup
KEY_LANES = MAX_INVOCATIONS // ROWS  # threads per row, each over every KEY_LANES-th key of a tile
VEC_BYTES = 16  # an f32x4 in workgroup memory


def prefill_layout(head_dim: int, dtype: str, page_size: int = PAGE_SIZE) -> dict:
    """The largest K/V tile (keys) whose K and V (in `dtype`) fit the default 16 KiB beside the
    merge's stage, and the storage it takes."""
    if head_dim % VEC or head_dim // VEC > 32:
        raise ValueError(f"prefill attention keeps D / 4 vectors of q and O per thread in registers: head_dim "
                         f"{head_dim} must be a multiple of 4, at most 128")
    cols = head_dim // VEC
    for tile_keys in (32, 16, 8, 4):
        storage = 2 * tile_keys * cols * VEC * DTYPE_BYTES[dtype] + 2 * MAX_INVOCATIONS * VEC_BYTES
        whole_pages = tile_keys % page_size == 0 or page_size % tile_keys == 0
        if whole_pages and tile_keys % KEY_LANES == 0 and storage <= WORKGROUP_STORAGE_BYTES:
            return {"tile_keys": tile_keys, "workgroup_storage": storage}
    raise ValueError(f"no K/V tile of head_dim {head_dim} fits {WORKGROUP_STORAGE_BYTES} bytes")


def prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int = PAGE_SIZE):
    """The causal paged prefill attention PrimFunc of one shape (see the module docstring)."""
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    G = H_qo // H_kv
    COLS = D // VEC  # f32x4 vectors per q, K, V or O row
    TILE_KEYS = prefill_layout(D, dtype, page_size)["tile_keys"]
    KEYS_PER_LANE = TILE_KEYS // KEY_LANES
    TILE_VECTORS = TILE_KEYS * COLS  # of K (and as many of V) per tile
    STAGE_TRIPS = (2 * TILE_VECTORS + MAX_INVOCATIONS - 1) // MAX_INVOCATIONS
    VEC_DTYPE = f"{dtype}x{VEC}"
    # the one workgroup array: K and V tiles in the loop; every thread's statistics, then O stage, after it
    K_AT, V_AT = 0, TILE_VECTORS
    STATE_AT, STAGE_AT = 0, MAX_INVOCATIONS
    assert H_qo % H_kv == 0

    def tile_slot(key, c):
        """Where vector c of a tile's key lives (XOR-swizzled by the lane that reads the key)."""
        return key * COLS + T.bitwise_xor(c, key % KEY_LANES)

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
                start: T.int32, sm_scale: T.float32):
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
                        q_reg = T.sblock_alloc_buffer((COLS,), "float32x4", scope="local")
                        o_reg = T.sblock_alloc_buffer((COLS,), "float32x4", scope="local")
                        staged = T.sblock_alloc_buffer((STAGE_TRIPS,), VEC_DTYPE, scope="local")  # the next tile
                        dot = T.sblock_alloc_buffer((KEYS_PER_LANE,), "float32x4", scope="local")
                        score = T.sblock_alloc_buffer((KEYS_PER_LANE,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                        # m, denominator, the tile's new max, O's rescale; then the row's max and sum
                        state = T.sblock_alloc_buffer((6,), "float32", scope="local")

                        lane: T.let[T.int32] = tid % KEY_LANES
                        row: T.let[T.int32] = row_block * ROWS + tid // KEY_LANES
                        # rows past the chunk compute a copy of its last token and write nothing
                        token: T.let[T.int32] = T.min(row // G, n - 1)
                        head: T.let[T.int32] = kv_head * G + row % G
                        kv_len: T.let[T.int32] = start + n
                        block_last_token: T.let[T.int32] = T.min((row_block * ROWS + ROWS - 1) // G, n - 1)
                        tiles: T.let[T.int32] = T.ceildiv(start + block_last_token + 1, TILE_KEYS)

                        for c in T.unroll(COLS):
                            q_reg[c] = T.Cast("float32x4", q[token, head, c]) * T.Broadcast(sm_scale * T.float32(LOG2_E), VEC)
                            o_reg[c] = T.Broadcast(T.float32(0), VEC)
                        state[0] = T.float32(MASKED_SCORE)
                        state[1] = T.float32(0)

                        fetch_tile(staged, pages, page_ids, 0, tid, kv_head)
                        for tile in T.serial(tiles):
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
                            # Scores of this lane's keys j * KEY_LANES + lane, masked above the diagonal.
                            for j in T.unroll(KEYS_PER_LANE):
                                dot[j] = T.Broadcast(T.float32(0), VEC)
                            for c in T.unroll(COLS):
                                for j in T.unroll(KEYS_PER_LANE):
                                    dot[j] = dot[j] + q_reg[c] * T.Cast("float32x4", tiles_mem[K_AT + tile_slot(j * KEY_LANES + lane, c)])
                            for j in T.unroll(KEYS_PER_LANE):
                                score[j] = T.if_then_else(key0 + j * KEY_LANES + lane <= start + token, lane_sum(dot[j]),
                                                          T.float32(MASKED_ROW))
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
                            for c in T.unroll(COLS):
                                acc[0] = o_reg[c] * T.Broadcast(state[3], VEC)
                                for j in T.unroll(KEYS_PER_LANE):
                                    acc[0] = acc[0] + T.Broadcast(score[j], VEC) * T.Cast("float32x4", tiles_mem[V_AT + tile_slot(j * KEY_LANES + lane, c)])
                                o_reg[c] = acc[0]

                        # Merge the row's KEY_LANES states. Lane 0 saw position 0, so the row's
                        # denominator is positive; a lane that saw no key has max -5e4 and weight 0.
                        smem[STATE_AT + tid] = T.Shuffle([T.Broadcast(state[0], 2), T.Broadcast(state[1], 2)], [0, 2, 0, 2])
                        state[4] = T.float32(MASKED_SCORE)
                        for l in T.unroll(KEY_LANES):
                            state[4] = T.max(state[4], T.Shuffle([smem[STATE_AT + tid - lane + l]], [0]))
                        state[5] = T.float32(0)
                        for l in T.unroll(KEY_LANES):
                            state[5] = state[5] + T.Shuffle([smem[STATE_AT + tid - lane + l]], [1]) * T.exp2(
                                T.Shuffle([smem[STATE_AT + tid - lane + l]], [0]) - state[4])
                        state[3] = T.exp2(state[0] - state[4]) / state[5]
                        for c in T.unroll(COLS):
                            smem[STAGE_AT + tid] = o_reg[c] * T.Broadcast(state[3], VEC)
                            if (lane == c % KEY_LANES) & (row < n * G):
                                acc[0] = smem[STAGE_AT + tid - lane]
                                for l in T.unroll(1, KEY_LANES):
                                    acc[0] = acc[0] + smem[STAGE_AT + tid - lane + l]
                                output[token, head, c] = T.Cast(VEC_DTYPE, acc[0])

    return prefill
