#!/usr/bin/env python3
"""The page's kernel lab in Chromium on a GPU machine, through ../shared/tools/gpu-page's driver.

After gpu_page.py's `receive` (pieces 1-2) and `gl` steps, on the GPU machine:
  python3 tools/gpu_lab.py [--set blog-f16 blog] [--iters 20] [--contexts 256,1024,3060,8192]
opens the page with ?model=off in each flag set, runs the kernel lab, and writes $OUT/lab-<set>.json
(the lab's export: adapter, dtype, browser, every row) and $OUT/lab-<set>.txt (the table).
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


def start_server():
    """The project's server over the site gpu_page unpacked (static/ and app/), with the test hooks
    (window.demo.python, asked for by ?hooks=python)."""
    import threading

    sys.path.insert(0, str(gpu_page.SITE))
    from app.server import make_server

    httpd = make_server(gpu_page.SITE / "static", host="127.0.0.1", port=0, hooks=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def run(flag_set: str, contexts: str, iters: int, timeout: float) -> dict:
    httpd, base = start_server()
    browser = gpu_page.Browser(gpu_page.flags_for(flag_set), gpu_page.OUT / f"chromium-lab-{flag_set}.log",
                               gpu_page.chromium_env())
    try:
        tab = browser.new_tab()
        tab.goto(f"{base}/?model=off&hooks=python")
        tab.wait("window.demoState && (window.demoState.ready || window.demoState.error)", 120)
        if tab.eval("window.demoState.error || null"):
            raise RuntimeError(tab.eval("window.demoState.error"))
        tab.eval(f"document.getElementById('lab-contexts').value = {json.dumps(contexts)}; "
                 f"document.getElementById('lab-iters').value = {iters}; "
                 "document.getElementById('lab-run').click(); true")
        seen = []

        def progress():  # the lab's status line, printed when it changes
            status = tab.eval("document.getElementById('lab-status').textContent", timeout=10)
            if not seen or status != seen[-1]:
                seen.append(status)
                print(f"{time.time() - tab.t0:7.1f} s  {status}", flush=True)

        try:
            tab.wait("window.demoState.lab || /failed|must be/.test(document.getElementById('lab-status').textContent)",
                     timeout, poll=1, on_poll=progress)
        except TimeoutError:
            try:  # is the page's Python worker still answering?
                print("worker:", tab.eval("window.demo.python('1 + 1')", timeout=10), flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"worker does not answer: {err}", flush=True)
            raise
        lab = tab.eval("window.demoState.lab")
        if not lab:
            raise RuntimeError(tab.eval("document.getElementById('lab-status').textContent"))
        lab["status"] = tab.eval("document.getElementById('lab-status').textContent")
        lab["device"] = tab.eval("window.demoState.device")
        return lab
    finally:
        browser.close()
        httpd.shutdown()


def table(lab: dict) -> str:
    lines = [f"{lab['adapter']} ({lab['dtype']}); {lab['status']}",
             f"{'shape':>16} {'context':>7} {'nest':>8} {'ran':>14} {'us/layer':>9} {'ms/step':>8} {'KV GB/s':>8} "
             f"{'tiled/sharded':>13} {'rel L2':>8}"]
    for r in lab["rows"]:
        if r.get("us") is None:
            lines.append(f"{r['shape']:>16} {r['context']:>7} {r['nest']:>8} {str(r.get('ran')):>14} {r.get('error')}")
            continue
        ratio = f"{r['tiled_over_sharded']:.2f}x" if r["tiled_over_sharded"] else "-"
        lines.append(f"{r['shape']:>16} {r['context']:>7} {r['nest']:>8} {r['ran']:>14} {r['us']:>9.1f} "
                     f"{r['step_ms']:>8.2f} {r['kv_gb_s']:>8.1f} {ratio:>13} {r['rel_l2']:>8.1e}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", nargs="+", default=["blog-f16", "blog"])
    parser.add_argument("--contexts", default="256,1024,3060,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    gpu_page.OUT.mkdir(parents=True, exist_ok=True)
    gpu_page.ensure_wrapper()
    for flag_set in args.set:
        lab = run(flag_set, args.contexts, args.iters, args.timeout)
        (gpu_page.OUT / f"lab-{flag_set}.json").write_text(json.dumps(lab, indent=1))
        text = table(lab)
        (gpu_page.OUT / f"lab-{flag_set}.txt").write_text(text + "\n")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
