"""A stand-in Kiln server for client tests: a real HTTP server process on loopback.

    python tests/kiln_fake_server.py --port 0 --fixture scenarios.json

prints the port number it listens on as its first stdout line, once it is listening. The fixture maps a scenario name
to a list of responses; ``GET /<scenario>/v1/teachers`` returns them in turn (the last one repeats),
so one process serves every test and the client's base URL picks the scenario. Each response is
``{"status": 200, "json": {...}}`` or ``{"status": 500, "text": "..."}``, optionally with
``"delay_s"`` (sleep before answering) and ``"require_bearer"`` (answer 401 unless
``Authorization: Bearer <value>`` is sent). ``GET /<scenario>/__hits`` returns the number of
``/v1/teachers`` requests that scenario has seen, so tests can count retries.

Only the standard library is used, so the process starts in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    scenarios: dict[str, list[dict]] = {}
    hits: dict[str, int] = {}
    lock = threading.Lock()
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # keep test output clean

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        parts = self.path.strip("/").split("/", 1)
        name, rest = parts[0], (parts[1] if len(parts) > 1 else "")
        if name not in self.scenarios:
            self._send(404, b'{"error":"no such scenario"}')
            return
        if rest == "__hits":
            with self.lock:
                self._send(200, json.dumps({"hits": self.hits.get(name, 0)}).encode())
            return
        if rest != "v1/teachers":
            self._send(404, b'{"error":{"code":"not_found","message":"unknown route"}}')
            return
        with self.lock:
            index = self.hits.get(name, 0)
            self.hits[name] = index + 1
        responses = self.scenarios[name]
        response = responses[min(index, len(responses) - 1)]
        if response.get("delay_s"):
            time.sleep(float(response["delay_s"]))
        required = response.get("require_bearer")
        if required is not None and self.headers.get("Authorization") != f"Bearer {required}":
            self._send(401, b'{"error":{"code":"unauthorized","message":"missing or wrong bearer token"}}')
            return
        if "json" in response:
            # ensure_ascii=True on purpose: the client must decode escapes back to the exact string.
            body = json.dumps(response["json"], ensure_ascii=True).encode("ascii")
            content_type = "application/json"
        else:
            body = response.get("text", "").encode("utf-8")
            content_type = "text/plain; charset=utf-8"
        try:
            self._send(int(response.get("status", 200)), body, content_type)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and left; that is the point of a delayed response


def main(argv: list[str] | None = None) -> int:
    """Serve the fixture until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fixture", required=True)
    args = parser.parse_args(argv)
    with open(args.fixture, encoding="utf-8") as handle:
        _Handler.scenarios = json.load(handle)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
