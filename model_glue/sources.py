"""Where a model comes from, and `open_model`: one way from any source to what a chat needs.

Three sources: a converted model artifact (`Artifact`: manifest, weights and tokenizer behind two
readers), a user's GGUF (`GGUFFile`: a range reader and the file's size) and a synthetic shape
(`Synthetic`: random weights filled on the GPU, behind the served tokenizer). Each gives a model, a
tokenizer and a chat template; model_glue.loading does the model's part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from contract.artifacts import GGUF_TOKENIZER_FILE, MANIFEST, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from model_glue.gpu.artifact import ArtifactError
from model_glue.formats.chat_template import SMOLLM2_TEMPLATE, ChatTemplate, chat_template
from model_glue.formats.gguf_file import read_header
from model_glue.formats.gguf_tokenizer import tokenizer_from_gguf
from model_glue.formats.tokenizer import BPETokenizer
from model_glue.loading import load_gguf_model, load_model, load_synthetic_model
from model_glue.model.llama import LlamaModel
from model_glue.options import RunOptions

ReadText = Callable[[str], Awaitable[str]]
ReadBytes = Callable[[str], Awaitable[bytes]]


@dataclass(frozen=True)
class Artifact:
    """A converted model artifact (python -m app convert): its files through `read_text(name)` and
    `read_bytes(name)` (model_glue.gpu.artifact.folder_readers / http_readers). `verified_sha256`: the
    weights file's hash, where the caller checked the bytes against it already."""
    readers: tuple[ReadText, ReadBytes]
    verified_sha256: str | None = None


@dataclass(frozen=True)
class GGUFFile:
    """A llama GGUF through `read(offset, nbytes) -> bytes` (a native file or the page's File)."""
    read: Callable[[int, int], Awaitable[bytes]]
    size: int


@dataclass(frozen=True)
class Synthetic:
    """A contract shape (e.g. "llama-3.1-8b") with random weights, behind the tokenizer served by
    `tokenizer_readers`: its text is noise, its speed the shape's. `overrides` change config fields
    the kernels do not depend on (tests: {"n_layers": 1})."""
    shape: str
    tokenizer_readers: tuple[ReadText, ReadBytes]
    seed: int = 0
    overrides: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OpenedModel:
    """What a chat needs: the model on the GPU, its tokenizer and its chat template."""
    model: LlamaModel
    tokenizer: Any  # BPETokenizer or model_glue.formats.gguf_tokenizer's
    template: ChatTemplate


async def open_model(device, library, source: Artifact | GGUFFile | Synthetic, *,
                     options: RunOptions = RunOptions(), dtype: str | None = None,
                     progress=lambda message: None) -> OpenedModel:
    """Open `source` on `device` with the kernels of `library`. The tokenizer comes first, so a file
    this runtime cannot talk to is refused before any upload; any failure is a ModelError (or an
    AdapterLimitError) naming its cause."""
    if isinstance(source, Artifact):
        return await _open_artifact(device, library, source, options, dtype, progress)
    if isinstance(source, GGUFFile):
        return await _open_gguf(device, library, source, options, dtype, progress)
    if isinstance(source, Synthetic):
        return await _open_synthetic(device, library, source, options, dtype, progress)
    raise TypeError(f"not a model source: {source!r}")


async def _open_artifact(device, library, source: Artifact, options, dtype, progress) -> OpenedModel:
    read_text, read_bytes = source.readers
    try:
        manifest = json.loads(await read_text(MANIFEST))
    except (OSError, ValueError):
        manifest = None  # load_model reads it again and names what is wrong with it
    if manifest and manifest.get("tokenizer") == GGUF_TOKENIZER_FILE:  # a converted GGUF: its own tokenizer metadata
        tokenizer, template = await _gguf_metadata_tokenizer(read_text, progress)
    else:  # HF's tokenizer.json (the served SmolLM2, ChatML)
        tokenizer, template = await _served_tokenizer(read_text, progress), SMOLLM2_TEMPLATE
    model = await load_model(device, library, read_text, read_bytes, manifest=manifest, options=options,
                             dtype=dtype, progress=progress, verified_sha256=source.verified_sha256)
    return OpenedModel(model, tokenizer, template)


async def _open_gguf(device, library, source: GGUFFile, options, dtype, progress) -> OpenedModel:
    progress("reading the GGUF header")
    header = await read_header(source.read, source.size)
    tokenizer = tokenizer_from_gguf(header.metadata)
    template = _noted(chat_template(header.get("tokenizer.chat_template")), progress)
    model = await load_gguf_model(device, library, source.read, source.size, options=options, dtype=dtype,
                                  progress=progress, header=header)
    return OpenedModel(model, tokenizer, template)


async def _open_synthetic(device, library, source: Synthetic, options, dtype, progress) -> OpenedModel:
    read_text, _ = source.tokenizer_readers
    tokenizer = await _served_tokenizer(read_text, progress)
    tokenizer.show_unknown_ids = True  # ids past the tokenizer's vocabulary decode as "<id N>"
    model = await load_synthetic_model(device, library, source.shape, options=options, dtype=dtype,
                                       seed=source.seed, overrides=source.overrides or None, progress=progress)
    return OpenedModel(model, tokenizer, SMOLLM2_TEMPLATE)


async def _served_tokenizer(read_text: ReadText, progress) -> BPETokenizer:
    """HF's tokenizer.json and tokenizer_config.json beside a model's manifest."""
    progress("loading the tokenizer")
    try:
        return BPETokenizer.from_json(await read_text(TOKENIZER_FILE), json.loads(await read_text(TOKENIZER_CONFIG_FILE)))
    except (OSError, ValueError) as err:
        raise ArtifactError(f"cannot load the tokenizer: {err}") from err


async def _gguf_metadata_tokenizer(read_text: ReadText, progress) -> tuple:
    """A converted GGUF's tokenizer metadata (GGUF_TOKENIZER_FILE) and the chat template it names."""
    progress("loading the tokenizer")
    try:
        metadata = json.loads(await read_text(GGUF_TOKENIZER_FILE))
    except (OSError, ValueError) as err:
        raise ArtifactError(f"cannot load the tokenizer: {err}") from err
    return tokenizer_from_gguf(metadata), _noted(chat_template(metadata.get("tokenizer.chat_template")), progress)


def _noted(template: ChatTemplate, progress) -> ChatTemplate:
    if template.note:  # a template rendered as plain text says so
        progress(template.note)
    return template
