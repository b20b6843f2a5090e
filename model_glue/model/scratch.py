"""The activation buffers a model's passes read and write, sized for the longest pass so far.

They grow in powers of two and never shrink, so prompts of other lengths fit the same buffers and
the passes bound to them (model_glue.gpu.kernel.DispatchPlan) live on; a growth drops those plans.
"""

from __future__ import annotations

from contract.attention import MAX_SPLITS
from contract.kernels import head_spec
from contract.model import LlamaConfig
from model_glue.model.attention import split_workspace_bytes
from model_glue.policy import DECODE_BATCH_MAX_TOKENS
from model_glue.model.kv_cache import PagedKVCache

# Buffers of one token whatever the pass: the last token's hidden state, its logits, the head's
# best (value, index) per workgroup (the argmax reads them), the chosen id, and a decode matmul's x
# as int8 codes and per-chunk stats (kernels.quantize_x; a byte a value each), twice: the gate/up
# matmul reads one pair and writes the other for down (MatmulSpec.quantizes_y).
ONE_TOKEN_BUFFERS = ("last", "logits", "head_best", "next_id", "xq", "xstats", "ffn_xq", "ffn_xstats")


def scratch_sizes(c: LlamaConfig, e: int, n: int, capacity: int) -> dict[str, int]:
    """Bytes of each activation buffer for passes of up to `n` tokens (`e` bytes per element) with a
    KV cache of `capacity` tokens."""
    queries = min(n, DECODE_BATCH_MAX_TOKENS)
    return {
        "ids": 4 * n, "positions": 4 * n, "slots": 4 * n,
        "x_a": e * n * c.dim, "x_b": e * n * c.dim, "normed": e * n * c.dim,
        "qkv": e * n * c.qkv_dim, "q": e * n * c.n_heads * c.head_dim,
        "attn": e * n * c.n_heads * c.head_dim, "lse": 4 * n * c.n_heads,
        "gate_up": e * n * 2 * c.ffn_dim, "ffn": e * n * c.ffn_dim,
        # decode attention's page table: one prefix a query, for a decode step or a short prefill
        # pass's batch (LlamaModel.prefill_attention); prefill attention reads page_ids too
        "indptr": 4 * (queries + 1), "page_ids": 4 * queries * PagedKVCache.pages_for(capacity), "last_len": 4 * queries,
        # ... and for a model's sliding-window layers, over the window (length_info [3, B])
        **({"window_indptr": 4 * (queries + 1), "window_page_ids": 4 * queries * PagedKVCache.pages_for(capacity),
            "window_length_info": 4 * 3 * queries} if c.sliding_window is not None else {}),
        # TVM's decode signature has RoPE offsets; RoPE is applied at append (rotary_mode 0), so the
        # kernels never read them: one zero-filled word serves both.
        "rope_offsets": 4,
        **split_workspace_bytes(MAX_SPLITS, c.attention_shape),
    }


def one_token_sizes(c: LlamaConfig, e: int) -> dict[str, int]:
    widest_x = max(c.dim, c.n_heads * c.head_dim, c.ffn_dim)
    return dict(zip(ONE_TOKEN_BUFFERS, (e * c.dim, 4 * c.vocab_size, 4 * 2 * head_spec(c, "float32").workgroups, 4,
                                        widest_x, widest_x, c.ffn_dim, c.ffn_dim)))


class ScratchBuffers(dict):
    """name -> GPU buffer of every activation (`scratch_sizes`, plus the one-token buffers)."""

    def __init__(self, device, config: LlamaConfig, esize: int, capacity: int):
        super().__init__()
        self.device, self.config, self.esize, self.capacity = device, config, esize, capacity
        self.tokens = 0  # the longest pass the buffers hold

    def ensure(self, tokens: int) -> bool:
        """Buffers for passes of up to `tokens` tokens; True when they were (re)allocated."""
        if tokens <= self.tokens:
            return False
        n = 1 << (max(tokens, 1) - 1).bit_length()
        for name, size in scratch_sizes(self.config, self.esize, n, self.capacity).items():
            if name in self:
                self.device.destroy(self[name])  # passes already submitted keep it alive until done
            self[name] = self.device.storage_buffer(size)
        for name, size in one_token_sizes(self.config, self.esize).items():
            if name not in self:  # never grow
                self[name] = self.device.storage_buffer(size)
        self.tokens = n
        return True
