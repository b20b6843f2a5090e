"""What chat users expect from the page, in headless Chromium (SwiftShader, `?model=tiny_chat`):
cached loads, multi-turn cache reuse with speed figures, exports, GPU sampling, the long-document
comparison (its screenshot is the README's), readable charts, and a main thread that stays free.
"""

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, open_page, run_comparison
from page_hooks import install_page_hooks

pytestmark = pytest.mark.browser
LOAD_TIMEOUT_MS = 300_000
REPLY_TIMEOUT_MS = 300_000
SCREENSHOTS = ROOT / "docs" / "screenshots"  # git-ignored: rewritten by every run


def open_chat(browser, server, hooks: str = "python"):
    tab = open_page(browser, server + f"/?model=tiny_chat&hooks={hooks}",
                    "window.demoState.chatReady || window.demoState.error", LOAD_TIMEOUT_MS)
    assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
    return tab


def weights_requests(tab):
    return [u for u in tab.requests if u.endswith("/artifacts/tiny_chat/weights.bin")]


def send(tab, text, max_tokens):
    tab.fill("#max-tokens", str(max_tokens))
    tab.fill("#prompt", text)
    tab.evaluate("window.demoState.lastReply = null")
    tab.click("#send")
    tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
    return tab.evaluate("window.demoState.lastReply")


@pytest.fixture(scope="module")
def tab(browser, server):
    """The module's page, opened on an empty cache: it downloads the weights and caches them; with the
    page benchmarks' hook (window.demo.bench) beside window.demo.python."""
    tab = open_chat(browser, server, hooks="python,bench")
    assert tab.evaluate("window.demoState.weights.source") == "network"
    assert len(weights_requests(tab)) == 1
    yield tab
    tab.close()


def test_a_second_load_takes_the_weights_from_the_browser_cache(tab, browser, server):
    assert tab.evaluate("window.demoState.weights.source") == "network"
    assert tab.evaluate("document.getElementById('status-details').open") is False  # folded once ready
    assert "ready" in tab.inner_text("#status-summary")
    again = open_chat(browser, server)
    try:
        assert again.evaluate("window.demoState.weights") == {"source": "cache", "dropped": False}
        assert weights_requests(again) == []  # no weights file fetched at all
        assert "Browser cache: 1 model weights file" in again.inner_text("#cache-info")
    finally:
        again.close()


def test_the_clock_warm_is_off_by_default_on_a_cpu_adapter(tab):
    """On SwiftShader (a CPU adapter: no clocks to hold) typing runs no warm kernel unless ?warm=on asks,
    and the adapter panel says so. (On by default on a GPU adapter: a benchmark, docs/benchmarks.md.)"""
    warm = tab.evaluate("({...window.demoState.warm})")
    assert not warm["on"] and "CPU adapter" in warm["reason"], warm
    tab.type("#prompt", "x")
    assert tab.evaluate("window.demoState.warm.dispatches") == 0
    tab.fill("#prompt", "")
    assert "off on a CPU adapter (?warm=on runs it anyway)" in tab.inner_text("#adapter")


def test_the_clock_warm_is_on_by_default_on_a_gpu_adapter_and_off_when_asked(tab):
    """ClockWarm.open's choice for each ?warm and adapter kind (SwiftShader stands in for the GPU)."""
    chosen = tab.evaluate("""async () => {
        const { ClockWarm } = await import(new URL('clock_warm.js', location.href).href);
        const on = {};
        for (const [mode, cpu] of [[null, false], ['off', false], [null, true], ['on', true], ['off', true]]) {
            const warm = new ClockWarm(() => false);
            await warm.open(mode, cpu);
            on[`${mode} ${cpu ? 'cpu' : 'gpu'}`] = warm.status.on;
            if (warm.gpu) warm.gpu.destroy();
        }
        return on;
    }""")
    assert chosen == {"null gpu": True, "off gpu": False, "null cpu": False, "on cpu": True, "off cpu": False}, chosen


