"""`?model=synthetic:SHAPE` in Chromium (SwiftShader): a contract shape's random weights are filled on
the GPU in the worker, behind SmolLM2's tokenizer, so nothing but the tokenizer is fetched. SwiftShader
has no shader-f16, so the Llama shapes (f16 kernels only) are refused there with the reason; tiny_chat's
shape (f32 kernels served) runs the whole page."""

import json
from pathlib import Path

import pytest
from conftest import open_page

pytestmark = pytest.mark.browser
TIMEOUT_MS = 300_000


def test_a_synthetic_model_fills_its_weights_on_the_gpu_and_chats(browser, server):
    tab = open_page(browser, server + "/?model=synthetic:tiny_chat",
                    "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
        status = tab.text_content("#status-panel")  # the loading steps, folded away once ready
        assert "filling random weights on the GPU" in status and "the text is noise" in status
        assert not [u for u in tab.requests if "weights.bin" in u]  # no weights travel
        assert any(u.endswith("/artifacts/smollm2/tokenizer.json") for u in tab.requests)
        assert tab.evaluate("window.demoState.info.config") == "tiny_chat"
        # named by its shape in the header, the title, the status line and the export
        name = "tiny_chat shape, random weights"
        assert tab.inner_text("header h1") == f"{name} in your browser"
        assert tab.title().startswith(f"{name} on WebGPU") and f"ready: {name}," in tab.inner_text("#status-summary")
        tab.fill("#max-tokens", "6")
        tab.fill("#prompt", "Hello")
        tab.evaluate("window.demoState.lastReply = null")
        tab.click("#send")
        tab.wait_for_function("() => window.demoState.lastReply", timeout=TIMEOUT_MS)
        steps = tab.evaluate("window.demoState.steps")
        assert [s["kind"] for s in steps] == ["prefill"] + ["decode"] * (len(steps) - 1) and len(steps) >= 2
        with tab.expect_download() as download:
            tab.click("#export-json")
        exported = json.loads(Path(download.value.path()).read_text())
        assert exported["model"] == {"name": name, "kind": "synthetic", "shape": "tiny_chat", "layers": 2}
        assert [r["model"] for r in exported["replies"]] == [name]
        assert tab.console_errors == [] and tab.http_errors == []
    finally:
        tab.close()


def test_a_shape_this_adapter_cannot_run_is_refused_with_the_reason(browser, server):
    tab = open_page(browser, server + "/?model=synthetic:llama-3.1-8b",
                    "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        error = tab.evaluate("window.demoState.error")
        assert error and "float16 only" in error and "shader-f16" in error, error
        assert "float16 only" in tab.inner_text("#error")
        assert tab.evaluate("window.demoState.errorKind") == "NeedsShaderF16"  # what to do, below the error
        help_text = tab.inner_text("#error-help")
        assert "--enable-dawn-features=vulkan_enable_f16_on_nvidia" in help_text and "?model=smollm2" in help_text
        assert tab.inner_text("header h1") == "llama-3.1-8b shape, random weights in your browser"  # as asked for
    finally:
        tab.close()
