"""A GGUF's tensors onto the GPU: each source tensor's raw blocks are read from the file, uploaded as
they are and repacked into the runtime's tensors by kernels.gguf_repack (norms are copied as f32).
Neither the file nor a whole tensor is held in memory: a tensor goes in chunks of whole blocks of at
most CHUNK_BYTES (each its own staging buffer and repack dispatch, written from its first output
block on), and the queue is drained every DRAIN_BYTES so the staging buffers are freed and the
progress is true. (An 8B model's output matrix is 0.5 GiB of Q8_0: in one piece it would need as
much in Pyodide's heap and a staging buffer past some adapters' binding limit.)
"""

from __future__ import annotations

from contract.gguf import GGML_TYPES_BY_ID, REPACK_BUFFERS, repack_kernel_name
from model_glue.formats.gguf_model import PlannedTensor, f32_values

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
    weights, done, pending = {}, 0, 0
    batch = device.batch()
    for planned in plan:
        buffers = [device.storage_buffer(n) for n in planned.nbytes]
        weights.update(zip(planned.names, buffers))
        for part in planned.parts:
            tensor = part.tensor
            if planned.target == "f32":
                device.write(buffers[0], f32_values(tensor, bytes(await read(tensor.offset, tensor.nbytes))))
                chunks = [(0, tensor.nbytes, 0)]
            else:
                kernel = kernels[repack_kernel_name(tensor.type_name, planned.target)]
                chunks = tensor_chunks(tensor)
            for start, nbytes, first_block in chunks:
                if planned.target != "f32":
                    staging = device.storage_buffer(nbytes, await read(tensor.offset + start, nbytes))
                    bound = kernel.bind(dict(zip(REPACK_BUFFERS[planned.target], [staging, *buffers])),
                                        {"blocks": _blocks32(tensor, nbytes), "out_block": part.first_block + first_block})
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
