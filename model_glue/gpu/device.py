"""Opening this process's WebGPU device: the browser's under Pyodide, else wgpu-py's best adapter.

Each backend's module is imported only on the platform that has it (`js` exists only in Pyodide).
"""

from __future__ import annotations

import sys

from model_glue.gpu.webgpu import Device


def in_browser() -> bool:
    return sys.platform == "emscripten"


async def open_device(limit_caps: dict[str, int] | None = None) -> Device:
    """The device of this process, with the limits `limit_caps` lowers (tests pretend to be smaller)."""
    if in_browser():
        from model_glue.gpu.webgpu_browser import BrowserDevice

        return await BrowserDevice.open(limit_caps)
    from model_glue.gpu.webgpu_native import WgpuDevice

    return await WgpuDevice.open(limit_caps)
