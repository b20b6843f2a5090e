"""Command line: `python -m app build | serve | bench`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
KERNEL_ARTIFACT = STATIC / "artifacts" / "kernels"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build", help="compile the kernels to WGSL + manifest (needs apache-tvm)")
    build.add_argument("--out", type=Path, default=KERNEL_ARTIFACT)
    build.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))

    serve = sub.add_parser("serve", help="serve the page (static files) on loopback")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--root", type=Path, default=STATIC)

    bench = sub.add_parser("bench", help="benchmarks (native WebGPU through wgpu)")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    attn = bench_sub.add_parser("attention", help="tiled vs sharded paged decode attention")
    attn.add_argument("--head-dims", type=_int_list, default=[64, 128, 256])
    attn.add_argument("--contexts", type=_int_list, default=[256, 1024, 3060, 8192])
    attn.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto",
                      help="auto: float16 where the adapter has shader-f16")
    attn.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    attn.add_argument("--timing", choices=["auto", "timestamps", "wall"], default="auto",
                      help="auto: GPU timestamps where the adapter has them, else wall clock")
    attn.add_argument("--json", type=Path, help="also write the results as JSON")
    attn.add_argument("--artifact", type=Path, default=KERNEL_ARTIFACT)

    args = parser.parse_args(argv)
    if args.command == "build":
        from kernels.build import build_artifact

        build_artifact(args.out, jobs=args.jobs)
    elif args.command == "serve":
        from app.server import serve as run_server

        if not (args.root / "pyodide" / "pyodide.mjs").exists():
            print("warning: static/pyodide is missing; `make demo` sets it up", file=sys.stderr)
        run_server(args.root, args.host, args.port)
    elif args.command == "bench" and args.what == "attention":
        import asyncio

        from app.bench_attention import run_attention_bench

        asyncio.run(run_attention_bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