def test_the_page_benchmarks_run_through_their_hook_not_through_source_strings(tab):
    """window.demo.bench (app/hooks/bench.js) runs app.page_bench's calls in the worker, where that
    package was copied at boot (the wheel does not hold it): the decode encode benchmark, Python-encoded
    and replayed, gives the same greedy ids; an unknown name is refused with the list."""
    runs = {replay: tab.evaluate("(replay) => window.demo.bench('decode_encode_benchmark', {steps: 3, replay})", replay)
            for replay in (False, True)}
    assert runs[False]["token_ids"] == runs[True]["token_ids"] and len(runs[True]["encode_ms"]) == 3, runs
    assert runs[True]["replayed_by"] and not runs[False]["replayed_by"]
    assert tab.evaluate("window.demo.bench('prefill_builds', {})") == {"dtype": "float32", "matrix": False}
    refused = tab.evaluate("window.demo.bench('no_such', {}).then(() => null, (err) => String(err.message))")
    assert "no page benchmark 'no_such'" in refused and "decode_encode_benchmark" in refused, refused


def test_a_corrupted_cache_entry_is_dropped_and_fetched_again_and_the_cache_can_be_cleared(tab, browser, server):
    # overwrite the cached weights (same key) with bytes of the right length, one flipped (from the
    # module's page: the same profile, so the same cache)
    tab.evaluate("""async () => {
        const cache = await caches.open("sharded-decode-demo-weights");
        const [key] = await cache.keys();
        const bytes = new Uint8Array(await (await cache.match(key)).arrayBuffer());
        bytes[12345] ^= 0xff;
        await cache.put(key, new Response(bytes, {headers: {"X-Weights-Bytes": String(bytes.length)}}));
    }""")
    fresh = open_chat(browser, server)
    try:
        assert fresh.evaluate("window.demoState.weights") == {"source": "network", "dropped": True}
        assert len(weights_requests(fresh)) == 1
        assert "did not match its sha256" in fresh.text_content("#progress")  # folded: not rendered
        fresh.click("#clear-cache")
        fresh.wait_for_function("() => document.getElementById('cache-info').textContent.includes('empty')")
        assert fresh.evaluate("caches.has('sharded-decode-demo-weights')") is False
    finally:
        fresh.close()


def test_turns_reuse_the_cache_and_show_their_speed(tab):
    tab.click("#new-chat")
    first = send(tab, "Hello there.", 6)
    second = send(tab, "And then?", 6)
    assert first["speed"]["reused_tokens"] == 0
    speed = second["speed"]
    # the first turn is reused up to its reply (the random model's text may re-tokenize differently,
    # and the cache rolls back to the common prefix there); only the rest is prefilled
    assert speed["reused_tokens"] >= first["prompt_tokens"]
    assert speed["prefill_tokens"] == second["prompt_tokens"] - speed["reused_tokens"]
    assert speed["ttft_ms"] > 0 and speed["prefill_tok_s"] > 0 and speed["decode_tok_s"] > 0
    meta = tab.locator(".msg.assistant .meta").last.inner_text()
    assert "TTFT" in meta and f"({speed['reused_tokens']} reused)" in meta and "decode" in meta
    assert "tok/s" in tab.inner_text("#overlay-speed")
    tab.click("#new-chat")
    third = send(tab, "And then?", 4)
    assert third["speed"]["reused_tokens"] == 0  # New chat emptied the cache


def compare_with_a_broken_sharded_nest(tab, tokens: int) -> dict:
    """A comparison whose sharded runs are wrong on purpose (page_hooks.break_sharded_nest)."""
    install_page_hooks(tab)
    tab.evaluate("window.demo.python('await break_sharded_nest(chat)')")
    try:
        return run_comparison(tab, tokens, REPLY_TIMEOUT_MS, prompt="Compare me.")
    finally:
        tab.evaluate("window.demo.python('mend_sharded_nest(chat)')")


