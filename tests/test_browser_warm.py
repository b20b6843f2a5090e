"""The clock warm (static/clock_warm.js) in headless Chromium (SwiftShader, tiny_chat), forced on
with ?warm=on: typing runs its kernel, a reply stops it, and nothing runs while the page is busy.
(Off by default on a CPU adapter: test_browser_chat_features. Whether it raises a real GPU's clocks
is a benchmark: docs/benchmarks.md.)"""

import pytest
from conftest import open_page

from app.bench.page import PageDriver

pytestmark = pytest.mark.browser
LOAD_TIMEOUT_MS = 300_000
REPLY_TIMEOUT_MS = 300_000
LOADED = "window.demoState.chatReady || window.demoState.error"


def warm_status(tab) -> dict:
    return tab.evaluate("({...window.demoState.warm})")


def test_typing_runs_the_warm_and_a_reply_stops_it(browser, server):
    tab = open_page(browser, server + "/?model=tiny_chat&warm=on", LOADED, LOAD_TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
        status = warm_status(tab)
        assert status["on"] and status["dispatches"] == 0, status
        assert "clock warm" in tab.inner_text("#adapter")

        tab.type("#prompt", "Hello")  # input events: the warm runs until 2 s after the last one
        tab.wait_for_function("() => window.demoState.warm.dispatches >= 1", timeout=60_000)
        tab.wait_for_function("() => !window.demoState.warm.running", timeout=60_000)
        idle = warm_status(tab)
        assert idle["bursts"] == 1, idle

        tab.fill("#max-tokens", "8")
        # A key and Send in one task: the warm is running when the turn starts, whatever the machine's load.
        at_send = tab.evaluate("""() => {
            const prompt = document.getElementById('prompt');
            prompt.value += ' there';
            prompt.dispatchEvent(new Event('input'));
            const running = window.demoState.warm.running;
            window.demoState.lastReply = null;
            document.getElementById('send').click();
            return {running, dispatches: window.demoState.warm.dispatches};
        }""")
        assert at_send["running"], at_send
        tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
        after = warm_status(tab)
        assert not after["running"], after
        assert after["dispatches"] <= at_send["dispatches"] + 1, (at_send, after)  # the one in flight at most
        assert tab.evaluate("window.demoState.lastReply.text").strip()
        assert tab.is_hidden("#chat-error")

        # `bench page --first-turns --typing`: its typing runs the warm, and its turn gives its figures.
        before = warm_status(tab)["dispatches"]
        turn = PageDriver(tab, tab.url).first_turn("Hello there", 4, typing_s=0.5)
        assert turn["tokens"] >= 1 and turn["decode_steps"] >= 1 and turn["speed"]["ttft_ms"] > 0, turn
        assert warm_status(tab)["dispatches"] > before
    finally:
        tab.close()
