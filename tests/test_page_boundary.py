"""The page-to-Python boundary (chat/api.py) against both sides: chat.page's functions, the worker's
call table, the page's calls and the step fields it reads; the test hook only where asked for;
`python -m app bench page`'s command line. Fast: no GPU; the one browser test loads ?model=off."""

from __future__ import annotations

import http.client
import inspect
import json
import re
import threading
from pathlib import Path

import pytest

import chat.page
from app.served_tree import check_served_tree
from chat.api import CALLS, GLOBAL_EVENTS, HOOKS_PATH, constants, page_api_js
from model_glue.errors import ModelError
from model_glue.options import RunOptions
from model_glue.model.step_stats import STEP_FIELDS

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
PAGE_JS = sorted(p for p in STATIC.glob("*.js") if p.name != "page_api.js")
DECLARED = {c.name: c for c in CALLS}


def js(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


# -- the declaration against chat.page --------------------------------------------------------------
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_each_call_runs_a_chat_page_function_with_the_declared_parameters(call):
    """A call the worker runs as declared gets handles, then arguments, then one on_<kind> callback
    per event: exactly chat.page's parameters, in order."""
    if call.function is None:
        assert call.worker, f"{call.name} runs no Python: the worker must handle it itself"
        return
    function = getattr(chat.page, call.function, None)
    assert callable(function), f"chat.page has no {call.function} (the call {call.name})"
    assert set(call.handles) <= {"session", "chat"}
    if call.worker:
        return
    params = list(inspect.signature(function).parameters)
    assert params == [*call.handles, *call.args, *(f"on_{kind}" for kind in call.events)], \
        f"{call.name}: chat.page.{call.function}{tuple(params)} does not take what chat/api.py declares"


# -- the declaration against the page's JS -----------------------------------------------------------
def test_the_page_makes_only_declared_calls_and_every_declared_call_is_made():
    made = {name for path in PAGE_JS for name in re.findall(r"\bpython\.call\(\s*\"(\w+)\"", path.read_text())}
    assert made <= set(DECLARED), f"the page calls {sorted(made - set(DECLARED))}, which chat/api.py does not declare"
    assert made == set(DECLARED), f"declared but never called: {sorted(set(DECLARED) - made)}"


def test_the_worker_handles_exactly_the_calls_declared_as_its_own():
    worker = js("python_worker.js")
    block = re.search(r"^const own = \{\n(.*?)^\};", worker, re.M | re.S)
    assert block, "python_worker.js has no `const own = {...};` table"
    own = set(re.findall(r"^  (?:async )?(\w+)\(", block.group(1), re.M))
    assert own == {c.name for c in CALLS if c.worker}
    # the rest runs through the declaration, and nothing in the served worker runs code it is sent
    assert "page[call.function]" in worker and "runPython" not in worker and "eval(" not in worker


def test_the_page_reads_only_step_fields_of_a_step():
    """A step's dict (StepStats.to_dict) is read as `stats.X` or `s.X` (chat_view.js, overlay.js):
    only StepStats' fields (a renamed field, such as variant -> kernel, fails here)."""
    read = set()
    for name in ("overlay.js", "chat_view.js", "export.js"):
        read |= set(re.findall(r"(?<![\w.])(?:stats|s)\.(\w+)", js(name)))
    assert read and read <= set(STEP_FIELDS), f"the page reads {sorted(read - set(STEP_FIELDS))} of a step"
    assert 'STEP_COLUMNS = ["model", "reply", ...STEP_FIELDS]' in js("export.js")


def test_the_served_page_api_is_chat_api():
    served = js("page_api.js")
    assert served == page_api_js(), "static/page_api.js is stale: run `python -m app page-api`"
    assert f"export const STEP_FIELDS = Object.freeze({json.dumps(list(STEP_FIELDS))});" in served
    calls = json.loads(re.search(r"CALLS = Object.freeze\((\{.*?\})\);", served, re.S).group(1).replace(",\n}", "\n}"))
    assert list(calls) == [c.name for c in CALLS] and calls["reply"]["events"] == ["text", "step", "prefill"]
    assert constants()["SWITCH_AT"] == 256 and "export const SWITCH_AT = 256;" in served
    assert GLOBAL_EVENTS == ("device-lost",)


def test_a_stale_page_api_is_named_by_the_check(tmp_path):
    (tmp_path / "page_api.js").write_text(page_api_js().replace('"kernel"', '"variant"'))
    problems = "\n".join(check_served_tree(tmp_path))
    assert "page_api.js does not match chat/api.py" in problems
    (tmp_path / "page_api.js").unlink()
    assert "page_api.js is missing" in "\n".join(check_served_tree(tmp_path))


def test_the_html_copies_no_runtime_constant():
    html = js("index.html")
    assert not re.search(r"\b256\b", html), "index.html hard-codes the switch (page_api.js SWITCH_AT)"
    assert 'max="64"' not in html and 'max="200"' not in html and 'value="128"' not in html


# -- a request decoded once ------------------------------------------------------------------------
def test_a_request_is_decoded_once(monkeypatch):
    def from_json(text):
        raise AssertionError("parse_request re-encoded the options for RunOptions.from_json")

    monkeypatch.setattr(RunOptions, "from_json", staticmethod(from_json))
    settings = chat.page.parse_request(json.dumps({"max_new_tokens": 3, "options": {"attention": "sharded"}}))
    assert settings["options"] == RunOptions(attention="sharded")
    with pytest.raises(ModelError, match="unknown run options"):
        RunOptions.from_dict({"atention": "tiled"})
    with pytest.raises(ModelError, match="not an object"):
        chat.page.parse_request(json.dumps({"max_new_tokens": 3, "options": ["tiled"]}))
    with pytest.raises(ModelError, match="bad request"):
        chat.page.parse_request("{not json")


def test_stop_without_a_chat_is_a_no_op():
    chat.page.stop_reply(None)  # the worker passes None before a model is loaded


# -- the test hook, served only where asked for -------------------------------------------------------
def _get(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.getheader("Content-Type"), response.read()


@pytest.mark.parametrize("hooks", [False, True])
def test_the_python_hook_is_served_only_by_the_tests_server(hooks):
    from app.server import HOOKS_URL, make_server

    assert HOOKS_URL == "/" + HOOKS_PATH
    httpd = make_server(STATIC, "127.0.0.1", 0, hooks=hooks)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        status, content_type, body = _get(httpd, HOOKS_URL + "python.js")
        if hooks:
            assert status == 200 and content_type == "text/javascript" and b"runPythonAsync" in body
            assert _get(httpd, HOOKS_URL + "..%2fserver.py")[0] == 404
            assert _get(httpd, HOOKS_URL)[0] == 404
        else:
            assert status == 404
        assert _get(httpd, "/python_worker.js")[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.browser
def test_the_served_page_has_no_python_eval(browser):
    """From `python -m app serve`'s server (no hooks) the page boots with no window.demo.python and the
    worker refuses the call; asking for the hook there fails plainly."""
    from app.server import make_server

    httpd = make_server(STATIC, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    tab = browser.new_page()
    try:
        tab.goto(base + "/?model=off")
        tab.wait_for_function("() => window.demoState.ready || window.demoState.error", timeout=300_000)
        assert tab.evaluate("window.demoState.ready"), tab.evaluate("window.demoState.error")
        assert tab.evaluate("Object.keys(window.demo)") == []
        tab.goto(base + "/?model=off&hooks=python")
        tab.wait_for_function("() => window.demoState.ready || window.demoState.error", timeout=300_000)
        assert "does not serve" in tab.evaluate("window.demoState.error")
    finally:
        tab.close()
        httpd.shutdown()
        httpd.server_close()


# -- `python -m app bench page` ------------------------------------------------------------------------
def _page_args(monkeypatch, *argv):
    import app.bench.page
    from app.__main__ import main

    seen = []
    monkeypatch.setattr(app.bench.page, "run_page_bench", seen.append)
    assert main(["bench", "page", *argv]) == 0
    return seen[0]


def test_bench_page_flags_for_swiftshader_and_for_a_gpu(monkeypatch):
    from app.bench.page import CHROMIUM_FLAGS, GPU_FLAGS, chromium_flags

    args = _page_args(monkeypatch, "--model", "tiny_chat", "--json", "out.json")
    assert not args.gpu and args.model == "tiny_chat" and args.json == Path("out.json")
    assert chromium_flags(args.gpu, not args.no_f16_flag) == CHROMIUM_FLAGS
    args = _page_args(monkeypatch, "--gpu", "--chromium", "/opt/chromium")
    flags = chromium_flags(args.gpu, not args.no_f16_flag)
    for flag in ("--headless=new", "--no-sandbox", "--use-angle=vulkan", "--enable-features=Vulkan",
                 "--disable-vulkan-surface", "--enable-unsafe-webgpu", "--ignore-gpu-blocklist"):
        assert flag in flags
    assert flags[-1] == chat.page.NVIDIA_F16_FLAG and set(GPU_FLAGS) <= set(flags) and args.chromium == "/opt/chromium"
    args = _page_args(monkeypatch, "--gpu", "--no-f16-flag")
    assert chat.page.NVIDIA_F16_FLAG not in chromium_flags(args.gpu, not args.no_f16_flag)
    args = _page_args(monkeypatch, "--gpu", "--first-turns", "30", "--typing", "1.5", "--warm", "off")
    assert (args.first_turns, args.typing, args.warm, args.first_tokens) == (30.0, 1.5, "off", None)


def test_bench_page_help_names_the_f16_flag(capsys):
    from app.__main__ import main

    with pytest.raises(SystemExit):
        main(["bench", "page", "--help"])
    assert chat.page.NVIDIA_F16_FLAG in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["bench", "page", "--no-f16-flag"])  # only with --gpu
    assert "--no-f16-flag goes with --gpu" in capsys.readouterr().err


def test_bench_page_table_names_each_figure():
    from app.bench.page import report_rows

    speed = {"ttft_ms": 20.4, "decode_tok_s": 512.0}
    turn = {"prompt_tokens": 1536, "speed": speed, "decode_steps": 63, "median_step_ms": 1.8, "median_gpu_ms": 1.5,
            "median_attention_ms": 0.49}
    result = {"switch_at": 256, "loads": [{"ready_s": 9.1, "weights": {"source": "network"}},
                                          {"ready_s": 4.4, "weights": {"source": "cache"}}],
              "short": {**turn, "prompt_tokens": 37}, "long": turn,
              "compare": {"prompt_tokens": 1536, "identical": False, "first_divergence": 12,
                          "teacher_forced": {"matches": 63, "steps": 64},
                          "past_switch": {"median_attention_ms": {"tiled": 5.29, "sharded": 0.49}, "speedup": 10.8},
                          "runs": {"tiled": turn, "sharded": turn}},
              "encode": {"python": {"encode_median_ms": 3.0}, "replay": {"encode_median_ms": 0.2},
                         "ids_identical": True},
              "first_turns": {"idle_s": 30.0, "typing_s": 1.5, "warm": "on", "after_load": turn,
                              "after_idle": {**turn, "median_gpu_ms": 3.23}},
              "long_tasks": {"count": 0, "worst_ms": 0}}
    table = "\n".join(f"{name}: {value}" for name, value in report_rows(result))
    for text in ("Ready (weights from the network): 9.10 s", "Ready (weights from the cache): 4.40 s",
                 "short prompt (37 prompt tokens): TTFT: 20 ms", "long document (1,536 prompt tokens): TTFT",
                 "512.0 tok/s", "first divergence at token 12", "63/64", "attention past 256 tokens",
                 "tiled/sharded 10.80x", "3.000 / 0.200 ms", "main-thread long tasks (> 50 ms): 0",
                 "first turn after load (1.5 s of typing, ?warm=on) (1,536 prompt tokens): TTFT",
                 "first turn after 30 s idle (1.5 s of typing, ?warm=on): decode (63 steps)", "GPU 3.23 ms"):
        assert text in table, (text, table)


def test_the_docs_name_nothing_outside_the_checkout():
    """A user has the checkout only: no workplace tool, path or bundle in the README or the benchmarks."""
    for name in ("README.md", "docs/benchmarks.md"):
        found = re.findall(r"\.\./\S*|\.cr/\S*|gpu-bundle\S*|gpu_page\S*|gpu-page\S*|tools/gpu_lab\S*",
                           (ROOT / name).read_text(encoding="utf-8"))
        assert not found, f"{name} names {found}"


def test_each_error_the_page_helps_with_is_a_class_the_runtime_raises():
    """chat.api.error_help's keys are the Python classes the page receives as an error's `type`: each
    is an exception class of the wheel's packages, and the shader-f16 refusal is one of them."""
    import importlib
    import pkgutil

    from chat.api import error_help
    from model_glue.errors import NeedsShaderF16

    classes = {}
    for package in ("contract", "model_glue", "chat"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            try:
                module = importlib.import_module(info.name)
            except ModuleNotFoundError as err:  # the modules that run only in Pyodide
                assert err.name in ("js", "pyodide"), err
                continue
            classes.update({name: value for name, value in vars(module).items()
                            if isinstance(value, type) and issubclass(value, Exception)
                            and value.__module__.split(".")[0] in ("contract", "model_glue", "chat")})
    help_for = error_help()
    assert set(help_for) <= set(classes), set(help_for) - set(classes)
    assert NeedsShaderF16.__name__ in help_for and all(text.endswith(".") for text in help_for.values())
