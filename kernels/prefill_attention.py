"""Causal paged prefill attention for WebGPU: TVM's own `batch_prefill_paged_kv`.

A prompt chunk of n tokens attends to the cache through one page table per sequence (the chunk's
K/V already appended), with the causal mask applied inside the kernel: query i of a sequence whose
cache holds L tokens sees positions 0 .. L - n + i. Before this kernel, prefill ran the decode
kernels over n "pseudo-sequences", one per query, each with its own page table (O(n * pages)
entries per chunk).

    q[total_len, H_qo, D], q_indptr[B + 1], pages[num_pages, 2, H_kv, page_size, D],
    page_indptr[B + 1], page_values[nnz_pages], length_info[B] (last page length),
    k_rope_pos_offset[B], q_rope_position[total_len], output[total_len, H_qo, D],
    lse[total_len, H_qo] (log2 domain); batch_size, causal, rotary_mode, rope_scale, rope_theta, sm_scale.

TVM tiles (token, query head of the group) rows by KV tiles in workgroup memory: 128 invocations,
a fixed grid of 16 x H_kv workgroups that loop over the query tiles. In f16 its tiles need 16,768
bytes of workgroup storage, a little over WebGPU's 16 KiB default (f32: 12,480), so it is built
with the same allowance as TVM's tiled decode kernel and the model names the limit on an adapter
without it.
"""

from __future__ import annotations

import tvm

from model_glue.contract import PAGE_SIZE

_WEBGPU = tvm.target.Target("webgpu")


def prefill_attention_causal(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                             page_size: int = PAGE_SIZE):
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill

    return _attention_prefill(num_kv_heads, num_qo_heads, head_dim, dtype, False, {}, _WEBGPU, page_size)
