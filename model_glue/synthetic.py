"""A synthetic model: the tensors of a contract config (contract.model.model_tensors) filled on the
GPU with pseudo-random values (kernels.random_fill), so a Llama-3.1-8B-shaped model (6 GiB of
weights) runs with nothing downloaded or uploaded. Its text is noise; its speed is the real thing:
every kernel reads as many bytes as it would for real weights of that shape.

The values are scaled like a real model's so activations stay in f16's range: a Q4 matrix's block
scale is about 0.5 / sqrt(columns) (weights of standard deviation ~2.3 / sqrt(columns)), norm
weights near 1. A tensor's values depend on (seed, its index in the tensor list) only; a tensor past
the adapter's binding limit (a large vocabulary's embedding) is filled a binding at a time, to the
same values (`fill_slices`).
"""

from __future__ import annotations

import math

from contract.model import LlamaConfig, TensorSpec, model_tensors
from contract.slices import BINDING_OFFSET_ALIGN
from model_glue.gpu.webgpu import BufferSlice

FILL_KERNELS = ("random_words", "random_uniform", "random_q4_blocks")
NORM_RANGE = (0.9, 1.1)
BIAS_RANGE = (-0.1, 0.1)  # a QKV bias (Qwen 2): small beside the projections
Q8_SCALE_RANGE = (0.005, 0.015)  # embedding rows of norm ~0.5 at dim 576, like the numpy random artifacts
SUBMIT_EVERY = 64  # fill dispatches per submit, so progress reaches the page while a large model fills


def q4_scale_range(columns: int) -> tuple[float, float]:
    centre = 0.5 / math.sqrt(columns)
    return (0.5 * centre, 1.5 * centre)


def tensor_seed(seed: int, index: int) -> int:
    """The fill seed of tensor `index` (an i32 PODArg)."""
    return (seed * 1_000_003 + index * 7_919 + 1) % (1 << 31)


def fill_dispatches(config: LlamaConfig, seed: int) -> list[tuple[str, tuple[str, ...], dict]]:
    """(fill kernel, tensors it writes, values) per dispatch: one per tensor, a Q4 matrix's scale and
    min in one dispatch. Pure, so a test can compute what the GPU should have written."""
    tensors = model_tensors(config)
    out = []
    for index, t in enumerate(tensors):
        elements = t.nbytes // 4
        values = {"n": elements, "seed": tensor_seed(seed, index), "element_base": 0}
        if t.role in ("q4", "q8"):
            out.append(("random_words", (t.name,), values))
        elif t.role == "q4_scale":
            lo, hi = q4_scale_range(t.shape[1] * 32)
            out.append(("random_q4_blocks", (t.name, t.name[:-len(".scale")] + ".min"), {**values, "lo": lo, "hi": hi}))
        elif t.role == "q8_scale":
            out.append(("random_uniform", (t.name,), {**values, "lo": Q8_SCALE_RANGE[0], "hi": Q8_SCALE_RANGE[1]}))
        elif t.role == "norm":
            out.append(("random_uniform", (t.name,), {**values, "lo": NORM_RANGE[0], "hi": NORM_RANGE[1]}))
        elif t.role == "bias":
            out.append(("random_uniform", (t.name,), {**values, "lo": BIAS_RANGE[0], "hi": BIAS_RANGE[1]}))
        elif t.role != "q4_min":  # written with its scale
            raise ValueError(f"no fill for tensor role {t.role!r}")
    return out


def _buffer_names(kernel: str) -> tuple[str, ...]:
    return ("scale", "wmin") if kernel == "random_q4_blocks" else ("out",)


def fill_slices(elements: int, binding_limit: int | None) -> list[tuple[int, int]]:
    """(first element, elements) of each dispatch that fills a tensor of `elements` 4-byte values: one,
    the whole tensor, where it fits a binding of `binding_limit` bytes; else slices of at most that,
    each starting at a binding offset every adapter accepts."""
    if binding_limit is None or 4 * elements <= binding_limit:
        return [(0, elements)]
    step = binding_limit // BINDING_OFFSET_ALIGN * BINDING_OFFSET_ALIGN // 4
    return [(first, min(step, elements - first)) for first in range(0, elements, step)]


async def fill_synthetic_weights(device, library, config: LlamaConfig, seed: int = 0,
                                 progress=lambda message: None) -> dict:
    """name -> GPU buffer of every tensor of `config`, filled on the GPU; returns once the GPU is done."""
    tensors: list[TensorSpec] = model_tensors(config)
    total = sum(t.nbytes for t in tensors)
    kernels = dict(zip(FILL_KERNELS, await library.kernels(FILL_KERNELS)))
    weights = {t.name: device.storage_buffer(t.nbytes) for t in tensors}
    sizes = {t.name: t.nbytes for t in tensors}
    batch, filled = device.batch(), 0
    dispatches = fill_dispatches(config, seed)
    limit = device.limits.get("maxStorageBufferBindingSize")
    for k, (kernel, names, values) in enumerate(dispatches, 1):
        slices = fill_slices(values["n"], limit)
        for first, elements in slices:
            buffers = (weights[n] if len(slices) == 1 else BufferSlice(weights[n], 4 * first, 4 * elements)
                       for n in names)
            bound = kernels[kernel].bind(dict(zip(_buffer_names(kernel), buffers)),
                                         {**values, "n": elements, "element_base": first})
            bound.dispatch(batch)
            bound.release_after(batch)
        filled += sum(sizes[n] for n in names)
        if k % SUBMIT_EVERY == 0 or k == len(dispatches):
            batch.submit()
            # waiting here keeps the queue short and makes the progress true
            await device.read(weights[names[0]], 4)
            progress(f"filling random weights on the GPU: {filled / 2**20:,.0f} of {total / 2**20:,.0f} MiB")
            batch = device.batch()
    return weights