def test_steps_export_as_csv_and_json(tab):
    """The export names the model; a comparison's teacher-forced misses come with both runs' margins,
    on the page, in lastCompare and in the JSON export (a sharded nest made wrong: no near-ties)."""
    tab.click("#new-chat")
    send(tab, "Count to three.", 5)
    compared = compare_with_a_broken_sharded_nest(tab, 3)
    misses = compared["teacher_forced"]["misses"]
    assert misses and all(not m["near_tie"] and m["sharded"]["margin"] > 0 and m["tiled"]["margin"] > 0
                          for m in misses), compared
    assert compared["model"] == "tiny_chat (random weights)"
    figures = tab.inner_text("#compare-figures")
    assert f"teacher-forced misses\n{len(misses)} miss" in figures and "no near-tie" in figures, figures
    assert tab.locator("#compare-figures dd.wrong").count() == 1
    replies = tab.evaluate("window.demoState.replies")
    steps = sum(len(r["stats"]) for r in replies)
    with tab.expect_download() as info:
        tab.click("#export-csv")
    lines = Path(info.value.path()).read_text().splitlines()
    assert lines[0] == ("model,reply,kind,tokens,context,nest,kernel,attention_ms,step_ms,timing_note,encode_ms,gpu_ms,"
                        "dispatches,wait_ms,gpu_gap_ms")
    # every row names the model that ran it (a name with a comma is quoted, as any field)
    assert len(lines) == 1 + steps and lines[1].startswith("tiny_chat (random weights),chat 1,prefill,")
    with tab.expect_download() as info:
        tab.click("#export-json")
    exported = json.loads(Path(info.value.path()).read_text())
    assert exported["adapter"] and exported["dtype"] == "float32"  # SwiftShader: no shader-f16
    assert exported["model"] == {"name": "tiny_chat (random weights)", "kind": "artifact", "artifact": "tiny_chat",
                                 "shape": "tiny_chat", "layers": 2}
    assert exported["replies"][0]["model"] == "tiny_chat (random weights)"
    assert [r["reply"] for r in exported["replies"]] == ["chat 1", "compare 1 tiled", "compare 1 sharded"]
    assert exported["comparisons"] == [{"label": "compare 1", **compared}]
    assert len(exported["steps"]) == steps and exported["replies"][0]["speed"]["decode_tok_s"] > 0


def test_sampling_with_a_seed_repeats_and_bad_settings_are_refused(tab):
    tab.fill("#temperature", "50")  # the random model is peaked: a high temperature flattens it
    tab.fill("#top-k", "40")
    tab.fill("#top-p", "0.9")
    tab.fill("#seed", "7")
    try:
        tab.click("#new-chat")
        first = send(tab, "Tell me a story.", 8)
        tab.click("#new-chat")
        second = send(tab, "Tell me a story.", 8)
        assert first["seed"] == 7 and first["token_ids"] == second["token_ids"]
        assert "seed 7" in tab.locator(".msg.assistant .meta").last.inner_text()
        tab.fill("#temperature", "0")
        tab.click("#new-chat")
        greedy = send(tab, "Tell me a story.", 8)
        assert greedy["seed"] is None and greedy["token_ids"] != first["token_ids"]
        tab.fill("#temperature", "1")
        tab.fill("#top-k", "0")
        tab.fill("#prompt", "Tell me a story.")
        tab.click("#send")
        tab.wait_for_function("() => !document.getElementById('chat-error').hidden", timeout=REPLY_TIMEOUT_MS)
        assert "top-k must be between 1 and 64" in tab.inner_text("#chat-error")
        assert tab.input_value("#prompt") == "Tell me a story."
    finally:
        tab.fill("#temperature", "0")
        tab.fill("#top-k", "40")
        tab.fill("#seed", "")


def test_streamed_text_reaches_the_page_once_per_animation_frame(tab):
    """A fast GPU streams a token every ~2 ms: the page appends what arrived at the next frame, in
    one DOM change, instead of one layout-invalidating change per token."""
    seen = tab.evaluate("""async () => {
        const body = document.createElement("span");
        document.body.append(body);
        let changes = 0;
        const observer = new MutationObserver((records) => { changes += records.length; });
        observer.observe(body, { childList: true, characterData: true, subtree: true });
        const stream = new window.demoUI.TextStream(body);
        for (let i = 0; i < 50; i++) stream.push(`t${i} `);
        const before = body.textContent;
        await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
        await Promise.resolve();
        const after = body.textContent;
        observer.disconnect();
        body.remove();
        return { before, after, changes };
    }""")
    assert seen["before"] == ""  # nothing drawn while the pieces arrive
    assert seen["after"] == "".join(f"t{i} " for i in range(50))
    assert seen["changes"] == 1


