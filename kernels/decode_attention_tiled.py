"""TVM's own paged decode attention kernel (the "tiled" nest), built for WebGPU.

Threads across the head dimension; every q.k dot is a cross-thread reduction through workgroup
memory, and one serial trip over the context handles bdy*bdz positions, with several barriers per
trip. Good for short contexts, where its fixed cost is low. Arguments are TVM's
`batch_decode_paged_kv` (the layout is in kernels.paged_kv).
"""

from __future__ import annotations

import tvm

from contract.kernels import PAGE_SIZE

_WEBGPU = tvm.target.Target("webgpu")


def decode_attention_tiled(num_kv_heads, num_qo_heads, head_dim, dtype, sliding_window, page_size=PAGE_SIZE):
    """TVM's `_attention_decode` (wrong for some GQA groups: see `tiled_query_heads_computed`)."""
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
