"""A TLS reverse proxy on loopback that records the headers of every request it forwards, as a
gateway in front of Thanos or Mimir sees them (Prometheus ignores headers it does not know, so
only something in between can tell that a header arrived). It forwards each GET to `upstream`
with the same headers and hands back the upstream's status and body, refusals included."""

from __future__ import annotations

import ssl
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

HOP_BY_HOP = frozenset({"host", "connection", "keep-alive", "accept-encoding", "content-length"})


class HeaderProxy:
    """Serves https://127.0.0.1:port with `cert`/`key`; `seen` holds each request's headers
    (names in lower case) in the order they came."""

    def __init__(self, upstream: str, cert: Path, key: Path, upstream_trust: ssl.SSLContext):
        self.seen: list[dict[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                proxy.seen.append(headers)
                request = urllib.request.Request(upstream + self.path)
                for name, value in headers.items():
                    if name not in HOP_BY_HOP:
                        request.add_header(name, value)
                try:
                    with urllib.request.urlopen(
                        request, timeout=30, context=upstream_trust
                    ) as answer:
                        code, body = answer.status, answer.read()
                except urllib.error.HTTPError as exc:
                    code, body = exc.code, exc.read()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        serving.load_cert_chain(cert, key)
        self._server.socket = serving.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HeaderProxy:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
