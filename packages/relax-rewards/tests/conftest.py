"""A real HTTP server on 127.0.0.1 for the remote and genrm tests (stdlib ``http.server``); the reward
registry restored after a test that registers."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_rewards import REWARDS


class FakeServer:
    """Routes ``path -> handler(body) -> (status, reply)``; records every request it saw."""

    def __init__(self):
        self.routes = {}
        self.requests = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                server.requests.append((self.path, body, dict(self.headers)))
                handler = server.routes.get(self.path)
                status, reply = handler(body) if handler else (404, {"error": "no route"})
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def clean_registry():
    """The registry as it was before the test, whatever the test registered."""
    saved = dict(REWARDS)
    yield
    REWARDS.clear()
    REWARDS.update(saved)
