"""The static server: MIME types, no listings, no way out of the served folder."""

import http.client
import threading

import pytest

from app.server import make_server


@pytest.fixture(scope="module")
def tree_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    (root / "index.html").write_text("<!doctype html><title>t</title>")
    (root / "sub").mkdir()
    (root / "sub" / "a.wasm").write_bytes(b"\0asm")
    (root / "sub" / "b.mjs").write_text("export {}")
    (root / "sub" / "c.whl").write_bytes(b"PK")
    (root / "favicon.svg").write_text("<svg xmlns=\"http://www.w3.org/2000/svg\"/>")
    (root.parent / "secret.txt").write_text("outside the served tree")
    httpd = make_server(root, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.getheader("Content-Type"), response.read()


def test_binds_loopback_by_default(tmp_path):
    (tmp_path / "index.html").write_text("x")
    httpd = make_server(tmp_path, port=0)
    try:
        assert httpd.server_address[0] == "127.0.0.1"
    finally:
        httpd.server_close()


@pytest.mark.parametrize("path,mime", [
    ("/sub/a.wasm", "application/wasm"),
    ("/sub/b.mjs", "text/javascript"),
    ("/sub/c.whl", "application/zip"),
    ("/", "text/html; charset=utf-8"),
])
def test_mime_types(tree_server, path, mime):
    status, content_type, _ = get(tree_server, path)
    assert status == 200 and content_type == mime


@pytest.mark.parametrize("path", [
    "/../secret.txt", "/sub/../../secret.txt", "/%2e%2e/secret.txt", "/sub/%2E%2E/%2e%2e/secret.txt",
    "/..%2fsecret.txt", "/sub/..%5c..%5csecret.txt",
])
def test_refuses_traversal(tree_server, path):
    status, _, body = get(tree_server, path)
    assert status == 404
    assert b"outside the served tree" not in body


def test_no_directory_listing(tree_server):
    status, _, body = get(tree_server, "/sub/")
    assert status == 404
    assert b"a.wasm" not in body


def test_security_headers_on_every_response(tree_server):
    for path in ("/", "/sub/a.wasm", "/missing.txt"):
        conn = http.client.HTTPConnection("127.0.0.1", tree_server, timeout=5)
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        csp = response.getheader("Content-Security-Policy")
        assert csp is not None, path
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
        assert directives["default-src"] == "'self'"
        # WebAssembly for Pyodide and nothing else: no inline script, no eval, no other origin.
        assert directives["script-src"] == "'self' 'wasm-unsafe-eval'"
        assert directives["connect-src"] == "'self'"
        assert response.getheader("X-Content-Type-Options") == "nosniff"
        assert response.getheader("Referrer-Policy") == "no-referrer"


def test_favicon_is_served(tree_server):
    status, content_type, _ = get(tree_server, "/favicon.svg")
    assert status == 200 and content_type == "image/svg+xml"
