"""A prefill/decode proxy for two vLLM engines sharing lmkv's tiers (vLLM's toy-proxy pattern).

Each completion is sent to the prefill engine (``kv_role: kv_producer``) with ``max_tokens: 1``,
then to the decode engine (``kv_role: kv_consumer``) with the ``kv_transfer_params`` the prefill
engine returned: lmkv's word of how many pages it stored, which the decode engine waits for
(``pd.wait``) and loads instead of computing the prompt again.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Standard library only; one request at a time per connection, no streaming: an example, not a
production router (llm-d and Dynamo routers pass the params the same way).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def hand_off(prefill: str, decode: str, path: str, body: dict, timeout: float = 600) -> dict:
    """One request through both engines: the prefill engine's answer's params go to the decode engine."""
    first = _post(prefill + path, {**body, "max_tokens": 1, "stream": False,
                                   "kv_transfer_params": {"do_remote_decode": True}}, timeout)
    return _post(decode + path, {**body, "kv_transfer_params": first.get("kv_transfer_params")}, timeout)


def make_server(prefill: str, decode: str, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """The proxy's HTTP server (``serve_forever`` it); ``/v1/completions`` and ``/v1/chat/completions``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self.send_error(404)
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                out = json.dumps(hand_off(prefill, decode, self.path, body)).encode()
            except urllib.error.HTTPError as e:
                self.send_error(e.code, e.reason)
                return
            except (OSError, ValueError) as e:
                self.send_error(502, str(e))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, format: str, *args) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    ap.add_argument("--decode", required=True, help="the decode engine's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    make_server(args.prefill, args.decode, args.host, args.port).serve_forever()


if __name__ == "__main__":
    main()
