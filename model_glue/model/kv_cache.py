"""The paged KV cache of one sequence, and the one check of how many tokens a context may hold."""

from __future__ import annotations

from array import array

from contract.kernels import PAGE_SIZE
from contract.model import LlamaConfig
from model_glue.errors import ModelError


class PagedKVCache:
    """KV pages for one sequence: per layer one GPU buffer [num_pages, 2, H_kv, 16, D], holding up
    to `capacity` tokens.

    Physical pages are handed out from the top of the pool down, so the page table is not the
    identity (the kernels only ever see page ids through it).
    """

    def __init__(self, device, config: LlamaConfig, dtype_bytes: int, capacity: int):
        self.capacity = capacity
        self.num_pages = self.pages_for(capacity)
        self.layers = [device.storage_buffer(self.layer_bytes(config, dtype_bytes, capacity))
                       for _ in range(config.n_layers)]
        self.pages: list[int] = []
        self.length = 0

    @staticmethod
    def pages_for(tokens: int) -> int:
        return (tokens + PAGE_SIZE - 1) // PAGE_SIZE

    @classmethod
    def layer_bytes(cls, config: LlamaConfig, dtype_bytes: int, capacity: int) -> int:
        """One layer's pages: [num_pages, 2 (K, V), H_kv, PAGE_SIZE, D]."""
        return cls.pages_for(capacity) * 2 * config.n_kv_heads * PAGE_SIZE * config.head_dim * dtype_bytes

    def check_fits(self, tokens: int, new_tokens: int = 0) -> None:
        """Refuse a context of `tokens` (+ `new_tokens` to generate) beyond the capacity."""
        if tokens + new_tokens > self.capacity:
            asked = f"{tokens} tokens" + (f"; with {new_tokens} new tokens it" if new_tokens else ", which")
            raise ModelError(f"the conversation is {asked} exceeds the context of {self.capacity} tokens. "
                             "Start a new chat.")

    def reset(self) -> None:
        self.pages.clear()
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (their slots are simply written again later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        del self.pages[(length + PAGE_SIZE - 1) // PAGE_SIZE:]
        self.length = length

    def reserve(self, new_tokens: int) -> list[int]:
        """Physical slots (page * 16 + offset) for the next `new_tokens` positions."""
        self.check_fits(self.length + new_tokens)
        slots = []
        for pos in range(self.length, self.length + new_tokens):
            if pos // PAGE_SIZE >= len(self.pages):
                self.pages.append(self.num_pages - 1 - len(self.pages))
            slots.append(self.pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        self.length += new_tokens
        return slots

    def window_page_table(self, context_lens: list[int], window: int) -> tuple[array, array, array]:
        """indptr, page ids and length_info [3, B] (last page's fill, the window's first row in its first
        page, no sink: TVM's sliding-window convention) for queries attending to the last `window`
        tokens of these prefixes."""
        indptr, values = array("i", [0]), array("i")
        last, offsets = array("i"), array("i")
        for n in context_lens:
            num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
            first = max(0, n - window)
            values.extend(self.pages[first // PAGE_SIZE:num_pages])
            indptr.append(len(values))
            last.append(n - (num_pages - 1) * PAGE_SIZE)
            offsets.append(first % PAGE_SIZE)
        return indptr, values, last + offsets + array("i", [0]) * len(context_lens)

    def page_table(self, context_lens: list[int]) -> tuple[array, array, array]:
        """indptr, page ids and last-page lengths for queries attending to these prefixes."""
        indptr, values, last = array("i", [0]), array("i"), array("i")
        for n in context_lens:
            num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
            values.extend(self.pages[:num_pages])
            indptr.append(len(values))
            last.append(n - (num_pages - 1) * PAGE_SIZE)
        return indptr, values, last
