"""The chat page end to end in headless Chromium (SwiftShader: f32 kernels on the CPU).

SwiftShader runs SmolLM2 at minutes per reply (prefill ~6 min, ~14 s per token, measured), so
the page tests drive `?model=tiny_chat`: random weights of a tiny Llama behind SmolLM2's own
tokenizer, through exactly the same page, Python and kernels. The real model's golden answer in
Chromium is the `slow` test at the bottom (`make test-slow`); natively it runs in test_model.py.
"""

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import open_page, run_comparison
from model_glue.options import ATTENTION_TIMING_EVERY

pytestmark = pytest.mark.browser
OUTPUT = Path(__file__).resolve().parent.parent / "test-output"
LOAD_TIMEOUT_MS = 300_000
REPLY_TIMEOUT_MS = 300_000


def open_chat_page(browser, server, query):
    tab = open_page(browser, server + "/" + query, "window.demoState.chatReady || window.demoState.error",
                    LOAD_TIMEOUT_MS)
    assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
    return tab


@pytest.fixture(scope="module")
def chat_page(browser, server):
    tab = open_chat_page(browser, server, "?model=tiny_chat")
    yield tab
    tab.close()


def send(tab, text, max_tokens):
    tab.fill("#max-tokens", str(max_tokens))
    tab.fill("#prompt", text)
    tab.evaluate("window.demoState.lastReply = null")
    tab.click("#send")


def test_chat_turn_streams_with_overlay_and_stays_offline(chat_page):
    tab = chat_page
    send(tab, "What is the capital of France?", 8)
    tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
    reply = tab.evaluate("window.demoState.lastReply")
    assert reply["stop_reason"] in ("max tokens", "stop token")
    steps = tab.evaluate("window.demoState.steps")
    assert steps[0]["kind"] == "prefill" and steps[0]["context"] == 37  # ChatML prompt, SmolLM2 tokenizer
    assert [s["kind"] for s in steps[1:]] == ["decode"] * (len(steps) - 1)
    assert steps[0]["nest"] == "prefill"  # the prompt runs the causal prefill kernel
    assert {s["nest"] for s in steps[1:]} == {"tiled"}  # a short chat stays below 256 tokens
    # attention timed in the prompt, the first decode step and where the context is a multiple of N
    # (RunOptions.time_attention_every); the other steps say why they have none
    timed = [s for s in steps if s["attention_ms"] is not None]
    assert [s["context"] for s in timed] == [37, 38] + [
        s["context"] for s in steps[2:] if s["context"] % ATTENTION_TIMING_EVERY == 0]
    assert all(s["attention_ms"] > 0 for s in timed)
    assert all("sampled" in s["timing_note"] for s in steps if s["attention_ms"] is None)
    assert "tiled" in tab.inner_text("#overlay-last")
    assert tab.locator(".msg.assistant").last.inner_text().startswith(reply["text"][:20])
    hosts = {urlsplit(u).hostname for u in tab.requests if not u.startswith(("data:", "blob:"))}
    assert hosts == {"127.0.0.1"}, f"requests left 127.0.0.1: {sorted(hosts)}"
    OUTPUT.mkdir(exist_ok=True)
    tab.screenshot(path=str(OUTPUT / "page-chat.png"), full_page=True)
    (OUTPUT / "browser-chat-steps.json").write_text(json.dumps(steps, indent=1))


def test_compare_mode_shows_both_nests(chat_page):
    tab = chat_page
    result = run_comparison(tab, 6, REPLY_TIMEOUT_MS, prompt="Compare me")
    assert result["identical"] and result["first_divergence"] is None
    assert tab.inner_text("#compare-verdict") == "Identical greedy text."
    assert tab.inner_text("#compare-tiled") == tab.inner_text("#compare-sharded")


def test_bad_input_is_refused_and_nothing_is_lost(chat_page):
    tab = chat_page
    before = tab.locator(".msg").count()
    send(tab, "   ", 4)
    assert tab.inner_text("#chat-error") == "The message is empty."
    long_text = "word " * 2000
    send(tab, long_text, 4)
    tab.wait_for_function("() => !document.getElementById('chat-error').hidden", timeout=30_000)
    assert "limit is 8000" in tab.inner_text("#chat-error")
    assert tab.input_value("#prompt") == long_text  # the typed text stays
    assert tab.locator(".msg").count() == before


def test_html_is_shown_as_text_and_stop_keeps_the_partial_reply(chat_page):
    tab = chat_page
    tab.click("#new-chat")
    send(tab, "<b>bold</b><img src=x onerror=alert(1)> Write a long story.", 200)
    tab.wait_for_function("() => window.demoState.steps.filter(s => s.kind === 'decode').length >= 3",
                          timeout=REPLY_TIMEOUT_MS)
    tab.click("#stop")
    tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
    reply = tab.evaluate("window.demoState.lastReply")
    assert reply["stop_reason"] == "stopped by user"
    assert reply["text"]  # the partial reply is kept
    user = tab.locator(".msg.user").last
    assert user.inner_text().startswith("<b>bold</b><img")
    assert tab.locator(".msg b, .msg img").count() == 0
    # the stopped reply is part of the conversation
    history = json.loads(tab.evaluate("window.demo.python('import json; json.dumps(chat.messages)')"))
    assert history[-1]["role"] == "assistant" and history[-1]["content"] == reply["text"]


@pytest.mark.slow
def test_golden_answer_with_smollm2_in_chromium(browser, server):
    """SmolLM2 itself in the page (about 8 minutes on SwiftShader): the golden answer."""
    tab = open_chat_page(browser, server, "")
    send(tab, "What is the capital of France?", 16)
    tab.wait_for_function("() => window.demoState.lastReply", timeout=900_000)
    assert tab.evaluate("window.demoState.lastReply")["text"].strip() == "The capital of France is Paris."
    tab.screenshot(path=str(OUTPUT / "page-chat-smollm2.png"), full_page=True)
    tab.close()
