""""Open a GGUF…" in Chromium (SwiftShader, f32 kernels): a GGUF of the served tiny_chat shape, written
with the gguf package, is read from the file picker in the worker (nothing is uploaded to the server),
its tensors repacked on the GPU, and the chat talks through the file's own tokenizer and template. A
truncated file is refused with the reason and the model loaded before keeps chatting."""

import csv
import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from conftest import open_page

from contract.model import ALL_MODEL_CONFIGS
from app.bench.gguf_files import write_llama_gguf

pytestmark = pytest.mark.browser
TIMEOUT_MS = 300_000
CHATML = "{% for m in messages %}<|im_start|>{{m.role}}\n{{m.content}}<|im_end|>\n{% endfor %}"


def chat_once(tab, text: str, tokens: int) -> None:
    """Send `text` for a reply of at most `tokens` and wait for it."""
    tab.fill("#max-tokens", str(tokens))
    tab.fill("#prompt", text)
    tab.evaluate("window.demoState.lastReply = null")
    tab.click("#send")
    tab.wait_for_function("() => window.demoState.lastReply", timeout=TIMEOUT_MS)


# The page hashes and stores an opened GGUF this many bytes at a time (?keepChunk): small, so that
# caching the 8 MB test file lasts through the reply typed right after Ready.
KEEP_CHUNK = 4096


def chunked_sha256(data: bytes, chunk: int) -> str:
    """static/weights_cache.js chunkedSha256: the sha256 of the chunks' sha256 digests."""
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + chunk]).digest()
                                   for i in range(0, len(data), chunk))).hexdigest()


# A file name is shown as text, never as HTML.
GGUF_NAME = "tiny-chat-q4_1 <img src=x onerror=alert(1)>.gguf"