def test_a_reply_without_visible_text_shows_its_token_ids(tab):
    """The random model rarely emits only whitespace, so the page's own renderer gets such a reply."""
    text = tab.evaluate("""() => {
        const bubble = window.demoUI.addMessage("assistant", "");
        window.demoUI.finishReply(bubble, bubble.querySelector("span"), {text: " \\n", token_ids: [216, 198],
            stop_reason: "max tokens", seed: null, speed: {ttft_ms: 5, prefill_tokens: 3, reused_tokens: 0,
            prefill_tok_s: 100, decode_tok_s: 10}});
        const out = bubble.innerText;
        bubble.remove();
        return out;
    }""")
    assert "no visible text; token ids: 216 198" in text


def static_imports(entry: str) -> dict[str, list[str]]:
    """The page's scripts reachable from static/`entry` by static or dynamic imports of files of the
    page (`from "./x.js"`, `import("./x.js")`): each with every module specifier it names."""
    graph, todo = {}, [entry]
    while todo:
        name = todo.pop()
        if name in graph:
            continue
        text = (ROOT / "static" / name).read_text(encoding="utf-8")
        graph[name] = re.findall(r"""(?:\bfrom\s*|\bimport\s*\(?\s*)["']([^"']+)["']""", text)
        todo += [spec[2:] for spec in graph[name] if spec.startswith("./") and spec.endswith(".js")]
    return graph


# Counts, during a reply, the worker's messages and every DOM write to the streamed reply and the
# overlay's line, sorted by whether an animation frame's callback made it (requestAnimationFrame is
# wrapped: records taken just before and just after each callback) or anything else did.
FRAME_PROBE = """() => {
    const probe = { outside: [], frames: [], posted: 0, pieces: 0 };
    const where = (r) => {
        const el = r.target.nodeType === Node.ELEMENT_NODE ? r.target : r.target.parentElement;
        if (!el) return null;
        if (el.matches(".msg.assistant > span:first-child")) return "text";
        return el.id === "overlay-last" ? "overlay" : null;
    };
    const writes = (records) => records.map((r) => ({ what: where(r), text: r.target.textContent }))
        .filter((w) => w.what);
    const observer = new MutationObserver((records) => probe.outside.push(...writes(records)));
    observer.observe(document.body, { childList: true, characterData: true, subtree: true });
    const raf = window.requestAnimationFrame, post = Worker.prototype.postMessage;
    window.requestAnimationFrame = (callback) => raf.call(window, (t) => {
        probe.outside.push(...writes(observer.takeRecords()));
        callback(t);
        probe.frames.push({ t, writes: writes(observer.takeRecords()) });
    });
    const counted = new WeakSet();
    Worker.prototype.postMessage = function (...args) {
        probe.posted += 1;
        if (!counted.has(this)) {
            counted.add(this);
            this.addEventListener("message", ({ data }) => { if (data && data.kind === "text") probe.pieces += 1; });
        }
        return post.apply(this, args);
    };
    probe.stop = () => {
        probe.outside.push(...writes(observer.takeRecords()));
        observer.disconnect();
        window.requestAnimationFrame = raf;
        Worker.prototype.postMessage = post;
    };
    window.frameProbe = probe;
}"""


