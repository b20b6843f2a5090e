"""`python -m app serve`: a static server for the page's tree (stdlib http.server).

Loopback by default, explicit MIME types for what Pyodide fetches, no directory listings, and
nothing outside the served folder (`..` in any spelling is refused before the filesystem is
touched).
"""

from __future__ import annotations

import functools
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

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


def make_server(root: Path, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    root = Path(root).resolve()
    if not (root / "index.html").exists():
        raise FileNotFoundError(f"{root} has no index.html")
    handler = functools.partial(StaticHandler, directory=str(root))
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
