"""`python -m app bench gguf`: a user's GGUF opened directly, timed. With --shape, a GGUF of that shape is
first written with random weights by the `gguf` package (app/bench/gguf_files.py: --types picks the
matrices' and the embedding's tensor types), so the figure needs no download; with --file, any GGUF.

Reported per run (--runs, the file read from the OS cache after the first): seconds to Ready (header,
tensors repacked on the GPU, pipelines, warm-up), then one chat turn: TTFT and decode tok/s, with the
median step's GPU ms from timestamps.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from chat.session import ChatSession
from model_glue.sources import GGUFFile, open_model
from contract.model import ALL_MODEL_CONFIGS, DEFAULT_CONTEXT_LENGTH, synthetic_config_name
from model_glue.gpu.artifact import KernelLibrary
from model_glue.formats.gguf_file import file_reader
from model_glue.options import RunOptions
from model_glue.gpu.webgpu_native import WgpuDevice

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


def write_shape_gguf(shape: str, types: dict, path: Path) -> Path:
    from app.bench.gguf_files import write_llama_gguf

    config = ALL_MODEL_CONFIGS[synthetic_config_name(shape)]
    pre = "llama-bpe" if config.vocab_size == 128256 else "smollm"
    template = "{{ bos_token }}<|start_header_id|>" if pre == "llama-bpe" else "<|im_start|>"
    started = time.perf_counter()
    write_llama_gguf(path, config, types=types, tokenizer="gpt2", pre=pre, chat_template=template,
                     rope_freqs=config.rope_scaling is not None, seed=1, dense=False,
                     context_length=DEFAULT_CONTEXT_LENGTH)  # room for the page's long document
    print(f"wrote {path.name}: {shape} shape, {types}, {os.path.getsize(path) / 2**20:,.0f} MiB in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return path


async def run_gguf_bench(args) -> list[dict]:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    with tempfile.TemporaryDirectory() as folder:
        path = args.file or write_shape_gguf(args.shape, {"matrix": args.types[0], "embed": args.types[1],
                                                          "head": args.types[1]}, Path(folder) / f"{args.shape}.gguf")
        device = await WgpuDevice.open()
        library = await KernelLibrary.from_folder(device, args.kernels)
        print(f"adapter: {device.adapter_name}; GPU time: {'timestamps' if device.has_timestamps else 'unavailable'}")
        print(f"{'run':>3} {'ready s':>8} {'TTFT ms':>8} {'decode tok/s':>12} {'step GPU ms':>11}  model")
        rows = []
        for run in range(args.runs):
            read, size = file_reader(path)
            started = time.perf_counter()
            chat = ChatSession(await open_model(device, library, GGUFFile(read, size), options=RunOptions(max_context=4096)))
            ready = time.perf_counter() - started
            result = await chat.reply(PROMPT, max_new_tokens=args.tokens)
            speed = result["speed"]
            gpu = [s["gpu_ms"] for s in result["stats"] if s["kind"] == "decode" and s["gpu_ms"] is not None]
            row = {"run": run, "ready_s": ready, "ttft_ms": speed["ttft_ms"], "decode_tok_s": speed["decode_tok_s"],
                   "step_gpu_ms": statistics.median(gpu) if gpu else None, "config": chat.model.config_name,
                   "layers": chat.model.config.n_layers, "dtype": chat.model.dtype, "file_bytes": size}
            rows.append(row)
            gpu_text = "-" if row["step_gpu_ms"] is None else f"{row['step_gpu_ms']:.2f}"
            print(f"{run:>3} {ready:>8.2f} {speed['ttft_ms']:>8.0f} {speed['decode_tok_s'] or 0:>12.1f} {gpu_text:>11}  "
                  f"{chat.model.config_name} ({chat.model.config.n_layers} layers, {chat.model.dtype}, "
                  f"{chat.template.family} template)", flush=True)
            chat.model.release()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows
