"""A tiny OpenAI-compatible chat server for tests (127.0.0.1 only, standard library + torch).

``POST /v1/chat/completions`` answers with a tiny random Qwen2 model (2 layers, hidden 32, a
256-entry byte vocabulary: token id = byte value) decoding greedily, or with canned content.
Failure modes are set as attributes, also while it runs: ``fail_first`` requests answered with
``fail_status``, responses delayed by ``delay_s`` (for the first ``delay_first`` requests, or
all), and an ``echo_auth`` switch that makes error bodies quote the Authorization header (to
check that clients redact it). Every request is recorded, and the peak number in flight is kept.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Union

MAX_NEW_TOKENS = 8
MAX_PROMPT_BYTES = 192


@dataclass
class RecordedRequest:
    """One request as the server saw it."""

    path: str
    headers: dict[str, str]
    body: Any


def chat_to_text(messages: list[dict[str, str]]) -> str:
    """The trivial chat template: ``role: content`` lines, then ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class TinyByteLM:
    """A random 2-layer Qwen2 over bytes, decoding greedily (deterministic for a given seed)."""

    def __init__(self, seed: int = 0):
        import torch
        import transformers

        cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=256, tie_word_embeddings=True,
                                       initializer_range=0.5)
        torch.manual_seed(seed)
        self._torch = torch
        self.model = transformers.Qwen2ForCausalLM(cfg).eval()
        self._lock = threading.Lock()

    def generate(self, prompt: str, max_new_tokens: int) -> tuple[str, int]:
        """Greedy continuation of ``prompt``: (text, number of tokens)."""
        torch = self._torch
        ids = list(prompt.encode("utf-8"))[-MAX_PROMPT_BYTES:] or [0]
        n = max(1, min(max_new_tokens, MAX_NEW_TOKENS))
        with self._lock, torch.no_grad():
            x = torch.tensor([ids])
            for _ in range(n):
                nxt = self.model(input_ids=x).logits[0, -1].argmax()
                x = torch.cat([x, nxt.view(1, 1)], dim=1)
        out = x[0, len(ids):].tolist()
        return bytes(out).decode("utf-8", errors="replace"), len(out)


class ChatServer:
    """A threaded chat-completions server on ``127.0.0.1`` and a free port.

    Args:
        canned: content to return instead of running the model: a string, or a function of the
            request body returning one.
        seed: seed of the tiny model (built on the first model request).

    Attributes:
        fail_first: answer the first this-many requests with ``fail_status``.
        fail_status: the failure status (500 by default).
        retry_after: if set, a ``Retry-After`` header (seconds) on failures.
        delay_s: sleep this long before answering.
        delay_first: delay only the first this-many requests (None: all).
        echo_auth: make error bodies quote the request's Authorization header.
        requests: every request received, in arrival order.
        max_in_flight: the peak number of requests being handled at once.
    """

    def __init__(self, canned: Union[None, str, Callable[[dict], str]] = None, seed: int = 0):
        self.canned = canned
        self.seed = seed
        self.fail_first = 0
        self.fail_status = 500
        self.retry_after: Optional[float] = None
        self.delay_s = 0.0
        self.delay_first: Optional[int] = None
        self.echo_auth = False
        self.requests: list[RecordedRequest] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._count = 0
        self._lm: Optional[TinyByteLM] = None
        self._lock = threading.Lock()
        self._httpd: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def lm(self) -> TinyByteLM:
        """The tiny model, built on first use."""
        with self._lock:
            if self._lm is None:
                self._lm = TinyByteLM(self.seed)
            return self._lm

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> ChatServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                server._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="chat-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _send(self, h: BaseHTTPRequestHandler, status: int, doc: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(doc).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("Content-Length", 0)))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        with self._lock:
            n = self._count
            self._count += 1
            self.requests.append(RecordedRequest(h.path, dict(h.headers.items()), body))
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            if self.delay_s and (self.delay_first is None or n < self.delay_first):
                time.sleep(self.delay_s)
            if h.path.rstrip("/") != "/v1/chat/completions":
                return self._send(h, 404, {"error": {"message": f"no route {h.path}"}})
            if n < self.fail_first:
                msg = f"injected failure {n + 1}/{self.fail_first}"
                if self.echo_auth:
                    msg += f"; you sent Authorization: {h.headers.get('Authorization')}"
                extra = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
                return self._send(h, self.fail_status, {"error": {"message": msg}}, extra)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                return self._send(h, 400, {"error": {"message": "body must be JSON with a messages list"}})
            max_tokens = int(body.get("max_tokens") or 16)
            if self.canned is not None:
                content = self.canned(body) if callable(self.canned) else self.canned
                n_tokens, finish = len(content.split()), "stop"
            else:
                content, n_tokens = self.lm.generate(chat_to_text(body["messages"]), max_tokens)
                finish = "length"
            self._send(h, 200, {
                "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", ""),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": 0, "completion_tokens": n_tokens, "total_tokens": n_tokens},
            })
        finally:
            with self._lock:
                self._in_flight -= 1
