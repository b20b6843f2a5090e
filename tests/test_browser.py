"""End to end in Debian's Chromium (headless, SwiftShader WebGPU) through Playwright.

The page loads Pyodide and the project's wheel from 127.0.0.1 only, and Python in the page runs
TVM-built kernels through navigator.gpu.
"""

import base64
import json
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from conftest import chromium, open_page
from page_hooks import install_page_hooks

from attention_reference import decode_attention_reference, make_paged_inputs, relative_l2
from kernels.decode_attention_subgroup import distinct_builds
from model_glue.gpu.webgpu import SUBGROUP_MATRIX
from model_glue.model.attention import attention_call
from model_glue.policy import pick_subgroup_build
from contract.attention import subgroup_tag
from contract.kernels import ATTENTION_OUTPUTS, attention_kernel_name
from contract.model import AttentionShape

pytestmark = pytest.mark.browser
OUTPUT = Path(__file__).resolve().parent.parent / "test-output"
BOOT_TIMEOUT_MS = 180_000


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium with Dawn's defaults (workgroup memory zero-filled), as users run it."""
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


# Records, in the very statement that makes the page ready, whether the lab's controls are wired
# then (setUpLab shows the panel once they are): a tool polling for `ready` may click Run at once.
# A setter on demoState.ready, installed before the page's modules run.
RECORD_THE_LAB_AT_READY = """
    let state;
    Object.defineProperty(window, "demoState", { configurable: true, get: () => state, set: (value) => {
        state = value;
        let ready = value.ready;
        Object.defineProperty(value, "ready", { enumerable: true, get: () => ready, set: (v) => {
            ready = v;
            if (v) window.labWiredAtReady = !document.getElementById("lab-panel").hidden;
        } });
    } });
"""


@pytest.fixture(scope="module")
def page(browser, server):
    """The demo page, booted; records every request it makes."""
    # kernels only (?model=off); the chat is tested in test_browser_chat.py
    tab = open_page(browser, server + "/?model=off",
                    "window.demoState && (window.demoState.ready || window.demoState.error)", BOOT_TIMEOUT_MS,
                    before_load=lambda tab: tab.add_init_script(RECORD_THE_LAB_AT_READY))
    state = tab.evaluate("window.demoState")
    assert state.get("ready"), f"page failed: {state.get('error')}"
    yield tab
    tab.close()


def test_page_boots_offline_and_runs_the_probe(page):
    state = page.evaluate("window.demoState")
    assert state["probe"]["ok"], state["probe"]
    hosts = {urlsplit(u).hostname for u in page.requests if not u.startswith(("data:", "blob:"))}
    assert hosts == {"127.0.0.1"}, f"requests left 127.0.0.1: {sorted(hosts)}"
    # No 404 (a favicon included) and no Content-Security-Policy violation on the way.
    assert page.http_errors == [] and page.console_errors == []
    OUTPUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUTPUT / "page-probe.png"), full_page=True)
    (OUTPUT / "browser-adapter.json").write_text(json.dumps(state["device"], indent=1))
    assert "self-test ok" in page.inner_text("#probe-verdict").lower()


def test_no_webgpu_is_said_plainly(browser, server):
    tab = browser.new_page()
    tab.add_init_script("Object.defineProperty(Navigator.prototype, 'gpu', {get: undefined}); delete Navigator.prototype.gpu;")
    tab.goto(server + "/")
    tab.wait_for_function("() => window.demoState && window.demoState.error", timeout=30_000)
    assert "no WebGPU" in tab.inner_text("#error")
    tab.close()


