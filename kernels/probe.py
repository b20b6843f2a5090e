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
