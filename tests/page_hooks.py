"""Test-only Python for the page: run one kernel of the served artifact inside the browser, or make
the comparison's sharded nest wrong on purpose.

Never shipped in the wheel: a browser test sends this file's source into the page's Python worker
(`install_page_hooks`, through window.demo.python) and calls `run_kernel_b64` there, so kernels compiled by Chromium's WGSL
compiler are checked against the same f64 references as natively. The native tests import it.
"""

from __future__ import annotations

import base64
import struct
from pathlib import Path


async def run_kernel_b64(session, name: str, buffers: dict, values: dict, outputs: dict) -> dict:
    """Run kernel `name` on base64-encoded input buffers; returns the named outputs in base64.
    `outputs` maps buffer name -> byte size."""
    kernel = await session.library.kernel(name)
    gpu_buffers = {}
    for buffer_name, data in buffers.items():
        raw = base64.b64decode(data)
        gpu_buffers[buffer_name] = session.device.storage_buffer(len(raw), raw)
    for buffer_name, nbytes in outputs.items():
        gpu_buffers[buffer_name] = session.device.storage_buffer(nbytes)
    bound = kernel.bind(gpu_buffers, values)
    batch = session.device.batch()
    bound.dispatch(batch)
    batch.submit()
    return {n: base64.b64encode(await session.device.read(gpu_buffers[n], size)).decode()
            for n, size in outputs.items()}


async def break_sharded_nest(chat) -> None:
    """A wrong sharded nest, for the comparison's checks: while a run of `chat` forces the sharded
    nest, its final norm's weights are scaled unevenly (the tiled runs keep them). `mend_sharded_nest`
    undoes it."""
    model = chat.model
    norm, dim = model.weights["final_norm"], model.config.dim
    original = await model.device.read(norm, 4 * dim)
    values = struct.unpack(f"<{dim}f", original)
    broken = struct.pack(f"<{dim}f", *(v * (1 + 5 * ((i * 7919) % 13 - 6) / 6) for i, v in enumerate(values)))
    plain = chat._run

    async def run(ids, max_new_tokens, options, *args, **kwargs):
        model.device.write(norm, broken if options.attention == "sharded" else original)
        try:
            return await plain(ids, max_new_tokens, options, *args, **kwargs)
        finally:
            model.device.write(norm, original)

    chat._run = run


def mend_sharded_nest(chat) -> None:
    del chat._run


def install_page_hooks(tab) -> None:
    """Define this module's functions in the namespace of the page's window.demo.python calls."""
    source = Path(__file__).read_text(encoding="utf-8").split("\n\ndef install_page_hooks")[0]
    tab.evaluate("(source) => window.demo.python(source)", source)
