"""Host-side helper (numpy) that binds paged decode inputs to an attention kernel.

Used by the benchmark and the tests; the browser never imports it (no numpy there).
"""

from __future__ import annotations

import numpy as np

from model_glue.model.attention import attention_call, attention_dispatches, split_workspace_bytes
from contract.attention import MAX_SPLITS
from contract.kernels import PAGE_SIZE
from contract.model import AttentionShape


def as_dtype(array, dtype: str):
    return np.ascontiguousarray(array, dtype=np.float16 if dtype == "float16" else np.float32)


class DecodeCall:
    """One paged decode-attention call bound to GPU buffers; dispatch it as often as you like.

    `kernel` is one nest's kernel, or, for a split call, (split kernel, merge); `set_splits(S)`
    re-cuts the context without rebinding.
    """

    def __init__(self, device, kernel, inputs: dict, *, rotary_mode=0, rope_scale=1.0, rope_theta=1e4,
                 num_splits: int = 1):
        kernels = list(kernel) if isinstance(kernel, (tuple, list)) else [kernel]
        (q_dtype,) = [b.dtype for b in kernels[0].spec.buffers if b.name == "Q"]
        dtype = q_dtype.split("x")[0]  # "float16x4": Q bound as 4-wide vectors
        q = as_dtype(inputs["q"], dtype)
        pages = as_dtype(inputs["pages"], dtype)
        batch, num_qo_heads, head_dim = q.shape
        page_table_values = np.asarray(inputs["page_table_values"], np.int32)

        def upload(array, dtype=np.int32):
            array = np.ascontiguousarray(array, dtype=dtype)
            return device.storage_buffer(array.nbytes, array.tobytes())

        self.device = device
        self.kernels = kernels
        self.out_shape = (batch, num_qo_heads, head_dim)
        shape = AttentionShape(pages.shape[2], num_qo_heads, head_dim)
        workspace = None
        if len(kernels) > 1:
            workspace = {name: device.storage_buffer(nbytes)
                         for name, nbytes in split_workspace_bytes(batch * MAX_SPLITS, shape).items()}
        self.out_dtype = q.dtype
        self.buffers, values = attention_call(
            q=upload(q, q.dtype), pages=upload(pages, pages.dtype),
            page_table_indptr=upload(inputs["page_table_indptr"]), page_table_values=upload(page_table_values),
            length_info=upload(inputs["length_info"]),
            k_rope_pos_offset=upload(inputs.get("k_rope_pos_offset", np.zeros(batch))),
            q_rope_position=upload(inputs.get("q_rope_position", np.zeros(batch))),
            output=device.storage_buffer(q.nbytes), lse=device.storage_buffer(batch * num_qo_heads * 4),
            batch=batch, nnz_pages=len(page_table_values), max_num_pages=pages.shape[0],
            sm_scale=float(inputs["sm_scale"]), rotary_mode=rotary_mode, rope_scale=rope_scale, rope_theta=rope_theta,
            workspace=workspace, num_splits=num_splits)
        self.values = values
        self.bound = [k.bind(b, v) for k, b, v in attention_dispatches(kernels, self.buffers, values)]
        self.kv_bytes = self.kv_bytes_of(inputs, head_dim, q.itemsize)

    @staticmethod
    def kv_bytes_of(inputs, head_dim: int, itemsize: int) -> int:
        """Bytes of K and V one call must read at least once: every KV head over its context."""
        num_kv_heads = inputs["pages"].shape[2]
        return sum(int(n) for n in inputs["kv_lens"]) * num_kv_heads * head_dim * 2 * itemsize

    def set_splits(self, num_splits: int) -> None:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}")
        self.values = {**self.values, "num_splits": num_splits}
        for bound in self.bound:
            bound.update(self.values)

    def dispatch(self, batch, timestamps=None):
        if timestamps is None:
            for bound in self.bound:
                bound.dispatch(batch)
            return
        with batch.timed(timestamps):  # a split's partial and merge are timed together
            for bound in self.bound:
                bound.dispatch(batch)

    def release(self) -> None:
        """Free this call's GPU buffers and uniforms now."""
        for bound in self.bound:
            bound.release()
        for buffer in self.buffers.values():
            self.device.destroy(buffer)

    async def run(self):
        """Dispatch once and return (output, lse) as numpy arrays."""
        batch = self.device.batch()
        self.dispatch(batch)
        batch.submit()
        return await self.read()

    async def read(self):
        out = await self.device.read(self.buffers["output"], int(np.prod(self.out_shape)) * self.out_dtype.itemsize)
        lse = await self.device.read(self.buffers["lse"], self.out_shape[0] * self.out_shape[1] * 4)
        return (np.frombuffer(out, self.out_dtype).reshape(self.out_shape),
                np.frombuffer(lse, np.float32).reshape(self.out_shape[:2]))


def random_paged_inputs(rng, context_lens, num_kv_heads, num_qo_heads, head_dim, page_size=PAGE_SIZE):
    """Benchmark inputs: N(0,1) q/K/V, each sequence on its own pages, page ids shuffled."""
    pages_per_seq = [(n + page_size - 1) // page_size for n in context_lens]
    num_pages = sum(pages_per_seq)
    physical = rng.permutation(num_pages).astype(np.int32)
    return {
        "q": rng.standard_normal((len(context_lens), num_qo_heads, head_dim)),
        "pages": rng.standard_normal((num_pages, 2, num_kv_heads, page_size, head_dim)),
        "page_table_indptr": np.concatenate([[0], np.cumsum(pages_per_seq)]).astype(np.int32),
        "page_table_values": physical,
        "length_info": np.array([n - (p - 1) * page_size for n, p in zip(context_lens, pages_per_seq)], np.int32),
        "sm_scale": 1.0 / np.sqrt(head_dim),
        "kv_lens": list(context_lens),
    }
