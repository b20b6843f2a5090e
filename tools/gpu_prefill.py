#!/usr/bin/env python3
"""The page's prefill on a GPU machine, through ../shared/tools/gpu-page's driver (as tools/gpu_lab.py).

After gpu_page.py's `receive` (pieces 1-2; 3-4 too for smollm2) and `gl` steps, on the GPU machine:
  python3 tools/gpu_prefill.py [--models synthetic:llama-3.1-8b,...] [--set blog-f16] [--rounds 2]
For each model it opens the page (?model=M&hooks=python) and, in the page's Python worker
(chat.prefill_check): checks every prefill kernel build the model runs (matmuls and attention)
against float64, times each at full size, runs the prefill benchmark with the subgroup-matrix builds and the scalar kernels in
turn (`--rounds` times each, alternating), and for real weights compares the two builds' greedy
replies to the long document. Writes $OUT/prefill-<model>.json and prints a table.
Standard library only, like gpu_page.py, which it imports from .cr/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / ".cr"))
import gpu_page  # noqa: E402 (the driver bundle.sh copies to .cr/)
from gpu_lab import start_server  # noqa: E402


def in_page(tab, code: str, timeout: float):
    """Python run in the page's worker (the test hook), its JSON result decoded."""
    return json.loads(tab.eval(f"window.demo.python({json.dumps(code)})", timeout=timeout))


def run(model: str, flag_set: str, rounds: int, tokens: str, timeout: float, agreement_tokens: int,
        context: int) -> dict:
    httpd, base = start_server()
    browser = gpu_page.Browser(gpu_page.flags_for(flag_set), gpu_page.OUT / "chromium-prefill.log",
                               gpu_page.chromium_env())
    out: dict = {"model": model, "flag_set": flag_set}
    try:
        tab = browser.new_tab()
        tab.goto(f"{base}/?model={model}&context={context}&hooks=python")
        tab.wait("window.demoState && (window.demoState.chatReady || window.demoState.error)", timeout)
        if tab.eval("window.demoState.error || null"):
            raise RuntimeError(tab.eval("window.demoState.error"))
        out["load_s"] = round(time.time() - tab.t0, 2)
        out["device"] = tab.eval("window.demoState.device")
        out["adapter_panel"] = tab.eval("document.getElementById('adapter').innerText")
        setup = "import json, chat.prefill_check as pc; model = chat.model\n"
        out["loaded"] = in_page(tab, setup + "json.dumps({'dtype': model.dtype, 'matrix': model.has_prefill_matrix, "
                                "'why_not': model.prefill_matrix_why_not})", 60)
        print(f"{model}: {json.dumps(out['loaded'])}", flush=True)
        out["check"] = in_page(tab, "json.dumps(await pc.check_prefill_kernels(model))", timeout)
        for r in out["check"]:
            print(f"  check {r['kernel']:>44} n={r['tokens']:>4}: rel L2 {r['rel_l2']:.2e} {'ok' if r['ok'] else 'WRONG'}",
                  flush=True)
        out["timed"] = in_page(tab, "json.dumps(await pc.time_prefill_kernels(model))", timeout)
        for r in out["timed"]:
            print(f"  timed {r['kernel']:>44} {r['shape']:>22}: {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s", flush=True)
        out["bench"] = []
        for i in range(rounds):
            for matrix in ((True, False) if out["loaded"]["matrix"] else (False,)):
                bench = in_page(tab, f"json.dumps(await pc.prefill_benchmark(model, tokens=({tokens},), "
                                     f"matrix={matrix}))", timeout)
                bench["round"] = i
                out["bench"].append(bench)
                for r in bench["rows"]:
                    print(f"  bench round {i} matrix={matrix!s:5} {r['turn']:>9} {r['tokens']:>5} tok: GPU "
                          f"{r['gpu_ms']:8.2f} ms (attention {r['attention_ms']:7.2f}) {r['tok_s_gpu'] or 0:9.0f} "
                          f"tok/s, TTFT {r['ttft_ms']:8.1f} ms  [{r['kernel']}]", flush=True)
        if agreement_tokens and out["loaded"]["matrix"] and not model.startswith("synthetic"):
            text = (gpu_page.SITE / "static" / "long_document.txt").read_text()
            out["agreement"] = in_page(tab, f"json.dumps(await pc.matrix_agreement(chat, {json.dumps(text)}, "
                                            f"{agreement_tokens}))", timeout)
            print(f"  agreement: {json.dumps({k: v for k, v in out['agreement'].items() if 'text' not in k})}",
                  flush=True)
            out["golden"] = in_page(tab, "json.dumps(await pc.matrix_agreement(chat, "
                                         "'What is the capital of France?', 12))", timeout)
            print(f"  golden: {json.dumps(out['golden'])}", flush=True)
        return out
    finally:
        browser.close()
        httpd.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="synthetic:llama-3.1-8b,synthetic:llama-3.2-1b")
    parser.add_argument("--set", default="blog-f16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", default="512,1536,3060,8000")
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--context", type=int, default=8192, help="the page's ?context= (the KV cache's tokens)")
    args = parser.parse_args()
    gpu_page.OUT.mkdir(parents=True, exist_ok=True)
    gpu_page.ensure_wrapper()
    status = 0
    for model in args.models.split(","):
        try:
            out = run(model, args.set, args.rounds, args.tokens, args.timeout, args.agreement_tokens, args.context)
        except Exception as err:  # noqa: BLE001 (report, go on with the next model)
            print(f"{model}: FAILED {type(err).__name__}: {err}", flush=True)
            out, status = {"model": model, "error": f"{type(err).__name__}: {err}"}, 1
        name = model.replace(":", "-")
        (gpu_page.OUT / f"prefill-{name}.json").write_text(json.dumps(out, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