def test_python_runs_in_a_worker_and_the_main_thread_stays_free(tab):
    """Structure, not the machine's speed: Python (Pyodide, the model, every pass) runs in a
    dedicated worker; the main thread's scripts never load Pyodide and reach it only by messages; a
    reply's text and the overlay are written at most once per animation frame. Main-thread long
    tasks are printed, not asserted: on a busy 2-core machine one took 234 ms while loading."""
    assert tab.evaluate("window.demo.python('import js; str(js.self.constructor.name)')") == "DedicatedWorkerGlobalScope"
    # The main thread's module graph: no Pyodide, and the worker is started, not imported.
    page, worker = static_imports("main.js"), static_imports("python_worker.js")
    assert "python.js" in page and "python_worker.js" not in page, sorted(page)
    assert not [(name, spec) for name, specs in page.items() for spec in specs if "pyodide" in spec]
    assert "./pyodide/pyodide.mjs" in worker["python_worker.js"]
    assert "new Worker(" in (ROOT / "static" / "python.js").read_text(encoding="utf-8")
    # ... and at run time: no Pyodide in the window, and Python's runtime (pyodide.asm.wasm, the
    # standard library), the wheel and the weights were fetched by the worker, on its own resource
    # timeline. (The window's lists the worker's module scripts, pyodide.mjs among them: Chromium
    # fetches a module worker's static imports for it; they run in the worker.)
    assert tab.evaluate("typeof globalThis.loadPyodide === 'undefined' && typeof globalThis.pyodide === 'undefined'")
    fetched = tab.evaluate("performance.getEntriesByType('resource').map((e) => e.name)")
    assert any(url.endswith("/main.js") for url in fetched), fetched
    assert not [url for url in fetched if url.endswith((".wasm", ".zip", ".whl", "/weights.bin", "pyodide-lock.json"))
                or ("/pyodide/" in url and not url.endswith("/pyodide/pyodide.mjs"))], fetched

    ready_at = tab.evaluate("window.demoState.readyAt")
    loading = [t for t in tab.evaluate("window.demoState.longTasks") if t["start"] < ready_at]
    print(f"\nlong tasks from navigation to Ready: {len(loading)}, worst "
          f"{max((t['duration'] for t in loading), default=0):.0f} ms (reported, not checked)")
    tab.click("#new-chat")
    before = len(tab.evaluate("window.demoState.longTasks"))
    tab.evaluate(FRAME_PROBE)
    try:
        send(tab, "Write a few words about rivers.", 12)
    finally:
        tab.evaluate("window.frameProbe.stop()")
    probe = tab.evaluate("window.frameProbe")
    tasks = tab.evaluate("window.demoState.longTasks")[before:]
    print(f"long tasks during a 12-token tiny_chat reply: {len(tasks)}, worst "
          f"{max((t['duration'] for t in tasks), default=0):.0f} ms (reported, not checked)")
    assert probe["posted"] >= 1 and probe["pieces"] >= 1  # the reply was asked for and streamed back as messages
    frames = {}
    for frame in probe["frames"]:  # the callbacks of one frame share its timestamp
        frames.setdefault(frame["t"], []).extend(frame["writes"])
    for what in ("text", "overlay"):
        per_frame = [sum(w["what"] == what for w in writes) for writes in frames.values()]
        assert sum(per_frame) >= 1 and max(per_frame) == 1, (what, per_frame)
    # Outside frames: the text's last flush as the reply ends, the overlay's prefill progress and
    # its last step drawn as the reply ends.
    outside_text = [w for w in probe["outside"] if w["what"] == "text"]
    outside_overlay = [w for w in probe["outside"] if w["what"] == "overlay" and not w["text"].startswith("prefill")]
    assert len(outside_text) <= 1 and len(outside_overlay) <= 1, probe["outside"]
    shown = tab.evaluate("[...document.querySelectorAll('#messages .msg.assistant')].pop().querySelector('span').textContent")
    assert shown == tab.evaluate("window.demoState.lastReply.text")


# A prompt just long enough to cross the switch at 256 tokens: the head of the built-in long document.
# (SwiftShader prefills the whole 1,536-token document in minutes; test_long_document_comparison_in_full,
# in `make test-slow`, runs it.)
SWITCH_CROSSING_CHARS = 1100


def switch_crossing_text() -> str:
    text = (ROOT / "static" / "long_document.txt").read_text()
    return text[:text.rindex(" ", 0, SWITCH_CROSSING_CHARS)]


