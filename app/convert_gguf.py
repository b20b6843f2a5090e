"""`python -m app convert [--gguf FILE]`: a llama GGUF the runtime opens, saved as a model artifact
(the served SmolLM2 too: this is the one way from a GGUF to the artifact's layout).

The file goes through the runtime's own way in (model_glue.loading: the header parsed, the shape
matched to kernels, every tensor planned and checked, the raw blocks repacked to Q4 / Q8 on this
machine's WebGPU adapter by kernels.gguf_repack), and the repacked tensors are read back and written
as the artifact (convert.weights.write_artifact). So the artifact holds exactly the weights the page
would hold after opening the file: the same exact repacks and the same requantizations. Its
tokenizer is the file's tokenizer.* metadata (contract.artifacts.GGUF_TOKENIZER_FILE), which the
runtime reads as it reads a GGUF's.

The weights are read back whole before the artifact is written (host memory about the artifact's
size), and the adapter must bind the largest tensor (lavapipe: 128 MiB, so up to SmolLM2-1.7B or
TinyLlama; a GPU for the Llama 3 shapes' 128k-token embeddings).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from contract.artifacts import GGUF_TOKENIZER_FILE
from contract.model import model_tensors
from convert.weights import sha256_file, write_artifact
from model_glue.gpu.artifact import KernelLibrary
from model_glue.errors import ModelError
from model_glue.formats.gguf_file import GGUFError, file_reader, read_header
from model_glue.formats.gguf_model import context_length, tensor_plan
from model_glue.formats.gguf_tokenizer import tokenizer_from_gguf
from model_glue.formats.gguf_upload import upload_gguf_tensors
from model_glue.loading import default_dtype, gguf_config, runnable_kernels

TOKENIZER_PREFIX = "tokenizer."  # the metadata keys the artifact keeps beside its weights


async def convert_gguf_file(device, library: KernelLibrary, gguf_path, out_dir, log=print,
                            gguf_tokenizer: bool = True) -> dict:
    """Convert `gguf_path` into the artifact folder `out_dir` on `device`; returns the manifest.
    A file the runtime cannot open is refused (ModelError) before anything is written.
    `gguf_tokenizer` False: no tokenizer is written (the caller writes HF's tokenizer.json, as for
    the served SmolLM2)."""
    started = time.perf_counter()
    path = Path(gguf_path)
    read, size = file_reader(path)
    try:
        header = await read_header(read, size)
    except GGUFError as err:
        raise ModelError(str(err)) from err
    tokenizer = {key: value for key, value in header.metadata.items() if key.startswith(TOKENIZER_PREFIX)}
    tokenizer_from_gguf(tokenizer)  # a tokenizer the runtime cannot run is refused before any upload
    config_name, config = await gguf_config(header, read)
    runnable_kernels(library, config, default_dtype(device, config), device)  # refused unless they exist
    plan = tensor_plan(header, config)
    log(f"converting {path.name}: the {config_name} shape, {config.n_layers} layers, "
        f"{sum(not p.exact for p in plan)} of {len(plan)} tensors requantized")
    weights = await upload_gguf_tensors(device, library, read, plan, log)
    tensors = []
    for spec in model_tensors(config):
        raw = await device.read(weights[spec.name], spec.nbytes)
        tensors.append((spec.name, np.frombuffer(raw, np.uint32 if spec.dtype == "uint32" else np.float32)
                        .reshape(spec.shape)))
        device.destroy(weights.pop(spec.name))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if gguf_tokenizer:
        (out / GGUF_TOKENIZER_FILE).write_text(json.dumps(tokenizer), encoding="utf-8")
    manifest = write_artifact(out, config_name, config, {"file": path.name, "sha256": sha256_file(path)}, tensors,
                              log, context_length(header), tokenizer=GGUF_TOKENIZER_FILE if gguf_tokenizer else None)
    log(f"artifact {manifest['total_bytes'] / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s -> {out}")
    return manifest
