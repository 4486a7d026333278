"""A real HTTP server on 127.0.0.1 whose POST handler is a Python function, for tests that talk to servers: the
suite's OpenAI-compatible completions server (openai_compat_server.py), a judge, a scripted policy."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Handle = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]
"""(path, JSON body) → (HTTP status, JSON payload)."""


class JsonServer:
    """``handle`` behind real HTTP (POST; a GET is handled with an empty body), keep-alive as real servers are, one
    thread per connection, on a port the OS picks and the server binds itself (no probe-then-bind race). Every
    body received is in ``requests``, every client connection in ``connections``."""

    def __init__(self, handle: Handle) -> None:
        self.requests: list[dict[str, Any]] = []
        self.connections: set[tuple[str, int]] = set()  # client (host, port) pairs: one per TCP connection
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def do_GET(self) -> None:  # a health check: the handler sees an empty body
                self.answer(*handle(self.path, {}))

            def do_POST(self) -> None:
                outer.connections.add(self.client_address)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                self.answer(*handle(self.path, body))

            def answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> JsonServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
