"""Reading a GGUF file's header (metadata and tensor directory) in pure Python.

The page reads a user's GGUF in Pyodide, which has no numpy (so not the `gguf` package); the native
runtime reads files through the same code. Only the header is parsed here; tensor data stays where it
is and is read range by range when it is uploaded (model_glue.formats.gguf_upload). The format is GGUF v2/v3
(llama.cpp's gguf.md): magic, version, tensor and metadata counts, metadata key/values, tensor infos
(name, dims with ne0 first, type, offset from the data section), then data aligned to
`general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from contract.gguf import GGML_TYPES_BY_ID, type_name
from model_glue.errors import ModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
FIRST_READ = 1 << 22  # header bytes read first; a larger header (big vocabularies) doubles it until it fits

# metadata value types (gguf_type)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ModelError, ValueError):
    """The file is not a GGUF this runtime reads, or it is truncated (a kind the page names: chat.api)."""


class _NeedMore(Exception):
    """The header runs past the bytes read so far."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ne0 first: a matrix W[out, in] is (in, out)
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def elements(self) -> int:
        count = 1
        for extent in self.shape:
            count *= extent
        return count


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict
    tensors: dict[str, GGUFTensor]
    data_offset: int
    file_size: int

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise _NeedMore
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        end = self.pos + size
        if end > len(self.data):
            raise _NeedMore
        value, = struct.unpack_from(fmt, self.data, self.pos)
        self.pos = end
        return value

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS:  # one unpack for the whole array (token types, scores)
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(size * count)))
            return [self.value(item) for _ in range(count)]
        raise GGUFError(f"unknown metadata value type {kind}")


def parse_header(data: bytes, file_size: int) -> GGUFHeader:
    """The header from the file's first bytes; raises _NeedMore if they end inside it."""
    cursor = _Cursor(data)
    if cursor.take(4) != MAGIC:
        raise GGUFError("not a GGUF file (its first bytes are not 'GGUF')")
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version}; this runtime reads versions 2 and 3")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        tensor = GGUFTensor(name, type_id, dims, data_offset + offset, _tensor_bytes(name, type_id, dims))
        if tensor.nbytes is not None and tensor.offset + tensor.nbytes > file_size:
            raise GGUFError(f"the file is truncated: tensor {name} ends at byte {tensor.offset + tensor.nbytes:,}, "
                            f"the file has {file_size:,}")
        tensors[name] = tensor
    return GGUFHeader(version, metadata, tensors, data_offset, file_size)


def _tensor_bytes(name: str, type_id: int, dims: tuple[int, ...]) -> int | None:
    """Bytes of a tensor of a type the runtime reads (None for other types: refused later, by name)."""
    ggml = GGML_TYPES_BY_ID.get(type_id)
    if ggml is None:
        return None
    elements = 1
    for extent in dims:
        elements *= extent
    if dims and dims[0] % ggml.block_elements:
        raise GGUFError(f"tensor {name}: {dims[0]} columns is not a multiple of {ggml.name}'s "
                        f"{ggml.block_elements}-weight blocks")
    return ggml.nbytes(elements)


async def read_header(read, file_size: int) -> GGUFHeader:
    """The header through `read(offset, nbytes) -> bytes` (a file natively, a File's slices in the page)."""
    size = min(FIRST_READ, file_size)
    while True:
        data = bytes(await read(0, size))
        try:
            return parse_header(data, file_size)
        except _NeedMore:
            if size >= file_size:
                raise GGUFError(f"the file is truncated: its {file_size:,} bytes end inside the header") from None
            size = min(2 * size, file_size)


def file_reader(path) -> tuple:
    """(read, size) of a file on disk, for `read_header` and model_glue.loading.load_gguf_model."""
    import os

    size = os.path.getsize(path)

    async def read(offset: int, nbytes: int) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(nbytes)
        if len(data) != nbytes:
            raise GGUFError(f"the file is truncated: {nbytes:,} bytes at {offset:,} are past its end")
        return data

    return read, size
