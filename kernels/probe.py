"""A probe kernel for the walking skeleton: scaled row sums by a workgroup tree reduction.

A reduction through workgroup memory exercises what a vector add would not: `var<workgroup>`
storage, TVM's barrier insertion, a PODArgs uniform (scale, n) and a grid that depends on a shape.
"""

from tvm.script import tirx as T

ROW_WIDTH = 256  # one invocation per element of a row, one workgroup per row


def row_sum_probe():
    """out[r] = scale * sum(x[r, :]), x of shape [n, 256], f32."""
    tree_levels = ROW_WIDTH.bit_length() - 1  # 8 halvings: 256 -> 1

    @T.prim_func(s_tir=True)
    def row_sum(x_handle: T.handle, out_handle: T.handle, scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        x = T.match_buffer(x_handle, (n, ROW_WIDTH), "float32")
        out = T.match_buffer(out_handle, (n,), "float32")
        for row in T.thread_binding(n, thread="blockIdx.x"):
            for lane in T.thread_binding(ROW_WIDTH, thread="threadIdx.x"):
                with T.sblock("row_sum"):
                    T.reads()
                    T.writes()
                    partial = T.sblock_alloc_buffer((ROW_WIDTH,), "float32", scope="shared")
                    partial[lane] = x[row, lane]
                    for level in T.unroll(tree_levels):
                        half: T.let[T.int32] = T.shift_right(ROW_WIDTH // 2, level)
                        if lane < half:
                            partial[lane] = partial[lane] + partial[lane + half]
                    if lane == 0:
                        out[row] = partial[0] * scale

    return row_sum


STREAM_ITEMS_PER_THREAD = 16  # f32 loads per invocation; neighbouring invocations read neighbouring words


def stream_read_probe():
    """partial[g * 256 + t] = sum of x over the 16 coalesced f32 words invocation t of group g reads.

    Reads every word of x once: the adapter's streaming-read bandwidth, the ceiling the
    attention benchmark reports its KV bandwidth against.
    """
    words_per_group = ROW_WIDTH * STREAM_ITEMS_PER_THREAD

    @T.prim_func(s_tir=True)
    def stream_read(x_handle: T.handle, partial_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        num_groups = T.int32()
        x = T.match_buffer(x_handle, (num_groups, words_per_group), "float32")
        partial = T.match_buffer(partial_handle, (num_groups * ROW_WIDTH,), "float32")
        for g in T.thread_binding(num_groups, thread="blockIdx.x"):
            for t in T.thread_binding(ROW_WIDTH, thread="threadIdx.x"):
                with T.sblock("stream"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for k in T.unroll(STREAM_ITEMS_PER_THREAD):
                        acc[0] = acc[0] + x[g, k * ROW_WIDTH + t]
                    partial[g * ROW_WIDTH + t] = acc[0]

    return stream_read