def compare_and_check(tab, min_tokens: int, steps: int):
    """Run the comparison on the text in the box and check what the page reports of it."""
    result = run_comparison(tab, steps, REPLY_TIMEOUT_MS)
    assert result["prompt_tokens"] > min_tokens
    forced = result["teacher_forced"]
    assert forced["steps"] == steps and forced["match_rate"] == 1.0  # f32: the nests agree on every step
    past = result["past_switch"]
    assert past["steps"] == {"tiled": steps - 1, "sharded": steps - 1}
    assert past["median_attention_ms"]["tiled"] > 0 and past["speedup"] > 0
    assert tab.inner_text("#compare-tiled").strip()  # its text, or its token ids when the text is blank
    figures = tab.inner_text("#compare-figures")
    assert "teacher-forced agreement" in figures and "x faster" in figures
    chart = tab.evaluate("window.demoState.compareChart")
    assert chart["legend"] == ["tiled nest", "sharded family"] and chart["points"] == 2 * (steps - 1)
    assert chart["xTitle"] == "context (tokens)" and "ms" in chart["yTitle"]
    return result


@pytest.mark.slow
def test_long_document_comparison_in_full(tab):
    """The built-in long document (about 1,500 tokens) through both nests, as a user clicks it."""
    tab.click("#new-chat")
    tab.click("#long-document")
    tab.wait_for_function("() => document.getElementById('prompt').value.length > 5000")
    compare_and_check(tab, 1400, 8)


def test_long_document_comparison_shows_the_switch_and_the_speedup(tab):
    tab.click("#new-chat")
    tab.fill("#prompt", switch_crossing_text())
    compare_and_check(tab, 256, 8)
    # the overlay: the chat's own steps (a reply past the switch) with its axes and switch marker
    tab.evaluate("window.demoState.lastReply = null")
    tab.click("#send")  # the text is still in the box
    tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
    overlay = tab.evaluate("window.demoState.overlayChart")
    # a chat turn times attention in sampled steps only (RunOptions.time_attention_every): the first
    # decode step and those whose context is a multiple of 16; the chart plots those
    decode = [s for s in tab.evaluate("window.demoState.steps") if s["kind"] == "decode"][-7:]
    timed = [s for s in decode if s["attention_ms"] is not None]
    assert len(decode) == 7 and timed[0] is decode[0] and 1 <= len(timed) < 7
    assert overlay["points"] == len(timed) and overlay["xTitle"] == "context (tokens)"
    assert "sampled at ctx" in tab.inner_text("#overlay-last") or decode[-1]["attention_ms"] is not None
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(SCREENSHOTS / "long-document-compare.png"), full_page=True)


def test_the_kernel_lab_checks_and_times_every_shape(tab):
    """The lab on SwiftShader with small contexts: every benchmark shape and the model's own, each
    nest checked against the page's float64 reference and then timed; its JSON names the adapter,
    dtype and browser."""
    tab.click("#lab-details summary")
    assert tab.input_value("#lab-contexts") == "64,300" and "CPU rasterizer" in tab.inner_text("#lab-note")
    tab.fill("#lab-iters", "2")
    tab.evaluate("window.demoState.lab = null")
    tab.click("#lab-run")
    tab.wait_for_function("() => window.demoState.lab || /failed|must be/.test(document.getElementById('lab-status').textContent)",
                          timeout=REPLY_TIMEOUT_MS)
    lab = tab.evaluate("window.demoState.lab")
    assert lab, tab.inner_text("#lab-status")
    assert len(lab["rows"]) == 4 * 2 * 3  # 3 benchmark shapes + tiny_chat's, 2 contexts, 3 nests
    assert all(r["ok"] and r["us"] > 0 and r["rel_l2"] < 1e-4 for r in lab["rows"]), lab["rows"]
    assert {r["ran"] for r in lab["rows"] if r["nest"] == "auto" and r["context"] == 64} == {"tiled"}
    assert all(r["tiled_over_sharded"] > 0 for r in lab["rows"])
    assert lab["dtype"] == "float32" and lab["adapter"] and "Chrome" in lab["browser"]
    assert tab.locator("#lab-rows tr").count() == 24 and tab.locator("#lab-rows tr.wrong").count() == 0
    chart = tab.evaluate("window.demoState.labChart")
    assert chart["points"] == 4 * 2 * 2 and chart["yTitle"].startswith("attention per layer")
    with tab.expect_download() as download:
        tab.click("#lab-json")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["rows"] == lab["rows"] and exported["browser"] and exported["adapter"] == lab["adapter"]
    assert exported["model"]["name"] == "tiny_chat (random weights)" and exported["model"]["shape"] == "tiny_chat"
    with tab.expect_download() as download:
        tab.click("#lab-csv")
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0].startswith("model,shape,context,") and len(lines) == 1 + len(lab["rows"])
    assert all(line.startswith("tiny_chat (random weights),") for line in lines[1:])


