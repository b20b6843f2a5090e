"""Warm clocks while typing (chat/page.py warm_gpu, model_glue.clock_warmer): typing in the prompt box
runs bounded GPU work in the worker with `?warm=on`, at most one at a time and WARM_GAP_SECONDS apart;
by default (measured on the H200: it slowed the reply) none; a reply that starts while a warm runs stops it, and streams normally. A CPU adapter
(SwiftShader, where this runs in `make test`) skips the warm and the page stops asking; the GPU path
(and the cancel) is measured on the H200 (docs/benchmarks.md) and tested natively (test_probe_kernel)."""

import pytest
from conftest import open_page

pytestmark = pytest.mark.browser
TIMEOUT_MS = 300_000


@pytest.mark.parametrize("warm", [True, False], ids=["warm-on", "default-off"])
def test_typing_warms_the_gpu_unless_turned_off(browser, server, warm):
    url = server + "/?model=synthetic:tiny_chat" + ("&warm=on" if warm else "")
    tab = open_page(browser, url, "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
        tab.type("#prompt", "Hello there", delay=30)
        cpu = tab.evaluate("window.demoState.device.cpu")
        if warm:
            tab.wait_for_function("() => window.demoState.warms >= 1 && !window.demoState.warming", timeout=TIMEOUT_MS)
            last = tab.evaluate("window.demoState.lastWarm")
            if cpu:  # SwiftShader: nothing to raise, and no more asking
                assert last["dispatches"] == 0 and "CPU adapter" in last["skipped"], last
                tab.evaluate("window.demoState.warmedAt = 0")
                tab.type("#prompt", " again", delay=30)
                assert tab.evaluate("window.demoState.warms") == 1 and not tab.evaluate("window.demoState.warming")
            else:
                assert last["dispatches"] >= 1 and last["seconds"] < 5, last
        else:
            tab.wait_for_timeout(500)
            assert not tab.evaluate("window.demoState.warms") and not tab.evaluate("window.demoState.warming")
        tab.fill("#max-tokens", "3")
        if warm and not cpu:  # a reply that starts while a warm runs stops it (streaming beside a reply slows it)
            tab.evaluate("window.demoState.warmedAt = 0")
            tab.type("#prompt", "!")
            tab.wait_for_function("() => window.demoState.warming", timeout=TIMEOUT_MS)
        tab.evaluate("window.demoState.lastReply = null")
        tab.click("#send")
        tab.wait_for_function("() => window.demoState.lastReply && !window.demoState.warming", timeout=TIMEOUT_MS)
        if warm and not cpu:
            assert tab.evaluate("window.demoState.lastWarm.cancelled"), tab.evaluate("window.demoState.lastWarm")
        assert tab.console_errors == [] and tab.http_errors == []
    finally:
        tab.close()
