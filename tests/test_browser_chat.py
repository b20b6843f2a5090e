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
from model_glue.policy import ATTENTION_TIMING_EVERY

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


def test_the_page_names_the_artifact_it_runs(chat_page):
    """The header, the title and the status line name the artifact, as its manifest says (random weights);
    the served models are offered as links."""
    tab = chat_page
    assert tab.inner_text("header h1") == "tiny_chat (random weights) in your browser"
    assert tab.title().startswith("tiny_chat (random weights) on WebGPU")
    assert tab.inner_text("#status-summary").startswith("ready: tiny_chat (random weights), chatml chat template")
    assert tab.evaluate("window.demoState.model") == {"name": "tiny_chat (random weights)", "kind": "artifact",
                                                      "artifact": "tiny_chat", "shape": "tiny_chat", "layers": 2}
    # the served models, each a link to this page with ?model=NAME (tiny_chat is the tests')
    links = tab.evaluate("[...document.querySelectorAll('#served-models a')].map(a => "
                         "[a.textContent, new URL(a.href).searchParams.get('model')])")
    assert links == [["SmolLM2-135M", "smollm2"], ["Gemma 3 270M", "gemma3"]]


def test_chat_turn_streams_with_overlay_and_stays_offline(chat_page):
    tab = chat_page
    send(tab, "What is the capital of France?", 8)
    tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
    reply = tab.evaluate("window.demoState.lastReply")
    assert reply["stop_reason"] in ("max tokens", "stop token")
    steps = tab.evaluate("window.demoState.steps")
    assert steps[0]["kind"] == "prefill" and steps[0]["context"] == 37  # ChatML prompt, SmolLM2 tokenizer
    assert [s["kind"] for s in steps[1:]] == ["decode"] * (len(steps) - 1)
    assert steps[0]["nest"] == "tiled"  # a prompt of at most 64 tokens: the decode kernels as a batch of its tokens
    assert {s["nest"] for s in steps[1:]} == {"tiled"}  # a short chat stays below 256 tokens
    # attention timed in the prompt, the first decode step and where the context is a multiple of N
    # (RunOptions.time_attention_every; inside the step's pass where the adapter writes timestamps
    # there, as SwiftShader does); the other steps say why they have none
    every = tab.evaluate("window.demoState.info.options.time_attention_every")
    inside = tab.evaluate("window.demoState.device.timestamps_inside_passes")
    assert every == ATTENTION_TIMING_EVERY
    assert ("inside passes" in tab.inner_text("#adapter")) == inside
    timed = [s for s in steps if s["attention_ms"] is not None]
    assert [s["context"] for s in timed] == [37, 38] + [s["context"] for s in steps[2:] if s["context"] % every == 0]
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


# A reply of random weights can be one token repeated with no break opportunity (one pushed the page to
# 1,825 px wide): 2,000 characters of it in both comparison boxes and in a chat bubble.
UNBROKEN = "token" * 400


def test_unbroken_text_wraps_in_the_comparison_and_the_chat(chat_page):
    tab = chat_page
    assert len(UNBROKEN) == 2000
    widths = tab.evaluate("""(text) => {
        const panel = document.getElementById("compare-panel"), hidden = panel.hidden;
        panel.hidden = false;
        const boxes = [document.getElementById("compare-tiled"), document.getElementById("compare-sharded")];
        const kept = boxes.map((box) => box.textContent);
        for (const box of boxes) box.textContent = text;
        const bubbles = [window.demoUI.addMessage("user", text), window.demoUI.addMessage("assistant", text)];
        const seen = { page: document.documentElement.scrollWidth, viewport: window.innerWidth,
            boxes: [...boxes, ...bubbles].map((el) => [el.scrollWidth, el.clientWidth]) };
        boxes.forEach((box, i) => { box.textContent = kept[i]; });
        for (const bubble of bubbles) bubble.remove();
        panel.hidden = hidden;
        return seen;
    }""", UNBROKEN)
    assert widths["page"] <= widths["viewport"], widths
    assert all(scroll <= client for scroll, client in widths["boxes"]), widths


def miss(step, sharded, tiled, rel_l2=0.004, near_tie=True):
    """A teacher-forced miss as chat.session.miss_figures makes it: (margin, lead, other_rank) per run."""
    figures = lambda f: dict(zip(("margin", "lead", "other_rank"), f))  # noqa: E731
    return {"step": step, "tiled_id": 1, "sharded_id": 2, "sharded": figures(sharded), "tiled": figures(tiled),
            "logits_rel_l2": rel_l2, "near_tie": near_tie}


