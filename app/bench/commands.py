"""`python -m app bench ...`: each benchmark's parser, registered by its own function; the runners
are imported only when their command runs (the parsers need nothing beyond the standard library)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.bench.page import CPU_LONG_CHARS, DEFAULT_CHROMIUM, GPU_FLAGS  # standard library only
from app.paths import KERNEL_ARTIFACT, MODEL_ARTIFACT, STATIC
from app.run_options_cli import add_run_options, parse_mode
from contract.model import SYNTHETIC_NAMES


def _page_model(text: str) -> str:
    """`?model=` of the page benchmark: a served model, or a synthetic shape (contract.model.SYNTHETIC_NAMES)."""
    if text in ("smollm2", "tiny_chat") or (text.startswith("synthetic:") and text.removeprefix("synthetic:") in SYNTHETIC_NAMES):
        return text
    raise argparse.ArgumentTypeError(f"one of smollm2, tiny_chat, synthetic:{{{','.join(SYNTHETIC_NAMES)}}}; "
                                     f"not {text!r}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


DEFAULT_DECODE_MODES = ("default", "layout=shards", "attention=tiled")


def add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (native WebGPU through wgpu, or the page in Chromium)")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    for add in (add_attention, add_decode, add_prefill, add_page, add_chat, add_gguf):
        add(bench_sub)


def add_attention(sub) -> None:
    attn = sub.add_parser("attention", help="paged decode attention: tiled and every sharded-family kernel")
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
    attn.set_defaults(run=run_attention)


def run_attention(args) -> int:
    import asyncio

    from app.bench.attention import run_attention_bench

    asyncio.run(run_attention_bench(args))
    return 0


def add_decode(sub) -> None:
    dec = sub.add_parser("decode", help="whole-model prefill/decode throughput, auto vs tiled")
    dec.add_argument("--contexts", type=_int_list, default=[128, 1024, 3000])
    dec.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    dec.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto")
    dec.add_argument("--synthetic", action="store_true", help="random weights of SmolLM2's shape")
    dec.add_argument("--shape", choices=sorted(SYNTHETIC_NAMES),
                     help="a synthetic model of this shape instead, its random weights filled on the GPU")
    dec.add_argument("--mode", dest="modes", action="append", type=parse_mode, metavar="FIELDS",
                     help="what runs per context (repeat for several): RunOptions fields as name=value joined by "
                          "commas over the run options below, or `default`; e.g. attention=tiled, layout=shards "
                          "(the seed's layout, S = 1), time_attention_every=0 (each step one compute pass), "
                          "merge_in_o=off (a split call's merge as its own dispatch). Default: "
                          + " ; ".join(DEFAULT_DECODE_MODES))
    dec.add_argument("--sample", action="store_true",
                     help="also time auto with GPU sampling (top-k 40, top-p 0.95) instead of the argmax")
    dec.add_argument("--model", type=Path, default=MODEL_ARTIFACT)
    dec.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    dec.add_argument("--json", type=Path)
    dec.add_argument("--profile", action="store_true",
                     help="also time every dispatch of one decode step alone (GPU us, bytes and GB/s per kernel "
                          "role) and each role's cost inside the step (the step as one pass without it)")
    dec.add_argument("--profile-repeats", type=int, default=5, help="profiled steps per context (medians)")
    dec.add_argument("--profile-in-pass", action="store_true",
                     help="with --profile: time the dispatches inside the step's one pass, as a step runs, "
                          "not each in a pass of its own (adapters that write timestamps inside passes)")
    add_run_options(dec, leave_out=("max_context",))
    dec.set_defaults(run=run_decode)


def run_decode(args) -> int:
    import asyncio

    from app.bench.decode import run_decode_bench

    args.modes = args.modes or [parse_mode(mode) for mode in DEFAULT_DECODE_MODES]
    asyncio.run(run_decode_bench(args))
    return 0


def add_prefill(sub) -> None:
    pre = sub.add_parser("prefill", help="time to first token: prefill tok/s, GPU, attention and matmul ms per chunk size")
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
    pre.set_defaults(run=run_prefill)


def run_prefill(args) -> int:
    import asyncio

    from app.bench.prefill import run_prefill_bench

    asyncio.run(run_prefill_bench(args))
    return 0


def add_page(sub) -> None:
    page = sub.add_parser(
        "page", help="the page's figures in Chromium: Ready, chat turns, the comparison, encode time per step",
        description="The page in Debian's Chromium (Playwright, headless), driven as a user does: time to Ready "
                    "(first visit, then from the browser's cache), a short prompt and the long document as chat "
                    "turns (TTFT, decode tok/s, median step and GPU ms), Compare nests on the long document "
                    "(identical text or the first divergence, tiled/sharded attention), the host's time to encode "
                    "a decode step. Without --gpu WebGPU runs on SwiftShader (the CPU): use --model tiny_chat.")
    page.add_argument("--model", default="smollm2", type=_page_model,
                      help="smollm2, tiny_chat or synthetic:SHAPE (e.g. synthetic:llama-3.2-1b: random weights "
                           "filled on the GPU)")
    # NVIDIA's f16 flag is chat.page.NVIDIA_F16_FLAG (not imported here: the parsers load no page or WebGPU
    # module; tests/test_page_boundary.py checks this help names it).
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
    page.add_argument("--first-turns", type=float, metavar="SECONDS",
                      help="before the other turns, the long document as a first turn right after Ready and again "
                           "after SECONDS idle (an idle GPU's clocks are low; e.g. 30)")
    page.add_argument("--first-tokens", type=int, help="tokens of each first turn's reply (default 32 with --gpu, else 4)")
    page.add_argument("--typing", type=float, default=0.0, metavar="SECONDS",
                      help="before each first turn, input events in the box for SECONDS, one every 0.1 s (default 0)")
    page.add_argument("--warm", choices=("on", "off"),
                      help="the page's clock warm while typing, ?warm=on or ?warm=off (static/clock_warm.js; "
                           "default: the page's, on for a GPU adapter)")
    page.add_argument("--lab", action="store_true",
                      help="run the page's kernel lab instead (?model=off): tiled vs sharded attention per layer")
    page.add_argument("--lab-contexts", type=_int_list, help="the lab's contexts (default: the page's for the adapter)")
    page.add_argument("--lab-iters", type=int, help="the lab's timed calls per row (default: the page's)")
    page.add_argument("--gguf", type=Path, help="after Ready, open this GGUF through the page's file input and run "
                                                "the turns on it at once (as a user would, while the page keeps it)")
    page.add_argument("--context", type=int, help="the context the page asks for (?context=; default 4096): a "
                                                   "model's own may cap it, e.g. a GGUF's context length")
    page.add_argument("--root", type=Path, default=STATIC)
    page.add_argument("--json", type=Path, help="also write every figure as JSON (with --lab: the lab's export)")
    add_run_options(page, leave_out=("max_context",))  # the page's URL takes them (?layout=shards:8, ...)
    page.set_defaults(run=run_page)


def run_page(args) -> int:
    from app.bench.page import run_page_bench

    if args.no_f16_flag and not args.gpu:
        print("python -m app bench page: error: --no-f16-flag goes with --gpu", file=sys.stderr)
        raise SystemExit(2)

    run_page_bench(args)
    return 0


def add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="a multi-turn conversation: TTFT and tokens/s with and without KV reuse")
    chat.add_argument("--turns", type=int, default=3, choices=range(1, 6), metavar="1..5")
    chat.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (greedy)")
    chat.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto")
    chat.add_argument("--synthetic", action="store_true",
                      help="random weights of SmolLM2's shape (the tokenizer still comes from --model)")
    chat.add_argument("--model", type=Path, default=MODEL_ARTIFACT)
    chat.add_argument("--kernels", type=Path, default=KERNEL_ARTIFACT)
    chat.add_argument("--json", type=Path)
    chat.set_defaults(run=run_chat)


def run_chat(args) -> int:
    import asyncio

    from app.bench.chat import run_chat_bench

    asyncio.run(run_chat_bench(args))
    return 0


def add_gguf(sub) -> None:
    gg = sub.add_parser("gguf", help="a GGUF opened directly: seconds to Ready, TTFT, decode tok/s")
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
    gg.set_defaults(run=run_gguf)


def run_gguf(args) -> int:
    import asyncio

    from app.bench.gguf import run_gguf_bench

    asyncio.run(run_gguf_bench(args))
    return 0
