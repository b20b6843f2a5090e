"""The token choice on the GPU: the argmax over the head's per-group bests, and top-k / top-p sampling."""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.llama_common import THREADS


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
