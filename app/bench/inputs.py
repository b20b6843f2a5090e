"""What every whole-model benchmark starts from: the native device, the kernel artifact, the model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from model_glue.gpu.artifact import KernelLibrary
from contract.artifacts import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from model_glue.gpu.webgpu_native import WgpuDevice


async def bench_inputs(args, tokenizer: bool = False):
    """(device, kernel library, model folder, its label): the folder is args.model, or with
    --synthetic random weights of SmolLM2's shape written to a temporary folder (plus the real
    tokenizer files when `tokenizer`, for benchmarks that tokenize text)."""
    device = await WgpuDevice.open()
    library = await KernelLibrary.from_folder(device, args.kernels)
    if not args.synthetic:
        return device, library, Path(args.model), str(args.model)
    from convert.weights import write_random_artifact

    model_dir = Path(tempfile.mkdtemp(prefix="smollm2-synthetic-"))
    write_random_artifact("smollm2_135m", model_dir, seed=0)
    if tokenizer:
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            shutil.copy(Path(args.model) / name, model_dir / name)
    return device, library, model_dir, "synthetic SmolLM2-shaped"


async def bench_model(args, options, tokenizer: bool = False):
    """(device, library, loaded model, its label): the model of `bench_inputs`, or with --shape NAME a
    synthetic model of that contract shape whose weights are filled on the GPU (model_glue.synthetic)."""
    from model_glue.gpu.artifact import folder_readers
    from model_glue.loading import load_model, load_synthetic_model

    dtype = None if args.dtype == "auto" else args.dtype
    if getattr(args, "shape", None):
        device = await WgpuDevice.open()
        library = await KernelLibrary.from_folder(device, args.kernels)
        model = await load_synthetic_model(device, library, args.shape, options=options, dtype=dtype,
                                           progress=lambda message: print(message, flush=True))
        return device, library, model, f"synthetic {args.shape} (random weights filled on the GPU)"
    device, library, model_dir, label = await bench_inputs(args, tokenizer)
    read_text, read_bytes = folder_readers(model_dir)
    model = await load_model(device, library, read_text, read_bytes, options=options, dtype=dtype)
    return device, library, model, label
