"""What every whole-model benchmark starts from: the native device, the kernel artifact, the model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from model_glue.artifact import KernelLibrary
from contract.artifacts import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from model_glue.webgpu_native import WgpuDevice


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
