"""Tensors bigger than one storage binding, split by rows.

A storage binding holds at most the adapter's maxStorageBufferBindingSize bytes (128 MiB on lavapipe
and SwiftShader), while a buffer may be far larger (2 GiB there). A vocabulary's tensors can exceed
a binding: Gemma 3's tied embedding is 262,144 rows of 640 codes (160 MiB of Q8), the Llama 3
heads 128,256 rows of 2,048 to 4,096. Those tensors (the embedding and the untied head: their
codes, scales and mins) are therefore split into slices of whole rows (`vocab_slices`, computed once
a model from the adapter's limit): the embedding gather and the head run once per slice, each
binding a slice of every tensor at the slice's first row (model_glue.gpu.webgpu.BufferSlice), with
the slice's first row as the value `row_base`. A model whose tensors fit one binding has exactly one
slice, the whole vocabulary, and binds whole buffers as before.

Every other tensor is bound whole, so it must fit one binding (model_glue.loading refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.model import LlamaConfig, matrix_format, matrix_tensors

# WebGPU's default minStorageBufferOffsetAlignment: every adapter accepts a binding offset that is a
# multiple of it (an adapter may accept finer ones; none requires coarser).
BINDING_OFFSET_ALIGN = 256
# A vocabulary slice starts at a multiple of this many rows: each tensor's row is a whole number of
# 4-byte words, so the slice's offset in every tensor is a multiple of BINDING_OFFSET_ALIGN, and the
# head's workgroups (at most 32 rows: MATMUL_ROWS x 4 rows a thread) never straddle two slices.
VOCAB_SLICE_ROWS = 256


@dataclass(frozen=True)
class RowSlice:
    """Rows [first, first + rows) of a tensor split by rows."""

    first: int
    rows: int

    def bytes_of(self, row_bytes: int) -> tuple[int, int]:
        """(offset, size) in bytes of this slice of a tensor whose rows are `row_bytes` long."""
        return self.first * row_bytes, self.rows * row_bytes


def row_slices(rows: int, row_bytes: int, limit: int | None, quantum: int = VOCAB_SLICE_ROWS) -> tuple[RowSlice, ...]:
    """The fewest slices of `rows` rows of `row_bytes` bytes, each at most `limit` bytes and each
    starting at a multiple of `quantum` rows, of sizes as even as that allows (the last may be
    smaller): one slice, the whole tensor, when it fits (or `limit` is None). ValueError where even
    `quantum` rows exceed `limit`."""
    if limit is None or rows * row_bytes <= limit:
        return (RowSlice(0, rows),)
    most = limit // row_bytes // quantum * quantum  # the most rows a slice may hold
    if most == 0:
        raise ValueError(f"{quantum} rows of {row_bytes} bytes exceed a binding of {limit} bytes")
    count = -(-rows // most)
    step = -(-rows // count // quantum) * quantum  # even slices, rounded up to the quantum (still <= most)
    return tuple(RowSlice(first, min(step, rows - first)) for first in range(0, rows, step))


def vocab_row_bytes(c: LlamaConfig) -> dict[str, int]:
    """Bytes a row of each tensor of the embedding ("embed.q8", "embed.scale", ...; the untied head's
    are alike, "head.*"), keyed by the suffix after "embed"."""
    return {t.name[len("embed"):]: t.nbytes // t.shape[0]
            for t in matrix_tensors("embed", matrix_format(c, "embed"), c.vocab_size, c.dim)}


def vocab_slice_bytes(c: LlamaConfig) -> int:
    """The bytes of the smallest slice a vocabulary tensor can be split into: its longest row's
    VOCAB_SLICE_ROWS rows (every binding must hold at least that much)."""
    return VOCAB_SLICE_ROWS * max(vocab_row_bytes(c).values())


def vocab_slices(c: LlamaConfig, binding_limit: int | None) -> tuple[RowSlice, ...]:
    """The vocabulary's slices on an adapter whose bindings hold `binding_limit` bytes: as few as let
    every vocabulary tensor's slice fit (one, the whole vocabulary, where they all fit)."""
    return row_slices(c.vocab_size, max(vocab_row_bytes(c).values()), binding_limit)


def is_vocab_tensor(name: str) -> bool:
    """Whether a model tensor (contract.model.model_tensors) is one of the vocabulary's (split by
    `vocab_slices`): the embedding's and the untied head's."""
    return name.split(".", 1)[0] in ("embed", "head")
