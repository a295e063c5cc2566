# SPDX-License-Identifier: Apache-2.0
"""A recording fake of a vLLM worker for kvplane-routerd's tests: answers
/v1/completions (and chat) with a small JSON body, /metrics and /v1/models;
keeps what it received in Fake.seen as (path, headers, body bytes), so a
test sees the exact bytes the router forwards."""
import http.server as hsrv
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testports import free_port  # noqa: E402


class Fake(hsrv.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen = []  # (path, headers, body bytes), shared by every fake worker

    def log_message(self, *a):
        pass

    def reply(self, code, body, ctype="application/json"):
        b = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        try:
            self.wfile.write(b)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router stopped reading (a capped reply)

    def do_GET(self):
        if self.path == "/metrics":
            self.reply(200, "vllm:num_requests_running 0\n", "text/plain")
        elif self.path == "/v1/models":
            self.reply(200, '{"object":"list","data":[{"id":"m"}]}')
        else:
            self.reply(404, "{}")

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(n)
        Fake.seen.append((self.path, dict(self.headers), body))
        self.reply(200, json.dumps({"id": "x", "object": "text_completion",
                                    "choices": [{"text": "ok", "index": 0}],
                                    "usage": {"prompt_tokens": 1}}))



def fake_worker(handler=Fake):
    """-> its base URL; serves on a daemon thread until the test exits"""
    port = free_port()
    srv = hsrv.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return "http://127.0.0.1:%d" % port
