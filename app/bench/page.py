"""`python -m app bench page`: the page's own figures, measured in Chromium as a user meets them.

Serves static/ on loopback (with the test hooks: app/hooks/), opens it in Debian's Chromium through
Playwright (headless), and drives the page as a user does, reading what it reports
(window.demoState):
- time to Ready: on the first visit (the weights downloaded) and after a reload (from the browser's
  cache);
- a short prompt as a chat turn: TTFT, decode tok/s, median step and GPU ms of its decode steps;
- the long document (static/long_document.txt, the page's Long document button) as a chat turn;
- Compare nests on the long document: identical text or the first divergence, the teacher-forced
  agreement and its misses' margins (near-ties or not), the median attention time of each nest past
  the switch and their ratio;
- the host's time to encode a decode step, Python through Pyodide's proxies against the recorded
  passes replayed by one call into JS (app.page_bench.decode);
- main-thread long tasks over the visit.
With `--prefill 512,1536,...` it also checks the loaded model's prefill matmuls against f64, times each
build, and runs the prefill at those prompt lengths (and two short follow-up turns), the subgroup-matrix
builds and the scalar kernels in turn (app.page_bench.prefill_check).
With `--lab` it runs the page's kernel lab instead (?model=off): decode attention per layer, tiled
against the sharded family, every row checked against the page's float64 reference, then timed.

`--gpu` starts Chromium with the flags that give WebGPU a real GPU on Linux (Vulkan through ANGLE,
GPU_FLAGS) and, unless `--no-f16-flag`, Dawn's toggle that lifts its shader-f16 blocklist on
NVIDIA (chat.page.NVIDIA_F16_FLAG). Without it Chromium runs WebGPU on SwiftShader (the CPU), where
`?model=tiny_chat` and the defaults there (4 tokens a turn, one visit, the long document cut just
past the switch) keep a run to a few minutes.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

from app.run_options_cli import given_options

# Debian's chromium, headless, WebGPU on (SwiftShader where there is no GPU); the tests use these too.
CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--disable-quic", "--disable-default-apps", "--disable-extensions",
]
# WebGPU on the machine's GPU in headless Chromium on Linux: Vulkan, through ANGLE, no window surface.
GPU_FLAGS = ["--use-angle=vulkan", "--enable-features=Vulkan", "--disable-vulkan-surface", "--ignore-gpu-blocklist"]
DEFAULT_CHROMIUM = "/usr/bin/chromium"  # Debian's (make setup installs it)
SHORT_PROMPT = "What is the capital of France?"
# Tokens per turn and decode steps per mode of the encode benchmark: on a GPU, enough for steady
# figures; on SwiftShader a tiny_chat decode step takes 0.5-5 s (Dawn zero-fills workgroup memory).
GPU_TOKENS = {"short": 32, "long": 64, "compare": 64, "steps": 8, "first": 32}
CPU_TOKENS = {"short": 4, "long": 4, "compare": 4, "steps": 4, "first": 4}
KEY_INTERVAL_S = 0.1  # --typing: one input event this often, as a typist's keys make them
# SwiftShader prefills the whole document (~1,500 tokens) in minutes: by default it gets its head, cut
# at a space before this many characters (just past the switch, as tests/test_browser_chat_features.py).
CPU_LONG_CHARS = 1100
LOAD_TIMEOUT_MS = 300_000
REPLY_TIMEOUT_MS = 600_000


def chromium_flags(gpu: bool, f16_flag: bool = True) -> list[str]:
    """Chromium's command line: SwiftShader's (the tests'), or a real GPU's (with NVIDIA's f16 toggle)."""
    from chat.page import NVIDIA_F16_FLAG  # imported here: `python -m app` reads this module's constants

    if not gpu:
        return list(CHROMIUM_FLAGS)
    return CHROMIUM_FLAGS + GPU_FLAGS + ([NVIDIA_F16_FLAG] if f16_flag else [])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def step_medians(stats: list[dict]) -> dict:
    """Median step, GPU, encode, wait and attention ms over a run's decode steps."""
    decode = [s for s in stats if s["kind"] == "decode"]
    return {"decode_steps": len(decode), "kernels": sorted({s["kernel"] for s in decode}),
            **{f"median_{key}": _median([s[key] for s in decode])
               for key in ("step_ms", "gpu_ms", "encode_ms", "wait_ms", "attention_ms")}}


class PageDriver:
    """One tab on the page: loads, chat turns and the comparison, as the page's buttons run them."""

    def __init__(self, tab, url: str):
        self.tab = tab
        self.url = url

    def load(self) -> dict:
        """Navigate (or reload) and wait for Ready; the page's time to Ready and where the weights came from."""
        started = time.perf_counter()
        self.tab.goto(self.url)
        self.tab.wait_for_function("() => window.demoState.chatReady || window.demoState.error",
                                   timeout=LOAD_TIMEOUT_MS)
        error = self.tab.evaluate("window.demoState.error || null")
        if error:
            raise SystemExit(f"the page failed to load: {error}")
        state = self.tab.evaluate("({readyAt: window.demoState.readyAt, weights: window.demoState.weights, "
                                  "info: window.demoState.info, device: window.demoState.device})")
        return {"ready_s": state["readyAt"] / 1e3, "wall_s": time.perf_counter() - started,
                "weights": state["weights"], "dtype": state["info"]["dtype"], "device": state["device"]}

    def open_gguf(self, path: Path) -> dict:
        """Open a GGUF through the page's file input, as a person does: seconds to its Ready (the page then
        keeps it in the browser's cache in the background, while the next turns run)."""
        def said(start: str) -> str:  # a line of the page's loading steps starts with `start`
            return f"[...document.querySelectorAll('#progress li')].some(li => li.textContent.startsWith({json.dumps(start)}))"

        started = time.perf_counter()
        self.tab.set_input_files("#gguf-file", str(path))
        self.tab.wait_for_function(f"() => {said('Ready: ' + path.name)} || {said('Cannot open ' + path.name)}",
                                   timeout=LOAD_TIMEOUT_MS)
        seconds = time.perf_counter() - started
        error = self.tab.evaluate("document.getElementById('error').hidden ? null : "
                                  "document.getElementById('error').textContent")
        if error:
            raise SystemExit(f"the page refused {path}: {error}")
        return {"file": path.name, "bytes": path.stat().st_size, "ready_s": seconds,
                "status": self.tab.evaluate("document.getElementById('status-summary').textContent")}

    def keeping(self) -> dict | None:
        """How far the page's keeping of an opened GGUF is (stage, bytes done of total, holds for replies)."""
        return self.tab.evaluate("window.demoState.keeping ? {...window.demoState.keeping} : null")

    def new_chat(self) -> None:
        """New chat, waited until the page has emptied the conversation (its export table too)."""
        self.tab.click("#new-chat")
        self.tab.wait_for_function("() => window.demoState.replies.length === 0 && !window.demoState.busy")

    def _wait(self, done: str) -> None:
        self.tab.wait_for_function(f"() => ({done}) || (!document.getElementById('chat-error').hidden "
                                   "&& !window.demoState.busy)", timeout=REPLY_TIMEOUT_MS)
        error = self.tab.evaluate("document.getElementById('chat-error').hidden ? null : "
                                  "document.getElementById('chat-error').textContent")
        if error:
            raise SystemExit(f"the page refused the turn: {error}")

    def _press(self, button: str, result: str, text: str, max_tokens: int) -> tuple[dict, float]:
        """Type `text`, press `button` and wait for window.demoState[`result`]: (it, wall seconds)."""
        self.tab.fill("#max-tokens", str(max_tokens))
        self.tab.fill("#prompt", text)
        self.tab.evaluate(f"window.demoState.{result} = null")
        started = time.perf_counter()
        self.tab.click(button)
        self._wait(f"window.demoState.{result}")
        wall = time.perf_counter() - started
        return self.tab.evaluate(f"window.demoState.{result}"), wall

    def reply(self, text: str, max_tokens: int) -> dict:
        """One chat turn through Send: the reply's speed figures and its decode steps' medians."""
        reply, wall = self._press("#send", "lastReply", text, max_tokens)
        stats = self.tab.evaluate("window.demoState.replies[window.demoState.replies.length - 1].stats")
        return {"prompt_tokens": reply["prompt_tokens"], "tokens": len(reply["token_ids"]),
                "stop_reason": reply["stop_reason"], "speed": reply["speed"], "wall_s": wall,
                **step_medians(stats), "text": reply["text"]}

    def first_turn(self, text: str, max_tokens: int, typing_s: float) -> dict:
        """A turn in a new chat after `typing_s` seconds of input events in the box (the clock warm,
        ?warm=on, runs on them): `reply`'s figures."""
        self.new_chat()
        self.tab.fill("#prompt", text)
        ends = time.perf_counter() + typing_s
        while time.perf_counter() < ends:
            self.tab.evaluate("document.getElementById('prompt').dispatchEvent(new Event('input'))")
            time.sleep(KEY_INTERVAL_S)
        return self.reply(text, max_tokens)

    def compare(self, text: str, max_tokens: int) -> dict:
        """Compare nests: the verdict, the teacher-forced agreement, the attention past the switch."""
        result, wall = self._press("#compare", "lastCompare", text, max_tokens)
        runs = self.tab.evaluate("window.demoState.replies.filter((r) => r.reply.startsWith('compare'))")
        return {**result, "wall_s": wall,
                "runs": {r["reply"].split()[-1]: {"speed": r["speed"], **step_medians(r["stats"])} for r in runs}}

    def long_document(self, chars: int) -> str:
        """The text the Long document button puts in the box; with `chars`, the document cut at a
        space before that many characters (the question after it kept)."""
        self.tab.fill("#prompt", "")
        self.tab.click("#long-document")
        self.tab.wait_for_function("() => document.getElementById('prompt').value.length > 0")
        text = self.tab.input_value("#prompt")
        if not chars:
            return text
        question = text[text.rindex("\n\n"):]
        return text[:text.rindex(" ", 0, chars)] + question

    def encode_benchmark(self, steps: int) -> dict:
        """`steps` decode steps encoded by Python, then replayed by one JS call (the same greedy ids)."""
        modes = {}
        for replay in (False, True):
            run = self.bench("decode_encode_benchmark", steps=steps, replay=replay)
            encode = run["encode_ms"][1:]  # the first decode step records the passes
            modes["replay" if replay else "python"] = {
                **run, "encode_median_ms": statistics.median(encode), "encode_worst_ms": max(encode),
                "step_median_ms": statistics.median(run["step_ms"])}
        modes["ids_identical"] = modes["python"]["token_ids"] == modes["replay"]["token_ids"]
        return modes

    def depth_sweep(self, steps: int, context: int, depths: list[int], rounds: int = 2) -> dict:
        """`steps` replayed greedy decode steps after `context` prompt tokens at each pipeline depth,
        the depths alternated `rounds` times: decode tok/s, median step and GPU ms, and the GPU's idle
        time between passes (median and mean: a stall shows in the mean)."""
        runs = {depth: [] for depth in depths}
        for _ in range(rounds):
            for depth in depths:
                run = self.bench("decode_encode_benchmark", steps=steps, replay=True, context=context,
                                 pipeline_depth=depth)
                gaps = [g for g in run["gpu_gap_ms"] if g is not None]
                runs[depth].append({"decode_tok_s": run["decode_tok_s"], "step_median_ms": _median(run["step_ms"]),
                                    "gpu_median_ms": _median(run["gpu_ms"]), "gap_median_ms": _median(gaps),
                                    "gap_mean_ms": sum(gaps) / len(gaps) if gaps else None})
        return {"context": context, "steps": steps, "runs": runs}

    def prefill(self, tokens: list[int], rounds: int = 2, document: str | None = None) -> dict:
        """The loaded model's prefill kernels checked against f64 and timed per build, then the prefill
        benchmark (app.page_bench.prefill_check) with the subgroup-matrix builds and the scalar kernels in
        turn, and with a `document` (real weights) both paths' greedy replies to it."""
        result = {"check": self.bench("check_prefill_kernels"), "timed": self.bench("time_prefill_kernels"), "runs": []}
        builds = (True, False) if self.bench("prefill_builds")["matrix"] else (False,)
        for _ in range(rounds):
            for matrix in builds:
                result["runs"].append(self.bench("prefill_benchmark", tokens=list(tokens), matrix=matrix))
        if document and len(builds) == 2:
            result["agreement"] = self.bench("matrix_agreement", text=document)
        return result

    def bench(self, name: str, **values):
        """A page benchmark (app.page_bench.CALLS[name]) in the page's worker, through the bench hook."""
        return self.tab.evaluate("([name, values]) => window.demo.bench(name, values)", [name, values])

    def lab(self, contexts: list[int] | None, iters: int | None) -> dict:
        """The kernel lab (?model=off), as its Run button runs it: every row f64-checked, then timed;
        contexts and iterations default to the page's for this adapter. Its export's fields."""
        self.tab.goto(self.url)
        self.tab.wait_for_function("() => window.demoState.ready || window.demoState.error", timeout=LOAD_TIMEOUT_MS)
        if self.tab.evaluate("window.demoState.error || null"):
            raise SystemExit(f"the page failed to load: {self.tab.evaluate('window.demoState.error')}")
        self.tab.click("#lab-details summary")  # opens the lab's panel
        if contexts:
            self.tab.fill("#lab-contexts", ",".join(map(str, contexts)))
        if iters:
            self.tab.fill("#lab-iters", str(iters))
        self.tab.evaluate("window.demoState.lab = null")
        self.tab.click("#lab-run")
        self.tab.wait_for_function("() => window.demoState.lab || /failed|must be/.test("
                                   "document.getElementById('lab-status').textContent)", timeout=REPLY_TIMEOUT_MS)
        lab = self.tab.evaluate("window.demoState.lab")
        status = self.tab.inner_text("#lab-status")
        if not lab:
            raise SystemExit(f"the kernel lab failed: {status}")
        return {**lab, "status": status, "device": self.tab.evaluate("window.demoState.device")}

    def long_tasks(self) -> dict:
        tasks = self.tab.evaluate("window.demoState.longTasks")
        return {"count": len(tasks), "worst_ms": max((t["duration"] for t in tasks), default=0)}


def _num(value, digits=1, unit=""):
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def report_rows(result: dict) -> list[tuple[str, str]]:
    """The table `run_page_bench` prints: (figure, value) rows."""
    rows = []
    for load in result["loads"]:
        source = (load["weights"] or {}).get("source")
        rows.append((f"Ready (weights from the {source})", _num(load["ready_s"], 2, " s")))
    if "gguf" in result:
        g = result["gguf"]
        rows.append((f"{g['file']} ({g['bytes'] / 2**20:,.0f} MiB) opened: Ready", _num(g["ready_s"], 2, " s")))
        for turn_name in ("short", "long"):
            keeping = g.get(f"keeping_at_{turn_name}") or {}
            if keeping:
                rows.append((f"  kept in the cache when the {turn_name} turn began",
                             f"{keeping.get('stage')}: {keeping.get('done', 0) / 2**20:,.0f} of "
                             f"{keeping.get('total', 0) / 2**20:,.0f} MiB"))

    def turn(label, run):
        speed = run["speed"]
        rows.append((f"{label} ({run['prompt_tokens']:,} prompt tokens): TTFT", _num(speed["ttft_ms"], 0, " ms")))
        rows.append((f"{label}: decode ({run['decode_steps']} steps)",
                     f"{_num(speed['decode_tok_s'])} tok/s; median step {_num(run['median_step_ms'], 2, ' ms')}, "
                     f"GPU {_num(run['median_gpu_ms'], 2, ' ms')}, attention {_num(run['median_attention_ms'], 3, ' ms')}"))

    first = result.get("first_turns")
    if first:
        typing = f"{first['typing_s']:g} s of typing" + (f", ?warm={first['warm']}" if first["warm"] else "")
        turn(f"first turn after load ({typing})", first["after_load"])
        turn(f"first turn after {first['idle_s']:g} s idle ({typing})", first["after_idle"])
    for key, label in (("short", "short prompt"), ("long", "long document")):
        if key in result:
            turn(label, result[key])
    if "compare" in result:
        c = result["compare"]
        rows.append((f"compare nests ({c['prompt_tokens']:,} prompt tokens)",
                     "identical greedy text" if c["identical"] else f"first divergence at token {c['first_divergence']}"))
        forced = c["teacher_forced"]
        rows.append(("  teacher-forced agreement", f"{forced['matches']}/{forced['steps']}"))
        misses = forced.get("misses") or []
        if misses:
            margins = [m["sharded"]["margin"] for m in misses]
            rows.append(("  teacher-forced misses", f"{sum(m['near_tie'] for m in misses)} of {len(misses)} near-ties "
                                                    f"(within {forced['near_tie_logits']} logit); sharded margins "
                                                    f"{min(margins):.3g}-{max(margins):.3g}"))
        past = c["past_switch"]
        med = past["median_attention_ms"]
        ratio = "-" if past["speedup"] is None else f"{past['speedup']:.2f}x"
        rows.append((f"  attention past {result['switch_at']} tokens (median)",
                     f"tiled {_num(med['tiled'], 3, ' ms')}, sharded {_num(med['sharded'], 3, ' ms')}: "
                     f"tiled/sharded {ratio}"))
        for nest, run in c["runs"].items():
            rows.append((f"  {nest} run: decode", f"{_num(run['speed']['decode_tok_s'])} tok/s, median step "
                                                  f"{_num(run['median_step_ms'], 2, ' ms')}, GPU {_num(run['median_gpu_ms'], 2, ' ms')}"))
    if "encode" in result:
        e = result["encode"]
        rows.append(("encode a decode step: Python / JS replay",
                     f"{e['python']['encode_median_ms']:.3f} / {e['replay']['encode_median_ms']:.3f} ms (median); "
                     f"ids identical: {e['ids_identical']}"))
    for r in (result.get("prefill") or {}).get("check", []):
        rows.append((f"prefill check {r['kernel']} ({r['tokens']} tokens{f' after {r['start']}' if r.get('start') else ''})",
                     f"rel L2 {r['rel_l2']:.1e} vs f64 {'ok' if r['ok'] else 'WRONG'}"))
    for r in (result.get("prefill") or {}).get("timed", []):
        rows.append((f"prefill {r['role']} {r['kernel']} {r['shape']}", f"{r['us']:.1f} us, {r['tflops']:.1f} TFLOP/s"))
    agreement = (result.get("prefill") or {}).get("agreement")
    if agreement:
        rows.append((f"prefill matrix vs scalar, greedy reply to the long document ({agreement['tokens']} tokens)",
                     "identical" if agreement["identical"] else
                     f"first divergence at token {agreement['first_divergence']}, teacher-forced "
                     f"{agreement['teacher_forced']}/{agreement['tokens']}"))
    for run in (result.get("prefill") or {}).get("runs", []):
        for r in run["rows"]:
            rows.append((f"prefill {'matrix' if run['prefill_matrix'] else 'scalar'} {r['turn']} {r['tokens']} tokens",
                         f"GPU {r['gpu_ms']:.1f} ms (attention {r['attention_ms']:.1f}), "
                         f"{_num(r['tok_s_gpu'], 0)} tok/s, TTFT {r['ttft_ms']:.0f} ms"))
    if "depths" in result:
        d = result["depths"]
        for depth, runs in d["runs"].items():
            rows.append((f"decode at {d['context']:,} tokens, {depth} steps in flight",
                         "; ".join(f"{_num(r['decode_tok_s'])} tok/s, step {_num(r['step_median_ms'], 2, ' ms')}, "
                                   f"GPU {_num(r['gpu_median_ms'], 3, ' ms')}, GPU idle between passes "
                                   f"{_num(r['gap_median_ms'], 3)} / {_num(r['gap_mean_ms'], 3, ' ms')} (median / mean)"
                                   for r in runs)))
    tasks = result["long_tasks"]
    rows.append(("main-thread long tasks (> 50 ms)", f"{tasks['count']} (worst {tasks['worst_ms']:.0f} ms)"))
    return rows


def lab_table(lab: dict) -> str:
    """The lab's rows as text: per shape, context and nest, what ran and its time."""
    lines = [f"{lab['adapter']} ({lab['dtype']}): {lab['status']}",
             f"{'shape':>16} {'context':>7} {'nest':>8} {'ran':>16} {'us/layer':>9} {'ms/step':>8} {'KV GB/s':>8} "
             f"{'tiled/sharded':>13} {'rel L2':>8}"]
    for r in lab["rows"]:
        head = f"{r['shape']:>16} {r['context']:>7} {r['nest']:>8} {str(r.get('ran')):>16}"
        if r.get("us") is None:
            lines.append(f"{head} {r.get('error')}")
            continue
        ratio = f"{r['tiled_over_sharded']:.2f}x" if r["nest"] == "sharded" and r.get("tiled_over_sharded") else ""
        lines.append(f"{head} {r['us']:>9.1f} {r['step_ms']:>8.2f} {r['kv_gb_s']:>8.1f} {ratio:>13} {r['rel_l2']:>8.1e}")
    return "\n".join(lines)


def run_page_bench(args) -> dict:
    from playwright.sync_api import sync_playwright

    from app.server import make_server
    from chat.api import constants

    chromium = args.chromium or shutil.which("chromium") or DEFAULT_CHROMIUM
    if not Path(chromium).exists():
        raise SystemExit(f"no Chromium at {chromium}: `make setup` installs Debian's (or pass --chromium PATH)")
    flags = chromium_flags(args.gpu, not args.no_f16_flag)
    tokens = {**(GPU_TOKENS if args.gpu else CPU_TOKENS),
              **{k: v for k, v in (("short", args.short_tokens), ("long", args.long_tokens), ("first", args.first_tokens),
                                   ("compare", args.compare_tokens), ("steps", args.steps)) if v is not None}}
    long_chars = args.long_chars if args.long_chars is not None else (0 if args.gpu else CPU_LONG_CHARS)
    visits = 2 if (args.gpu if args.reload is None else args.reload) else 1
    httpd = make_server(args.root, host="127.0.0.1", port=0, hooks=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    model = "off" if args.lab else args.model
    context = {"context": args.context} if args.context else {}  # the page's ?context= (its default: 4,096)
    warm = {"warm": args.warm} if args.warm else {}
    url = f"http://127.0.0.1:{httpd.server_address[1]}/?" + urlencode({"model": model, "hooks": "python,bench", **context,
                                                                        **warm, **given_options(args)}, safe=":,")
    result = {"url": url, "chromium": chromium, "flags": flags, "tokens": tokens, "long_chars": long_chars,
              "switch_at": constants()["SWITCH_AT"], "loads": []}
    say = lambda text: print(text, flush=True)  # noqa: E731
    try:
        with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
            context = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True,
                                                            args=flags)
            try:
                page = PageDriver(context.new_page(), url)
                if args.lab:
                    result["lab"] = page.lab(args.lab_contexts, args.lab_iters)
                    print(lab_table(result["lab"]), flush=True)
                    return _write_json(args, result)
                for visit in range(visits):
                    load = page.load()
                    result["loads"].append(load)
                    say(f"visit {visit + 1}: Ready in {load['ready_s']:.2f} s (weights: {(load['weights'] or {}).get('source')})")
                result.update(adapter=load["device"]["adapter"], dtype=load["dtype"], device=load["device"])
                say(f"page {url}\nadapter: {result['adapter']} ({load['device']['backend']}), {result['dtype']} kernels")
                if args.gguf:  # the turns below are typed at once after its Ready, while the page keeps it
                    result["gguf"] = page.open_gguf(args.gguf)
                    say(f"opened {args.gguf.name} in {result['gguf']['ready_s']:.2f} s: {result['gguf']['status']}")
                    result["gguf"]["keeping_at_short"] = page.keeping()
                if args.first_turns is not None:  # first, while the load's work is the GPU's last
                    document = page.long_document(long_chars)
                    first = {"idle_s": args.first_turns, "typing_s": args.typing, "warm": args.warm}
                    first["after_load"] = page.first_turn(document, tokens["first"], args.typing)
                    time.sleep(args.first_turns)
                    first["after_idle"] = page.first_turn(document, tokens["first"], args.typing)
                    result["first_turns"] = first
                    say(f"first turns: after load, and after {args.first_turns:g} s idle")
                result["short"] = page.reply(SHORT_PROMPT, tokens["short"])
                say(f"short prompt: {result['short']['tokens']} tokens")
                document = page.long_document(long_chars)
                page.new_chat()
                if args.gguf:
                    result["gguf"]["keeping_at_long"] = page.keeping()
                result["long"] = page.reply(document, tokens["long"])
                say(f"long document: {result['long']['prompt_tokens']} prompt tokens")
                page.new_chat()
                result["compare"] = page.compare(document, tokens["compare"])
                say("comparison done")
                if tokens["steps"]:
                    result["encode"] = page.encode_benchmark(tokens["steps"])
                if args.depths:
                    result["depths"] = page.depth_sweep(args.depth_steps, args.depth_context, args.depths)
                if args.prefill:
                    result["prefill"] = page.prefill(args.prefill, document=None if model.startswith("synthetic")
                                                     else document)
                result["long_tasks"] = page.long_tasks()
            finally:
                context.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    rows = report_rows(result)
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows), flush=True)
    return _write_json(args, result)


def _write_json(args, result: dict) -> dict:
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result
