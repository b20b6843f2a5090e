"""`python -m app bench page`: the host's time to encode one decode step in the page.

Serves static/ on loopback, opens it in Debian's Chromium (headless, through Playwright), loads
the model and runs `--steps` greedy decode steps twice in the same tab: every pass encoded by
Python through Pyodide's proxies, then decode steps replayed from their recorded passes by one call
into JS (static/replay.js). Reported per mode: the median and worst encode time (Python's clock,
from the pass's start to its submit), the dispatches per step and whether the ids agree.
SwiftShader's GPU work is slow, but the encode time does not wait for the GPU.
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
from pathlib import Path

# Debian's chromium, headless, WebGPU on (SwiftShader where there is no GPU); the tests use these too.
CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--disable-quic", "--disable-default-apps", "--disable-extensions",
]
LOAD_TIMEOUT_MS = 300_000


def run_page_bench(args) -> dict:
    import tempfile

    from playwright.sync_api import sync_playwright

    from app.server import make_server

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        raise SystemExit("Debian's chromium is not installed: run `make setup`")
    httpd = make_server(args.root, host="127.0.0.1", port=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/?model={args.model}"
    results = {}
    try:
        with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
            context = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True,
                                                            args=CHROMIUM_FLAGS)
            tab = context.new_page()
            tab.goto(url)
            tab.wait_for_function("() => window.demoState.chatReady || window.demoState.error",
                                  timeout=LOAD_TIMEOUT_MS)
            if tab.evaluate("window.demoState.error || null"):
                raise SystemExit(f"the page failed to load: {tab.evaluate('window.demoState.error')}")
            adapter = tab.evaluate("window.demoState.device && window.demoState.device.adapter")
            print(f"page {url}; adapter: {adapter}; {args.steps} decode steps per mode", flush=True)
            print(f"{'encoding':>22} {'median ms':>9} {'worst ms':>8} {'dispatches':>10} {'step ms':>8}")
            for replay in (False, True):
                raw = tab.evaluate("([steps, replay]) => window.demo.python('await page.decode_encode_benchmark("
                                   "chat, values[\"steps\"], values[\"replay\"])', {steps, replay})", [args.steps, replay])
                run = json.loads(raw)
                label = "JS replay (one call)" if replay else "Python, every dispatch"
                encode = run["encode_ms"][1:]  # the first decode step records the passes
                results[label] = {**run, "encode_median_ms": statistics.median(encode), "encode_worst_ms": max(encode)}
                print(f"{label:>22} {statistics.median(encode):>9.3f} {max(encode):>8.3f} "
                      f"{','.join(map(str, sorted(set(run['dispatches'])))):>10} "
                      f"{statistics.median(run['step_ms']):>8.1f}", flush=True)
            modes = list(results.values())
            same = modes[0]["token_ids"] == modes[1]["token_ids"]
            print(f"greedy ids identical in both modes: {same}; replayed by {modes[1]['replayed_by']}")
            context.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    result = {"url": url, "adapter": adapter, "steps": args.steps, "modes": results}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
