"""The built artifact as the runtime sees it: a manifest of kernels and their WGSL files.

The artifact is read through an async `read_text(relative_path)` so the same code loads it from
disk (native) or over HTTP from the page's origin (browser).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from contract.artifacts import KERNEL_ARTIFACT_FORMAT, MANIFEST, KernelSpec
from model_glue.errors import ModelError
from model_glue.gpu.kernel import Kernel


class ArtifactError(ModelError):
    """An artifact (the kernels, a converted model) is missing, from another format version, or
    corrupted: a kind the page names (chat.api.error_help)."""


def folder_readers(folder):
    """(read_text, read_bytes) over a local folder: the native runtime's way to an artifact."""
    root = Path(folder)

    async def read_text(name: str) -> str:
        return (root / name).read_text()

    async def read_bytes(name: str) -> bytes:
        return (root / name).read_bytes()

    return read_text, read_bytes


def http_readers(base_url: str):
    """(read_text, read_bytes) over HTTP from the page's origin (Pyodide's pyfetch)."""
    from pyodide.http import pyfetch

    async def fetch(name: str):
        url = f"{base_url}/{name}"
        try:
            response = await pyfetch(url)
        except Exception as err:  # a network error: the server is gone, or the body was cut off
            raise OSError(f"cannot fetch {url} ({err})") from err
        if not response.ok:
            raise OSError(f"cannot fetch {url} (HTTP {response.status}); the server's artifact is "
                          "incomplete: run `make setup` there, then reload")
        return response

    async def read(name: str, as_text: bool):
        response = await fetch(name)
        try:
            return await (response.string() if as_text else response.bytes())
        except Exception as err:  # the connection dropped mid-body
            raise OSError(f"cannot read {base_url}/{name} ({err})") from err

    async def read_text(name: str) -> str:
        return await read(name, True)

    async def read_bytes(name: str) -> bytes:
        return await read(name, False)

    return read_text, read_bytes


class KernelLibrary:
    """Kernels of one artifact folder, compiled on first use and cached by name."""

    def __init__(self, device, manifest: dict, read_text):
        if manifest.get("format") != KERNEL_ARTIFACT_FORMAT:
            raise ArtifactError(f"kernel manifest format {manifest.get('format')!r}, expected {KERNEL_ARTIFACT_FORMAT}"
                                " (rebuild with `python -m app build`)")
        self.device = device
        self.specs = {name: KernelSpec.from_json(entry) for name, entry in manifest["kernels"].items()}
        self._read_text = read_text
        self._compiled: dict[str, asyncio.Future] = {}  # name -> its compile, started once

    @classmethod
    async def load(cls, device, read_text) -> "KernelLibrary":
        try:
            manifest = json.loads(await read_text(MANIFEST))
        except (OSError, ValueError) as err:
            raise ArtifactError(f"cannot read the kernel manifest: {err}") from err
        return cls(device, manifest, read_text)

    @classmethod
    async def from_folder(cls, device, folder) -> "KernelLibrary":
        if not (Path(folder) / MANIFEST).exists():
            raise ArtifactError(f"no {MANIFEST} in {folder}; build it with `python -m app build`")
        return await cls.load(device, folder_readers(folder)[0])

    def names(self, **meta) -> list[str]:
        """Kernel names whose meta matches every given key."""
        return [n for n, s in self.specs.items() if all(s.meta.get(k) == v for k, v in meta.items())]

    async def kernel(self, name: str) -> Kernel:
        """The compiled kernel. Compiles started together run together (the browser builds async
        pipelines on its worker threads); a kernel asked for twice is compiled once."""
        if name not in self._compiled:
            if name not in self.specs:
                raise ArtifactError(f"kernel {name!r} is not in this artifact")
            self._compiled[name] = asyncio.ensure_future(self._compile(name))
        try:
            return await asyncio.shield(self._compiled[name])
        except Exception:
            self._compiled.pop(name, None)  # a failed compile may be retried
            raise

    async def kernels(self, names) -> list[Kernel]:
        """Several kernels, compiled concurrently; the first failure is raised once all have ended."""
        results = await asyncio.gather(*(self.kernel(name) for name in names), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    async def _compile(self, name: str) -> Kernel:
        spec = self.specs[name]
        try:
            wgsl = await self._read_text(spec.wgsl)
        except OSError as err:
            raise ArtifactError(f"kernel {name}: {err}") from err
        return await Kernel.compile(self.device, spec, wgsl)