def test_webgpu_without_an_adapter_is_said_plainly(browser, server):
    """navigator.gpu present but requestAdapter() resolving to null (Debian's Chromium without
    --enable-unsafe-webgpu, WebGPU not enabled on the platform): the worker's requestAdapter is made to
    answer null. Pyodide hands JS null over as JsNull, not None: the page once showed
    "'JsNull' object has no attribute 'limits'"."""
    def no_adapter(route):
        body = route.fetch().text()
        route.fulfill(body="GPU.prototype.requestAdapter = async function () { return null; };\n" + body,
                      content_type="text/javascript")

    tab = browser.new_page()
    tab.route("**/python_worker.js", no_adapter)
    tab.goto(server + "/")
    tab.wait_for_function("() => window.demoState && window.demoState.error", timeout=120_000)
    error = tab.inner_text("#error")
    assert "granted no adapter" in error and "JsNull" not in error, error
    tab.close()


# Every kernel of the served artifact this adapter's features allow, handed to Chromium's WGSL
# compiler (Tint) one by one in a fresh device: its resolver enforces the uniformity rules naga may
# not (the workgroupBarrier()s of the shards layout and the subgroup shuffles of the subgroup layout
# must sit in uniform control flow). Building a pipeline from each would add a SwiftShader compile
# per kernel (minutes for 110 KB shaders); the kernels the tests run do build pipelines below and
# in the chat modules.
VALIDATE_IN_PAGE = """async ([names, features]) => {
    const adapter = await navigator.gpu.requestAdapter();
    const device = await adapter.requestDevice({requiredFeatures: features});
    const failures = {};
    for (const name of names) {
        const code = await (await fetch(`artifacts/kernels/${name}.wgsl`)).text();
        device.pushErrorScope("validation");
        const module = device.createShaderModule({code, label: name});
        const info = await module.getCompilationInfo();
        const scoped = await device.popErrorScope();
        const errors = info.messages.filter((m) => m.type === "error").map((m) => `${m.lineNum}: ${m.message}`);
        if (scoped) errors.push(scoped.message);
        if (errors.length) failures[name] = errors.join("; ");
    }
    device.destroy();
    return failures;
}"""


def test_every_kernel_passes_chromiums_wgsl_validation(page):
    manifest = json.loads((Path(__file__).resolve().parent.parent / "static/artifacts/kernels/manifest.json").read_text())
    features = [f for f in page.evaluate("window.demoState.device.features") if f in ("subgroups", "shader-f16")]
    names = sorted(n for n, entry in manifest["kernels"].items() if set(entry.get("features", [])) <= set(features)
                   and (entry["meta"].get("dtype") != "float16" or "shader-f16" in features))
    assert any("subgroup" in n for n in names), "SwiftShader offers subgroups: the subgroup builds must be among them"
    # every f32 kernel (SwiftShader offers subgroups) but the matrix builds; the f16 ones and those need
    # shader-f16 and subgroup matrices, which it lacks
    assert {n for n, entry in manifest["kernels"].items()
            if entry["meta"].get("dtype") == "float32" and SUBGROUP_MATRIX not in entry.get("features", [])} <= set(names)
    assert page.evaluate(VALIDATE_IN_PAGE, [names, features]) == {}


def test_a_kernel_that_breaks_uniformity_is_caught(page):
    """The check above can fail: a barrier under a branch on the invocation id is rejected."""
    broken = """@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) i: u32) {
        if (i < 32u) { workgroupBarrier(); } }"""
    failures = page.evaluate("""async (code) => {
        const device = await (await navigator.gpu.requestAdapter()).requestDevice();
        const info = await device.createShaderModule({code}).getCompilationInfo();
        device.destroy();
        return info.messages.filter((m) => m.type === "error").map((m) => m.message);
    }""", broken)
    assert failures and "uniform" in " ".join(failures)


def _b64(array) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def _kernel_in_page(page, kernel, shape):
    """The artifact name of `kernel` ("tiled", or the "shards" or "subgroup" layout, whole context)
    as this page's adapter runs it: the subgroup build its subgroups fit (None: none fits)."""
    tag = None
    if kernel == "subgroup":
        device = page.evaluate("window.demoState.device")
        build = pick_subgroup_build(distinct_builds(shape.head_dim), device["subgroup_min_size"],
                                    device["subgroup_max_size"])
        if build is None:
            return None
        tag = subgroup_tag(*build)
    return attention_kernel_name(kernel, shape, "float32", tag=tag)