def test_teacher_forced_misses_read_as_near_ties_or_not(chat_page):
    """The comparison's line on its misses: near-ties by their margins, any other miss as such."""
    text = lambda misses: chat_page.evaluate(  # noqa: E731
        "(misses) => window.demoUI.missesText({misses, near_tie_logits: 0.5, tiled_repeated: true})", misses)
    ties = [miss(6, (0.144, 0.144, 2), (0.038, 0.038, 2)), miss(9, (0.01, 0.01, 2), (0.2, 0.3, 3))]
    assert text(ties[:1]) == "1 miss, a near-tie: margins 0.14 (the tiled run's: 0.038)."
    assert text(ties) == "2 misses, all near-ties: margins 0.010-0.14 (the tiled run's: 0.038-0.20)."
    large = [miss(1, (0.169, 0.169, 2), (25.6, 25.6, 2), 0.199, False), miss(4, (0.678, 13.4, 9), (4.54, 7.75, 6), 0.178, False)]
    assert text(large + ties[:1]) == (
        "3 misses, 2 not near-ties (a pick leads the other run's by more than 0.5 logit; the two runs' logits "
        "18-20% apart there, relative L2): token 1: sharded margin 0.17 / tiled margin 25.60; token 4: sharded "
        "margin 0.68 (the tiled pick 9th, 13.40 behind) / tiled margin 4.54 (the sharded pick 6th, 7.75 behind). "
        "1 near-tie: margins 0.14 (the tiled run's: 0.038).")
    assert text(large[:1]).startswith("1 miss, not a near-tie (")


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


def test_the_url_sets_run_options_and_names_a_bad_one(browser, server):
    """?attention=sharded&layout=shards:2&merge_in_o=off: RunOptions fields by name, the same text the
    CLI's flags and the bench's modes take; the model applies them and so does each reply."""
    tab = open_chat_page(browser, server, "?model=tiny_chat&context=512&attention=sharded&layout=shards:2"
                                          "&merge_in_o=off&time_attention_every=1")
    try:
        options = tab.evaluate("window.demoState.info.options")
        assert (options["layout"], options["merge_in_o"], options["time_attention_every"]) == ("shards:2", False, 1)
        assert tab.evaluate("document.getElementById('attention').value") == "sharded"
        send(tab, "Hello", 3)
        tab.wait_for_function("() => window.demoState.lastReply", timeout=REPLY_TIMEOUT_MS)
        decode = [s for s in tab.evaluate("window.demoState.steps") if s["kind"] == "decode"]
        assert decode and all(s["kernel"] == "shards S=2" for s in decode), [s["kernel"] for s in decode]
    finally:
        tab.close()
    bad = open_page(browser, server + "/?model=tiny_chat&merge_in_o=maybe",
                    "window.demoState.chatReady || window.demoState.error", LOAD_TIMEOUT_MS)
    try:
        assert "merge_in_o must be auto, on or off, not 'maybe'" in bad.evaluate("window.demoState.error")
    finally:
        bad.close()


@pytest.mark.slow
def test_golden_answer_with_smollm2_in_chromium(browser, server):
    """SmolLM2 itself in the page (about 8 minutes on SwiftShader): the golden answer."""
    tab = open_chat_page(browser, server, "")
    send(tab, "What is the capital of France?", 16)
    tab.wait_for_function("() => window.demoState.lastReply", timeout=900_000)
    assert tab.evaluate("window.demoState.lastReply")["text"].strip() == "The capital of France is Paris."
    tab.screenshot(path=str(OUTPUT / "page-chat-smollm2.png"), full_page=True)
    tab.close()


@pytest.mark.slow
def test_gemma3_continues_the_primary_colors_in_chromium(browser, server):
    """Gemma 3 270M as the page serves it (?model=gemma3, about 80 s on SwiftShader): llama.cpp's
    greedy continuation of a base model's prompt, in f32 (the adapter has no shader-f16 and the
    family's activations need f32 anyway)."""
    tab = open_chat_page(browser, server, "?model=gemma3")
    assert tab.inner_text("#status-summary").startswith("ready: Gemma 3 270M, text chat template, f32 kernels")
    send(tab, "The three primary colors are", 4)
    tab.wait_for_function("() => window.demoState.lastReply", timeout=900_000)
    assert tab.evaluate("window.demoState.lastReply")["text"] == " red, blue,"
    tab.close()
