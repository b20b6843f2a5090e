"""Shared fixtures: the built artifact, a native wgpu device, the served tree, headless Chromium."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
ARTIFACT = STATIC / "artifacts" / "kernels"
TEST_ARTIFACT = ROOT / "build" / "test-kernels"
sys.path.insert(0, str(Path(__file__).resolve().parent))


class LoopThread:
    """An asyncio loop on its own thread: Playwright's sync API keeps a loop running on the main
    thread while the browser is open, so native async calls cannot run there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run_until_complete(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="session")
def loop():
    runner = LoopThread()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def artifact_dir() -> Path:
    """The kernel artifact `make` builds; built here if a test run starts without it."""
    if not (ARTIFACT / "manifest.json").exists():
        from kernels.build import build_artifact
        from kernels.catalog import all_recipes

        build_artifact(ARTIFACT, all_recipes())
    return ARTIFACT


@pytest.fixture(scope="session")
def gpu(loop):
    """wgpu-py on this machine's Vulkan adapter (Mesa lavapipe on CI)."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    from model_glue.gpu.webgpu_native import WgpuDevice

    return loop.run_until_complete(WgpuDevice.open())


@pytest.fixture(scope="session")
def library(loop, gpu, artifact_dir):
    from model_glue.gpu.artifact import KernelLibrary

    return loop.run_until_complete(KernelLibrary.from_folder(gpu, artifact_dir))


@pytest.fixture(scope="session")
def test_artifact_dir() -> Path:
    """The kernels only the tests run (`make test` builds them); built here if a run starts without."""
    if not (TEST_ARTIFACT / "manifest.json").exists():
        from kernels.build import build_artifact
        from kernel_grid import grid_recipes

        build_artifact(TEST_ARTIFACT, recipes=grid_recipes())
    return TEST_ARTIFACT


@pytest.fixture(scope="session")
def test_library(loop, gpu, test_artifact_dir):
    from model_glue.gpu.artifact import KernelLibrary

    return loop.run_until_complete(KernelLibrary.from_folder(gpu, test_artifact_dir))


@pytest.fixture(scope="session")
def server():
    """The app's static server on 127.0.0.1 with a free port, for the browser tests; it also serves
    the test hooks (app/hooks/), which a page loads when its URL asks (`with_hooks`)."""
    from app.server import make_server

    httpd = make_server(STATIC, host="127.0.0.1", port=0, hooks=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


from app.bench.page import CHROMIUM_FLAGS  # noqa: E402 (Debian's chromium, headless, WebGPU on)

# Dawn zero-fills every workgroup's `var<workgroup>` arrays before the shader runs. On SwiftShader
# that costs milliseconds per 256-invocation workgroup (22 dispatches of 64 such workgroups with
# 16 KiB: 4.3 s with it, 0.14 s without), and it made a tiny_chat decode step take ~2 s instead
# of ~0.5 s. No kernel here reads workgroup memory it has not written (the kernel tests compare
# against f64 references with it on too: test_browser.py runs Chromium as users do), so the
# chat-level modules turn it off to keep the suite's time within budget.
FAST_SWIFTSHADER_FLAGS = ["--enable-dawn-features=disable_workgroup_init"]


@contextlib.contextmanager
def chromium(profile_dir, extra_flags=()):
    """Debian's chromium (never a Playwright download), a fresh profile, WebGPU on SwiftShader."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("Debian's chromium is not installed: run `make test`, which installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(profile_dir), executable_path=path, headless=True,
                                                        args=CHROMIUM_FLAGS + list(extra_flags))
        yield context
        context.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium per test module: a module's GPU state (hundreds of compiled pipelines, a
    deliberately broken shader) never reaches the next module's pages. Workgroup zero-fill off
    (FAST_SWIFTSHADER_FLAGS); test_browser.py overrides this fixture to run Chromium's defaults."""
    with chromium(tmp_path_factory.mktemp("chromium-profile"), FAST_SWIFTSHADER_FLAGS) as context:
        yield context


@pytest.fixture
def fresh_browser(tmp_path_factory):
    """A Chromium of its own, for a test that breaks the page on purpose (a shader that does not
    compile once left SwiftShader's renderer crashing on the next page load)."""
    with chromium(tmp_path_factory.mktemp("chromium-profile"), FAST_SWIFTSHADER_FLAGS) as context:
        yield context


def run_comparison(tab, max_tokens: int, timeout_ms: int, prompt: str | None = None) -> dict:
    """Click Compare nests (on `prompt`, or on the text already in the box) and wait for the page's
    result (window.demoState.lastCompare)."""
    if prompt is not None:
        tab.fill("#prompt", prompt)
    tab.fill("#max-tokens", str(max_tokens))
    tab.evaluate("window.demoState.lastCompare = null")
    tab.click("#compare")
    tab.wait_for_function("() => window.demoState.lastCompare", timeout=timeout_ms)
    return tab.evaluate("window.demoState.lastCompare")


def with_hooks(url: str) -> str:
    """`url` asking for the test hook `python` (window.demo.python: Python run in the page's worker),
    unless it names its hooks itself (e.g. hooks=python,bench: window.demo.bench too)."""
    if "hooks=" in url:
        return url
    return url + ("&" if "?" in url else "?") + "hooks=python"


def open_page(browser, url: str, ready: str, timeout_ms: int, before_load=None):
    """A new tab on `url` (with the test hooks: `with_hooks`), waited until the JS expression `ready`
    holds; records its requests, console errors and HTTP errors (`tab.requests`,
    `tab.console_errors`, `tab.http_errors`).

    The page's Content-Security-Policy forbids eval, so Playwright gets `ready` as a function.
    `before_load(tab)` runs before navigation (e.g. to route requests to a fault).

    SwiftShader's renderer crashed once here ("Target crashed") while loading the page; a crash
    gets one fresh tab before the test fails, and is reported on stderr either way.
    """
    from playwright.sync_api import Error as PlaywrightError

    for attempt in (1, 2):
        tab = browser.new_page()
        tab.set_viewport_size({"width": 1280, "height": 900})
        tab.requests, tab.console_errors, tab.http_errors = [], [], []
        tab.on("request", lambda r, tab=tab: tab.requests.append(r.url))
        tab.on("console", lambda m, tab=tab: m.type == "error" and tab.console_errors.append(m.text))
        tab.on("response", lambda r, tab=tab: r.status >= 400 and tab.http_errors.append(f"{r.status} {r.url}"))
        if before_load is not None:
            before_load(tab)
        try:
            tab.goto(with_hooks(url))
            tab.wait_for_function(f"() => {ready}", timeout=timeout_ms)
            return tab
        except PlaywrightError as err:
            tab.close()
            if "crash" not in str(err).lower() or attempt == 2:
                raise
            print(f"\nchromium crashed loading {url} ({err}); retrying once", file=sys.stderr)