# The page's sections at each width the issue names (1920x1080, 1280x800, 800 px wide): the timing
# overlay is a side column, or below the page on narrow screens, and never covers them.
LAYOUT_SIZES = [(1920, 1080), (1280, 800), (800, 900)]
PAGE_SECTIONS = ["#status-panel", "#chat-panel", "#compare-panel", "#lab-panel", "#adapter-panel"]


def overlaps(a, b) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def test_the_overlay_shows_what_ran_last_and_covers_nothing(tab):
    """After New chat + Compare the overlay's chart shows the comparison's two runs (not "no timed
    decode steps yet"), after a reply the chat's own steps; at every width no section lies under it."""
    tab.click("#new-chat")
    run_comparison(tab, 4, REPLY_TIMEOUT_MS, prompt="Compare me.")
    chart = tab.evaluate("window.demoState.overlayChart")
    assert chart["legend"] == ["tiled nest", "sharded family"] and chart["points"] == 2 * 3, chart
    send(tab, "And now a reply.", 4)
    chart = tab.evaluate("window.demoState.overlayChart")
    decode = [s for s in tab.evaluate("window.demoState.steps") if s["kind"] == "decode"]
    timed = [s for s in decode if s["attention_ms"] is not None]  # sampled: the first, then contexts % N == 0
    assert len(decode) == 3 and decode[0]["attention_ms"] is not None
    assert chart["legend"] == [] and chart["points"] == len(timed), chart  # this chat's timed decode steps
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        for width, height in LAYOUT_SIZES:
            tab.set_viewport_size({"width": width, "height": height})
            for scrolled in (0, 10_000):  # the overlay stays in view as the page scrolls: check both ends
                tab.evaluate(f"window.scrollTo(0, {scrolled})")
                overlay = tab.locator("#overlay").bounding_box()
                assert overlay and overlay["width"] > 200
                for section in PAGE_SECTIONS:
                    box = tab.locator(section).bounding_box()
                    assert box is None or not overlaps(overlay, box), f"{width}x{height}: the overlay covers {section}"
            tab.screenshot(path=str(SCREENSHOTS / f"layout-{width}.png"), full_page=True)
    finally:
        tab.set_viewport_size({"width": 1280, "height": 900})


# Counts the worker's event-loop trips (Pyodide's WebLoop.call_later: each is a task through the
# browser's event loop) over a generation of `tokens`, the passes replayed in JS.
EVENT_LOOP_TRIPS = """
import asyncio
from model_glue.model.generate import generate
model = chat.model
loop_type = type(asyncio.get_event_loop())
counted = loop_type.call_later
trips = [0]
def counting(self, *args, **kwargs):
    trips[0] += 1
    return counted(self, *args, **kwargs)
model.reset()
loop_type.call_later = counting
try:
    run = await generate(model, [1, 5, 9, 13, 17], max_new_tokens=values["tokens"])
finally:
    loop_type.call_later = counted
    model.reset()
[trips[0], run.decode_steps, model.replayed_by]
"""


def test_a_decode_step_takes_two_trips_through_the_workers_event_loop(tab):
    """Structure, not speed: in the page a decode step's id is awaited once (two trips through the
    worker's event loop: the map's promise, then the task's wakeup) and its passes are replayed in
    one call into JS. A rejection handler attached to the map from Python took three more trips a
    step (5 in all), which at 1 ms a step left the 1B shape's GPU waiting on the H200."""
    runs = [tab.evaluate("(tokens) => window.demo.python(code, {tokens})".replace("code", json.dumps(EVENT_LOOP_TRIPS)),
                         tokens) for tokens in (2, 5)]
    (short_trips, short_steps, replayed), (long_trips, long_steps, _) = runs
    assert (short_steps, long_steps) == (1, 4) and replayed == ["BrowserRecordedPasses"]
    assert (long_trips - short_trips) / (long_steps - short_steps) <= 2, runs
    tab.click("#new-chat")  # the chat's cache was emptied
