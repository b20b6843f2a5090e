"""`python -m app serve`: a static server for the page's tree (stdlib http.server).

Loopback by default, explicit MIME types for what Pyodide fetches, no directory listings, and
nothing outside the served folder (`..` in any spelling is refused before the filesystem is
touched). The tests and the page benchmark also serve the test hooks (`hooks=True`: app/hooks/
under /hooks/, which the page's worker imports when the URL asks, e.g. ?hooks=python, and the page
benchmarks' modules, app/page_bench/, under /hooks/page_bench/ for ?hooks=bench); `app serve`
never does, so the served page has no way to run code it was sent.
"""

from __future__ import annotations

import functools
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

HOOKS_DIR = Path(__file__).resolve().parent / "hooks"  # test hooks: served only with hooks=True
# Where the worker (at the served root) imports them from: chat.api.HOOKS_PATH (not imported: this
# server runs without the run side; tests/test_page_boundary.py checks they agree).
HOOKS_URL = "/hooks/"
# the page benchmarks' package (app/page_bench), which the bench hook copies into the worker
PAGE_BENCH_DIR = Path(__file__).resolve().parent / "page_bench"
PAGE_BENCH_URL = HOOKS_URL + "page_bench/"

MIME_TYPES = {
    ".wasm": "application/wasm",
    ".mjs": "text/javascript",
    ".js": "text/javascript",
    ".json": "application/json",
    ".whl": "application/zip",
    ".zip": "application/zip",
    ".wgsl": "text/plain; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
# Only this origin. Pyodide compiles WebAssembly ('wasm-unsafe-eval'); nothing else is relaxed:
# no inline script, no eval, no other host. The page sets text only through textContent.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self' 'wasm-unsafe-eval'",
    "connect-src 'self'",
    "img-src 'self' data: blob:",
    "style-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class StaticHandler(SimpleHTTPRequestHandler):
    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **MIME_TYPES}
    hooks: Path | None = None  # the folder served at HOOKS_URL, if any

    def translate_path(self, path):
        # send_head has refused `..` already; a hook is a file directly in the hooks folder
        clean = unquote(urlsplit(path).path)
        if self.hooks is not None and clean.startswith(PAGE_BENCH_URL) and clean.endswith(".py") \
                and "/" not in clean[len(PAGE_BENCH_URL):]:
            return str(PAGE_BENCH_DIR / clean[len(PAGE_BENCH_URL):])
        if self.hooks is not None and clean.startswith(HOOKS_URL) and "/" not in clean[len(HOOKS_URL):]:
            return str(self.hooks / clean[len(HOOKS_URL):])
        return super().translate_path(path)

    def send_head(self):
        path = unquote(urlsplit(self.path).path)
        if "\\" in path or ".." in path.split("/") or "\x00" in path:
            self.send_error(HTTPStatus.NOT_FOUND, "not found")
            return None
        return super().send_head()

    def list_directory(self, path):
        self.send_error(HTTPStatus.NOT_FOUND, "no directory listings")
        return None

    def end_headers(self):
        # Rebuilt artifacts must not be served stale from the browser's cache.
        self.send_header("Cache-Control", "no-cache")
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, format, *args):  # quieter than the default: one line per error only
        if args and str(args[1] if len(args) > 1 else "").startswith(("4", "5")):
            super().log_message(format, *args)


class HookedHandler(StaticHandler):
    hooks = HOOKS_DIR


def make_server(root: Path, host: str = "127.0.0.1", port: int = 8000, hooks: bool = False) -> ThreadingHTTPServer:
    """The page's tree under `root`; with `hooks`, the test hooks too (tests and benchmarks only)."""
    root = Path(root).resolve()
    if not (root / "index.html").exists():
        raise FileNotFoundError(f"{root} has no index.html")
    handler = functools.partial(HookedHandler if hooks else StaticHandler, directory=str(root))
    return ThreadingHTTPServer((host, port), handler)


def serve(root: Path, host: str, port: int) -> None:
    httpd = make_server(root, host, port)
    shown_host = "127.0.0.1" if host == "0.0.0.0" else host
    url = f"http://{shown_host}:{httpd.server_address[1]}/"
    print(f"serving {root} at {url}  (Ctrl-C to stop)", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
