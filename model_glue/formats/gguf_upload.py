"""A GGUF's tensors onto the GPU: each source tensor's raw blocks are read from the file, uploaded as
they are and repacked into the runtime's tensors by kernels.gguf_repack (norms are copied as f32).
Neither the file nor a whole tensor is held in memory: a tensor goes in chunks of whole blocks of at
most CHUNK_BYTES (each its own staging buffer and repack dispatch, written from its first output
block on), and the queue is drained every DRAIN_BYTES so the staging buffers are freed and the
progress is true. (An 8B model's output matrix is 0.5 GiB of Q8_0: in one piece it would need as
much in Pyodide's heap and a staging buffer past some adapters' binding limit.)

A chunk is also at most one storage binding (maxStorageBufferBindingSize), and where a runtime tensor
is larger than one (a large vocabulary's embedding or head: contract.slices), its repack binds only
the slice of each output its chunk writes, from an aligned block at or before the chunk's first
(`_output_bindings`).
"""

from __future__ import annotations

import math

from contract.gguf import GGML_TYPES_BY_ID, REPACK_BUFFERS, repack_kernel_name
from contract.slices import BINDING_OFFSET_ALIGN
from model_glue.formats.gguf_model import PlannedTensor, f32_values
from model_glue.gpu.webgpu import BufferSlice

DRAIN_BYTES = 256 << 20
CHUNK_BYTES = 32 << 20


def repack_kernels(plan: list[PlannedTensor]) -> list[str]:
    """The repack kernels a plan runs."""
    return sorted({repack_kernel_name(part.tensor.type_name, p.target) for p in plan if p.target != "f32"
                   for part in p.parts})


async def upload_gguf_tensors(device, library, read, plan: list[PlannedTensor], progress=lambda message: None) -> dict:
    """name -> GPU buffer of every planned runtime tensor; returns once the GPU has written them all."""
    names = repack_kernels(plan)
    kernels = dict(zip(names, await library.kernels(names)))
    total = sum(part.tensor.nbytes for p in plan for part in p.parts)
    limit = device.limits.get("maxStorageBufferBindingSize")
    weights, done, pending = {}, 0, 0
    batch = device.batch()
    for planned in plan:
        buffers = [device.storage_buffer(n) for n in planned.nbytes]
        weights.update(zip(planned.names, buffers))
        for part in planned.parts:
            tensor = part.tensor
            if planned.target == "f32":
                device.write(buffers[0], f32_values(tensor, bytes(await read(tensor.offset, tensor.nbytes))),
                             4 * part.first_block)
                chunks = [(0, tensor.nbytes, 0)]
            else:
                kernel = kernels[repack_kernel_name(tensor.type_name, planned.target)]
                chunks = tensor_chunks(tensor, _chunk_bytes(tensor, planned, limit))
            for start, nbytes, first_block in chunks:
                if planned.target != "f32":
                    staging = device.storage_buffer(nbytes, await read(tensor.offset + start, nbytes))
                    outputs, out_block = _output_bindings(planned, buffers, part.first_block + first_block,
                                                          _blocks32(tensor, nbytes), limit)
                    bound = kernel.bind(dict(zip(REPACK_BUFFERS[planned.target], [staging, *outputs])),
                                        {"blocks": _blocks32(tensor, nbytes), "out_block": out_block})
                    bound.dispatch(batch)
                    bound.release_after(batch)
                    batch.release_after_submit(staging)
                done += nbytes
                pending += nbytes
                if pending >= DRAIN_BYTES:
                    batch = await _drain(device, batch, buffers[0])
                    pending = 0
                    progress(f"uploading the GGUF's tensors: {done / 2**20:,.0f} of {total / 2**20:,.0f} MiB")
    await _drain(device, batch, next(iter(weights.values())))
    progress(f"uploaded the GGUF's tensors ({total / 2**20:,.0f} MiB)")
    return weights


def _blocks32(tensor, nbytes: int) -> int:
    """32-weight blocks in `nbytes` of a tensor's whole blocks."""
    ggml = GGML_TYPES_BY_ID[tensor.type_id]
    return nbytes // ggml.block_bytes * ggml.sub_blocks


# Bytes of code a 32-weight block has in each repack target (its scales and mins: `_block_bytes`)
BLOCK_CODE_BYTES = {"q4": 16, "q8": 32, "q8a": 32}


def _block_bytes(planned: PlannedTensor) -> list[int]:
    """Bytes of each output of a repacked tensor (codes, scale[, min]) per 32-weight block."""
    blocks = planned.nbytes[0] // BLOCK_CODE_BYTES[planned.target]
    return [nbytes // blocks for nbytes in planned.nbytes]


def _slice_align(block_bytes: list[int]) -> int:
    """The fewest 32-weight blocks at whose multiples every output's binding offset is aligned."""
    return math.lcm(*(BINDING_OFFSET_ALIGN // math.gcd(b, BINDING_OFFSET_ALIGN) for b in block_bytes))


def _sliced(planned: PlannedTensor, limit: int | None) -> bool:
    """Whether a repacked tensor's outputs are bound a chunk's slice at a time (one is past the limit)."""
    return limit is not None and max(planned.nbytes) > limit


def _chunk_bytes(tensor, planned: PlannedTensor, limit: int | None) -> int:
    """A chunk's most raw bytes: CHUNK_BYTES, and at most one binding, as is (for a tensor bound a
    slice at a time) the slice of each output its blocks write, from the aligned block before them."""
    if limit is None:
        return CHUNK_BYTES
    ggml = GGML_TYPES_BY_ID[tensor.type_id]
    most = min(CHUNK_BYTES, limit // 4 * 4)  # its staging buffer is a whole number of words
    if _sliced(planned, limit):
        block_bytes = _block_bytes(planned)
        out_blocks = limit // max(block_bytes) - _slice_align(block_bytes)  # 32-weight blocks a chunk may write
        most = min(most, out_blocks // ggml.sub_blocks * ggml.block_bytes)
    return max(most, ggml.block_bytes)


def _output_bindings(planned: PlannedTensor, buffers: list, out_block: int, blocks: int,
                     limit: int | None) -> tuple[list, int]:
    """(the outputs a chunk's repack binds, its out_block there) for a chunk writing `blocks` 32-weight
    blocks from block `out_block` on: the whole tensors, or (one past the binding limit) each one's
    slice from the aligned block at or before out_block to the chunk's last block."""
    if not _sliced(planned, limit):
        return buffers, out_block
    block_bytes = _block_bytes(planned)
    align = _slice_align(block_bytes)
    base = out_block // align * align
    end = out_block + blocks
    return [BufferSlice(buffer, base * b, (end - base) * b) for buffer, b in zip(buffers, block_bytes)], out_block - base


def tensor_chunks(tensor, chunk_bytes: int | None = None) -> list[tuple[int, int, int]]:
    """(byte offset in the tensor, bytes, first 32-weight block) of each chunk of whole blocks."""
    ggml = GGML_TYPES_BY_ID[tensor.type_id]
    step = max(1, (chunk_bytes or CHUNK_BYTES) // ggml.block_bytes) * ggml.block_bytes
    return [(start, min(step, tensor.nbytes - start), start // ggml.block_bytes * ggml.sub_blocks)
            for start in range(0, tensor.nbytes, step)]


async def _drain(device, batch, buffer):
    """Submit `batch` and wait for the GPU (a 4-byte read), so its staging buffers are freed."""
    batch.submit()
    await device.read(buffer, 4)
    return device.batch()