def test_open_a_gguf_then_a_truncated_one(browser, server, tmp_path):
    path = tmp_path / GGUF_NAME
    write_llama_gguf(path, dataclasses.replace(ALL_MODEL_CONFIGS["tiny_chat"], n_layers=1), chat_template=CHATML,
                     types={"matrix": "Q4_1", "down": "Q6_K", "embed": "Q8_0"}, seed=3)  # down as Q8A
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-4096])
    tab = open_page(browser, server + f"/?model=synthetic:tiny_chat&keepChunk={KEEP_CHUNK}",
                    "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
        tab.set_input_files("#gguf-file", str(path))
        tab.wait_for_function("() => window.demoState.info.config === 'tiny_chat' && window.demoState.info.layers === 1"
                              " && !window.demoState.openingGguf", timeout=TIMEOUT_MS)
        # A reply right after Ready: the file's caching, in its own worker, waits while it runs.
        chat_once(tab, "hello there", 4)
        tab.wait_for_function("() => window.demoState.keptGguf", timeout=TIMEOUT_MS)
        kept, holds = tab.evaluate("[window.demoState.keptGguf, window.demoState.keeping.holds]")
        assert kept.get("key") and kept["sha256"] == chunked_sha256(path.read_bytes(), KEEP_CHUNK), kept
        released = [h for h in holds if h["releasedAt"] is not None]
        assert released, f"the reply did not overlap the caching ({holds}): make KEEP_CHUNK smaller"
        # at most the chunk in flight when the hold came finishes while held
        assert all(h["releasedAt"] - h["heldAt"] <= KEEP_CHUNK for h in released), holds
        status = tab.text_content("#status-panel")
        name = f"{GGUF_NAME} (tiny_chat shape, 1 layer)"  # its file name and shape
        assert f"Ready: {name}, chatml chat template" in status, status
        assert "weights Q8 embed; Q4 qkv, o, gate_up; Q8A down" in status, status  # each matrix's own format
        assert tab.inner_text("header h1") == f"{name} in your browser" and tab.locator("header img, #status-panel img").count() == 0
        assert tab.title().startswith(f"{name} on WebGPU") and f"ready: {name}," in tab.inner_text("#status-summary")
        assert not [u for u in tab.requests if u.endswith(".gguf")]  # the file never went to the server
        assert len(tab.evaluate("window.demoState.steps")) >= 1
        with tab.expect_download() as download:
            tab.click("#export-csv")
        rows = list(csv.DictReader(Path(download.value.path()).read_text().splitlines()))
        assert rows and {r["model"] for r in rows} == {name}  # the name's comma is quoted
        with tab.expect_download() as download:
            tab.click("#export-json")
        exported = json.loads(Path(download.value.path()).read_text())
        assert exported["model"] == {"name": name, "kind": "gguf", "file": GGUF_NAME, "shape": "tiny_chat", "layers": 1}

        tab.set_input_files("#gguf-file", str(cut))
        tab.wait_for_function("() => !document.querySelector('#error').hidden && !window.demoState.openingGguf",
                              timeout=TIMEOUT_MS)
        error = tab.inner_text("#error")
        assert "Cannot open cut.gguf" in error and "truncated" in error and "still here" in error, error
        assert tab.evaluate("window.demoState.errorKind") == "GGUFError"  # a kind the page tells the user about
        assert "not a GGUF this page reads, or it is cut short" in tab.inner_text("#error-help")
        assert tab.inner_text("header h1") == f"{name} in your browser"  # the model still loaded
        chat_once(tab, "again", 4)
        assert tab.console_errors == [] and tab.http_errors == []
    finally:
        tab.close()

    # the next visit offers the kept file and opens it from the browser's cache
    tab = open_page(browser, server + "/?model=synthetic:tiny_chat",
                    "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        button = tab.locator("#cached-ggufs button", has_text=GGUF_NAME)
        button.wait_for(timeout=TIMEOUT_MS)
        assert "cut.gguf" not in tab.inner_text("#cached-ggufs")  # a refused file is not kept
        button.click()
        tab.wait_for_function("() => window.demoState.info.layers === 1 && !window.demoState.openingGguf",
                              timeout=TIMEOUT_MS)
        assert "from the browser's cache" in tab.text_content("#status-panel")
        chat_once(tab, "hi", 3)
        assert tab.console_errors == [] and tab.http_errors == []
    finally:
        tab.close()


def test_a_converted_gguf_opens_as_an_artifact(browser, loop, gpu, library, tmp_path):
    """`python -m app convert --gguf` (app.convert_gguf) writes an artifact the page loads with
    `?model=NAME`: its weights, and the file's tokenizer and chat template from gguf_tokenizer.json.
    The page's prompt ids are the native ChatSession's for the same artifact and message."""
    import threading

    from conftest import STATIC
    from app.convert_gguf import convert_gguf_file
    from app.server import make_server
    from chat.session import ChatSession
    from model_glue.sources import Artifact, open_model
    from model_glue.gpu.artifact import folder_readers
    from model_glue.options import RunOptions

    gguf = tmp_path / "tiny-chat-q4_0.gguf"
    write_llama_gguf(gguf, dataclasses.replace(ALL_MODEL_CONFIGS["tiny_chat"], n_layers=1), chat_template=CHATML,
                     types={"matrix": "Q4_0", "embed": "Q8_0"}, seed=7)
    # the served tree, with the converted artifact beside the others (links: nothing is copied)
    root = tmp_path / "static"
    (root / "artifacts").mkdir(parents=True)
    for entry in STATIC.iterdir():
        if entry.name != "artifacts":
            (root / entry.name).symlink_to(entry)
    for entry in (STATIC / "artifacts").iterdir():
        (root / "artifacts" / entry.name).symlink_to(entry)
    converted = root / "artifacts" / "converted"
    loop.run_until_complete(convert_gguf_file(gpu, library, gguf, converted, log=lambda message: None))

    native = ChatSession(loop.run_until_complete(open_model(gpu, library, Artifact(folder_readers(converted)),
                                                            dtype="float32",
                                                            options=RunOptions(max_context=512, warm_up=False))))
    try:
        want = native.prompt_ids([{"role": "user", "content": "hello there"}])
    finally:
        native.model.release()

    httpd = make_server(root, host="127.0.0.1", port=0, hooks=True)  # open_page asks for the test hooks
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    tab = open_page(browser, f"http://127.0.0.1:{httpd.server_address[1]}/?model=converted",
                    "window.demoState.chatReady || window.demoState.error", TIMEOUT_MS)
    try:
        assert tab.evaluate("window.demoState.chatReady"), tab.evaluate("window.demoState.error")
        assert tab.evaluate("window.demoState.info.config") == "tiny_chat"
        status = tab.text_content("#status-panel")
        assert "converted (converted from tiny-chat-q4_0.gguf), chatml chat template" in status, status
        chat_once(tab, "hello there", 4)
        reply = tab.evaluate("window.demoState.lastReply")
        assert reply["prompt_tokens"] == len(want) and 1 <= len(reply["token_ids"]) <= 4, reply
        assert tab.console_errors == [] and tab.http_errors == []
    finally:
        tab.close()
        httpd.shutdown()
        httpd.server_close()
