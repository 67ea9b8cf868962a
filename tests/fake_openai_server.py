"""A stand-in OpenAI-compatible streaming server for the --serve-load
harness tests: GET /health, streamed POST /v1/completions and
/v1/chat/completions sending `max_tokens` chunks of one word each (" tok"),
then a usage chunk and [DONE]. A chat request with "stream" false gets one
response with llama-server's `timings` (predicted_n = max_tokens,
predicted_ms = 2 per token): `{"ok": true}` and finish_reason "stop" when it
asks for a `response_format`, else `max_tokens` words and "length".

    python tests/fake_openai_server.py --port PORT
"""

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b'{"status": "ok"}' if self.path == "/health" else b'{"error": "not found"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        if chat and not req.get("stream"):
            return self._whole(req)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = int(req["max_tokens"])
        for i in range(n):
            piece = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            piece["finish_reason"] = "length" if i == n - 1 else None
            self.wfile.write(f"data: {json.dumps({'choices': [piece]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        usage = {"choices": [], "usage": {"completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True

    def _whole(self, req):
        n = int(req["max_tokens"])
        constrained = "response_format" in req
        message = {"role": "assistant", "content": '{"ok": true}' if constrained else " tok" * n}
        body = json.dumps({"choices": [{"message": message, "finish_reason": "stop" if constrained
                                        else "length"}],
                           "timings": {"predicted_n": n, "predicted_ms": 2.0 * n}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    ThreadingHTTPServer(("127.0.0.1", p.parse_args().port), Handler).serve_forever()
