"""Test-only Python for the page: run one kernel of the served artifact inside the browser.

Never shipped in the wheel: a browser test sends this file's source into the page's Python worker
(`install_page_hooks`, through window.demo.python) and calls `run_kernel_b64` there, so kernels compiled by Chromium's WGSL
compiler are checked against the same f64 references as natively.
"""

from __future__ import annotations

import base64
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


def install_page_hooks(tab) -> None:
    """Define this module's functions in the namespace of the page's window.demo.python calls."""
    source = Path(__file__).read_text(encoding="utf-8").split("\n\ndef install_page_hooks")[0]
    tab.evaluate("(source) => window.demo.python(source)", source)