@pytest.mark.parametrize("kernel", ["tiled", "shards", "subgroup"])
@pytest.mark.parametrize("shape", [AttentionShape(1, 2, 64), AttentionShape(8, 32, 128), AttentionShape(4, 8, 256)],
                         ids=lambda s: f"d{s.head_dim}")
def test_attention_in_chromium_matches_reference(page, shape, kernel):
    """Served kernels (SwiftShader: f32; its subgroups of 4 run the 4-lane subgroup build) against
    the f64 reference, compiled by Chromium's WGSL compiler and run through navigator.gpu."""
    install_page_hooks(page)
    name = _kernel_in_page(page, kernel, shape)
    if name is None:
        pytest.skip("this adapter's subgroups fit no subgroup build")
    head_dim, heads = shape.head_dim, shape.num_qo_heads
    rng = np.random.default_rng(head_dim)
    inputs = make_paged_inputs(rng, [17, 300], shape.num_kv_heads, heads, head_dim, "float32")
    batch = 2
    as_i32 = lambda a: _b64(np.asarray(a, np.int32))
    buffers, values = attention_call(
        q=_b64(inputs["q"].astype(np.float32)), pages=_b64(inputs["pages"].astype(np.float32)),
        page_table_indptr=as_i32(inputs["page_table_indptr"]), page_table_values=as_i32(inputs["page_table_values"]),
        length_info=as_i32(inputs["length_info"]), k_rope_pos_offset=as_i32(np.zeros(batch)),
        q_rope_position=as_i32(np.zeros(batch)), output=batch * heads * head_dim * 4, lse=batch * heads * 4,
        batch=batch, nnz_pages=len(inputs["page_table_values"]), max_num_pages=inputs["pages"].shape[0],
        sm_scale=float(inputs["sm_scale"]))
    outputs = {name: buffers.pop(name) for name in ATTENTION_OUTPUTS}  # byte sizes to allocate
    args = {"name": name, "buffers": buffers, "values": values,
            "outputs": outputs}
    result = page.evaluate(
        """(a) => window.demo.python("a = values['a']\\n"
             + "await run_kernel_b64(session, a['name'], a['buffers'], a['values'], a['outputs'])", {a})""", args)
    out = np.frombuffer(base64.b64decode(result["output"]), np.float32).reshape(batch, heads, head_dim)
    lse = np.frombuffer(base64.b64decode(result["lse"]), np.float32).reshape(batch, heads)
    ref_out, ref_lse = decode_attention_reference(
        inputs["q"], inputs["pages"], inputs["page_table_indptr"], inputs["page_table_values"],
        inputs["length_info"], inputs["sm_scale"])
    assert relative_l2(out, ref_out) <= 1e-5
    assert float(np.max(np.abs(lse - ref_lse))) <= 1e-3


def test_the_kernel_lab_runs_without_a_model(page):
    """?model=off (kernels only): the lab runs the benchmark shapes, each row f64-checked and timed.
    Its controls work from the moment the page says it is ready."""
    assert page.evaluate("window.labWiredAtReady") is True
    page.click("#lab-details summary")
    page.fill("#lab-contexts", "64")
    page.fill("#lab-iters", "1")
    page.click("#lab-run")
    page.wait_for_function("() => window.demoState.lab || /failed|must be/.test(document.getElementById('lab-status').textContent)",
                           timeout=300_000)
    lab = page.evaluate("window.demoState.lab")
    assert lab, page.inner_text("#lab-status")
    assert [(r["shape"], r["nest"]) for r in lab["rows"]] == [
        (shape, nest) for shape in ("D=64 8/32", "D=128 8/32", "D=256 4/8") for nest in ("tiled", "sharded", "auto")]
    assert all(r["ok"] and r["us"] > 0 for r in lab["rows"]), lab["rows"]
