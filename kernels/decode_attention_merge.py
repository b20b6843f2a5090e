"""The merge after a split sharded-family call: output and lse from the num_splits partial states.

    output[b, h] = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) d_s  with M = max_s m_s
    lse[b, h]    = M + log2(denominator)

the contract every decode nest keeps (an empty context gives output 0 and lse -5e4). The partial
states come from kernels.decode_attention_sharded or kernels.decode_attention_subgroup with
`split=True`: partial_o f32 [B, H_qo, S, D] (bound here as f32x4) and partial_stats f32 [B, H_qo, S, 2].
"""

from __future__ import annotations

from tvm.script import tirx as T

from kernels.paged_kv import MASKED_SCORE, VEC
from contract.kernels import MAX_INVOCATIONS as WORKGROUP_INVOCATIONS

STATS = 2  # partial_stats[..., 0] = max, [..., 1] = denominator
MERGE_UNROLL = 8  # splits whose loads are issued together


def decode_attention_merge(num_qo_heads, head_dim, dtype):
    """threadIdx.x = 4-dim chunk of the head (D / 4), threadIdx.y = head within MERGE_HEADS; grid
    (H_qo / MERGE_HEADS, B). Every thread folds the S states of its chunk into one
    (`merge_split_states`). No workgroup storage, no barrier.
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
    def decode_merge(
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
                        with T.sblock("decode_merge"):
                            T.reads()
                            T.writes()
                            stat = T.sblock_alloc_buffer((2,), "float32", scope="local")  # M, denominator
                            o_acc = T.sblock_alloc_buffer((1,), "float32x4", scope="local")
                            split_max = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                            split_sum = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
                            split_o = T.sblock_alloc_buffer((MERGE_UNROLL,), "float32x4", scope="local")
                            h: T.let[T.int32] = hx * MERGE_HEADS + hy
                            merge_split_states(partial_o, partial_stats, b, h, c, num_splits, stat, o_acc,
                                               split_max, split_sum, split_o)
                            # An empty context gives output 0 and lse -5e4, as every decode kernel does.
                            denom: T.let[T.float32] = T.if_then_else(stat[1] > T.float32(0), stat[1], T.float32(1))
                            output[b, h, c] = T.Cast(VEC_DTYPE, o_acc[0] / T.Broadcast(denom, VEC))
                            if c == 0:
                                lse[b, h] = stat[0] + T.log2(denom)
    # fmt: on
    return decode_merge


@T.macro
def merge_split_states(partial_o, partial_stats, b, h, c, num_splits, stat, o_acc, split_max, split_sum, split_o):
    """Fold the num_splits partial states of 4-wide chunk c of head h of sequence b into stat (M,
    denominator) and o_acc (O, not yet divided): an online softmax over splits, MERGE_UNROLL splits
    per step with their loads issued together (an index past S is clamped to S - 1 and its weight
    set to 0, so no load waits on a branch). split_max, split_sum and split_o are the caller's
    local (MERGE_UNROLL,) f32, f32, f32x4 buffers. Also the merging o-projection's (kernels.decode_matmul)."""
    stat[0] = T.float32(MASKED_SCORE)
    stat[1] = T.float32(0)
    o_acc[0] = T.Broadcast(T.float32(0), VEC)
    for step in T.serial(T.ceildiv(num_splits, MERGE_UNROLL)):
        for u in T.unroll(MERGE_UNROLL):
            s: T.let[T.int32] = T.min(step * MERGE_UNROLL + u, num_splits - 1)
            split_max[u] = partial_stats[b, h, s, 0]
            split_sum[u] = partial_stats[b, h, s, 1]
            split_o[u] = partial_o[b, h, s, c]
        for u in T.unroll(MERGE_UNROLL):
            # Past S, and empty splits (-5e4, 0, O = 0), add nothing.
            m_s: T.let[T.float32] = T.if_then_else(step * MERGE_UNROLL + u < num_splits, split_max[u],
                                                   T.float32(MASKED_SCORE))
            m_new: T.let[T.float32] = T.max(stat[0], m_s)
            rescale: T.let[T.float32] = T.exp2(stat[0] - m_new)
            w: T.let[T.float32] = T.if_then_else(step * MERGE_UNROLL + u < num_splits,
                                                 T.exp2(m_s - m_new), T.float32(0))
            stat[1] = stat[1] * rescale + split_sum[u] * w
            o_acc[0] = o_acc[0] * T.Broadcast(rescale, VEC) + split_o[u] * T.Broadcast(w, VEC)
            stat[0] = m_new
