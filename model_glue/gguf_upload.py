"""A GGUF's tensors onto the GPU: each source tensor's raw blocks are read from the file, uploaded as
they are and repacked into the runtime's tensors by kernels.gguf_repack (norms are copied as f32).
The file is never held whole in memory: a tensor at a time, with the queue drained every
DRAIN_BYTES so its staging buffers are freed and the progress is true.
"""

from __future__ import annotations

from contract.gguf import REPACK_BUFFERS, repack_kernel_name
from model_glue.gguf_model import PlannedTensor, f32_values

DRAIN_BYTES = 256 << 20


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
            raw = await read(part.tensor.offset, part.tensor.nbytes)
            if planned.target == "f32":
                device.write(buffers[0], f32_values(part.tensor, bytes(raw)))
            else:
                staging = device.storage_buffer(part.tensor.nbytes, raw)
                kernel = kernels[repack_kernel_name(part.tensor.type_name, planned.target)]
                bound = kernel.bind(dict(zip(REPACK_BUFFERS[planned.target], [staging, *buffers])),
                                    {"blocks": part.tensor.elements // 32, "out_block": part.first_block})
                bound.dispatch(batch)
                bound.release_after(batch)
                batch.release_after_submit(staging)
            done += part.tensor.nbytes
            pending += part.tensor.nbytes
            if pending >= DRAIN_BYTES:
                batch = await _drain(device, batch, buffers[0])
                pending = 0
                progress(f"uploading the GGUF's tensors: {done / 2**20:,.0f} of {total / 2**20:,.0f} MiB")
    await _drain(device, batch, next(iter(weights.values())))
    progress(f"uploaded the GGUF's tensors ({total / 2**20:,.0f} MiB)")
    return weights


async def _drain(device, batch, buffer):
    """Submit `batch` and wait for the GPU (a 4-byte read), so its staging buffers are freed."""
    batch.submit()
    await device.read(buffer, 4)
    return device.batch()
