"""The control plane's wake route as a stub meets it, standard library only (the runtime's tests run on Python 3.10
without the control plane): an HTTP server on a unix socket that records each ``POST`` and answers as told."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class WakeRoute(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Records each ask (its path, its JSON body, and ``note()`` at that moment); answers ``status`` with ``answer``
    after ``hang`` seconds. A context manager: serves in a thread until the block ends."""

    daemon_threads = True

    def __init__(self, path: Path | str, note: Callable[[], Any] = lambda: None) -> None:
        self.asks: list[tuple[str, dict[str, Any], Any]] = []
        self.status, self.answer, self.hang = 200, {"admitted": True, "why": None}, 0.0
        route = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                route.asks.append((self.path, body, note()))
                time.sleep(route.hang)
                raw = json.dumps(route.answer).encode()
                self.send_response(route.status)
                self.send_header("Content-Length", str(len(raw)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(raw)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(str(path), Handler)

    def __enter__(self) -> WakeRoute:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
