"""Warm clocks while typing (chat/page.py warm_gpu, model_glue.clock_warmer): typing in the prompt box
runs bounded GPU work in the worker, at most one at a time and WARM_GAP_SECONDS apart; `?warm=off`
runs none; a reply right after still streams normally."""

import pytest
from conftest import open_page

pytestmark = pytest.mark.browser
TIMEOUT_MS = 300_000


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "warm-off"])
def test_typing_warms_the_gpu_unless_turned_off(browser, server, warm):
    url = server + "/?model=synthetic:tiny_chat" + ("" if warm else "&warm=off")
    tab = open_page(browser, url, "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
        tab.type("#prompt", "Hello there", delay=30)
        if warm:
            tab.wait_for_function("() => window.demoState.warms >= 1 && !window.demoState.warming", timeout=TIMEOUT_MS)
            last = tab.evaluate("window.demoState.lastWarm")
            assert last["dispatches"] >= 1 and last["seconds"] < 5, last
        else:
            tab.wait_for_timeout(500)
            assert not tab.evaluate("window.demoState.warms") and not tab.evaluate("window.demoState.warming")
        tab.fill("#max-tokens", "3")
        tab.evaluate("window.demoState.lastReply = null")
        tab.click("#send")
        tab.wait_for_function("() => window.demoState.lastReply", timeout=TIMEOUT_MS)
        assert tab.console_errors == [] and tab.http_errors == []
    finally:
        tab.close()
