"""`python -m app generate`: one chat turn natively, streamed, then the per-step table."""

from __future__ import annotations

import os
import sys
import time

from app.run_options_cli import run_options
from chat.session import ChatSession
from model_glue.sources import Artifact, GGUFFile, open_model
from model_glue.gpu.artifact import KernelLibrary, folder_readers
from model_glue.errors import ModelError
from model_glue.model.generate import Sampling
from model_glue.formats.gguf_file import file_reader
from model_glue.gpu.webgpu import DeviceLostError, WebGPUUnavailable
from model_glue.gpu.webgpu_native import WgpuDevice


def format_stats_table(stats: list[dict]) -> str:
    lines = [f"{'step':>4} {'kind':>7} {'tokens':>6} {'context':>7} {'attention':>17} {'attn ms':>8} {'GPU ms':>7} "
             f"{'encode ms':>9} {'step ms':>8} {'dispatches':>10}"]
    for i, s in enumerate(stats):
        attn = "-" if s["attention_ms"] is None else f"{s['attention_ms']:.3f}"
        gpu = "-" if s["gpu_ms"] is None else f"{s['gpu_ms']:.3f}"
        lines.append(f"{i:>4} {s['kind']:>7} {s['tokens']:>6} {s['context']:>7} {s['kernel']:>17} {attn:>8} {gpu:>7} "
                     f"{s['encode_ms']:>9.3f} {s['step_ms']:>8.2f} {s['dispatches']:>10}")
    return "\n".join(lines)


def format_speed(speed: dict) -> str:
    """Time to first token, prefill and decode tokens/s, as WebLLM reports them."""
    def rate(value):
        return "-" if value is None else f"{value:.1f}"
    ttft = "-" if speed["ttft_ms"] is None else f"{speed['ttft_ms']:.0f} ms"
    return (f"TTFT {ttft}, prefill {speed['prefill_tokens']} tokens at {rate(speed['prefill_tok_s'])} tok/s"
            f" ({speed['reused_tokens']} reused), decode {rate(speed['decode_tok_s'])} tok/s")


async def run_generate(args) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        device = await WgpuDevice.open()
        library = await KernelLibrary.from_folder(device, args.kernels)
        dtype = None if args.dtype == "auto" else args.dtype
        loading = time.perf_counter()
        progress = lambda m: print(f"[{m}]", file=sys.stderr)  # noqa: E731
        if args.gguf:
            read, size = file_reader(args.gguf)
            source = GGUFFile(read, size)
        else:
            source = Artifact(folder_readers(args.model))
        options = run_options(args)
        chat = ChatSession(await open_model(device, library, source, options=options, dtype=dtype, progress=progress))
        print(f"[{device.adapter_name}, {chat.model.dtype}, attention={options.attention}; "
              f"model ready in {time.perf_counter() - loading:.1f} s]", file=sys.stderr)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        result = await chat.reply(args.prompt, max_new_tokens=args.max_tokens, options=options.per_request(),
                                  sampling=sampling, on_text=lambda piece: print(piece, end="", flush=True))
    except (ModelError, WebGPUUnavailable, DeviceLostError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print()
    speed = result["speed"]
    seed = "" if result["seed"] is None else f"; seed {result['seed']}"
    print(f"[{result['stop_reason']}; prompt {result['prompt_tokens']} tokens, {len(result['token_ids'])} generated"
          f"{seed}; {format_speed(speed)}]", file=sys.stderr)
    print(format_stats_table(result["stats"]))
    return 0
