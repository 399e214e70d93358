"""A stand-in for the assistant LLM in a rehearsal: an OpenAI-compatible server on 127.0.0.1.

It answers the trainer's rewrite requests (:func:`cooper_mcore.negatives.assistant.rewrite_messages`) as
an instruct model would, with the mix of outcomes a real one produces, so that every branch of the
negatives' path runs: a convincing wrong rewrite (the final answer changed), a rewrite that is still
correct (rejected by the rule verifier and asked again), an unparseable answer (no final answer at
all), and a slow answer (the client waits). The outcome is a hash of the request's content, not of
its arrival order: an interrupted run and its resume see the same answers as an uninterrupted run,
which the rehearsal's resume check needs. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from cooper_mcore.negatives.rewrites import final_answer_span

logger = logging.getLogger(__name__)

Outcome = Literal["wrong", "still_correct", "unparseable", "slow"]
#: how often each outcome comes, out of 20 (a real assistant's rewrites are mostly usable)
OUTCOME_WEIGHTS: tuple[tuple[Outcome, int], ...] = (("wrong", 11), ("still_correct", 4), ("unparseable", 3),
                                                    ("slow", 2))
SLOW_S = 1.0
_SOLUTION_MARK = "\nCorrect response:\n"
_SOLUTION_MARK_GOLD = "\nCorrect solution:\n"


def outcome_of(text: str) -> Outcome:
    """The outcome for a request whose user message is ``text`` (a stable hash, see the module doc)."""
    roll = int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % sum(w for _, w in OUTCOME_WEIGHTS)
    for outcome, weight in OUTCOME_WEIGHTS:
        if roll < weight:
            return outcome
        roll -= weight
    raise AssertionError("unreachable")


def solution_in(text: str) -> str:
    """The correct solution quoted in a rewrite request (empty when it quotes none)."""
    for mark in (_SOLUTION_MARK, _SOLUTION_MARK_GOLD):
        if mark in text:
            return text.split(mark, 1)[1].strip()
    return ""


def wrong_rewrite(solution: str) -> str:
    """``solution`` with its final answer changed to another integer (or a wrong answer appended)."""
    span = final_answer_span(solution)
    if span is None:
        return solution + "\nSo the answer is \\boxed{-1}."
    start, end = span
    try:
        wrong = str(int(float(solution[start:end])) + 1)
    except ValueError:
        wrong = "-1"
    return solution[:start] + wrong + solution[end:]


def answer(text: str) -> tuple[Outcome, str]:
    """The stand-in's reply to a request whose user message is ``text``."""
    outcome = outcome_of(text)
    solution = solution_in(text)
    if outcome == "still_correct":
        return outcome, solution
    if outcome == "unparseable":
        return outcome, "I would rather not write a wrong solution."
    return outcome, wrong_rewrite(solution)


class _Server(ThreadingHTTPServer):
    """The HTTP server; with ``reuse_port`` several processes may listen on one port (``SO_REUSEPORT``: the
    kernel spreads the connections over them), as the servers of two "nodes" on one machine do."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], reuse_port: bool) -> None:
        self.reuse_port = reuse_port
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class StandInAssistant:
    """The server, in a thread of the calling process; use as a context manager.

    Args:
        model: the model name it serves (the preset's ``rm.assistant_model``).
        slow_s: how long a "slow" answer waits.
        port: its port on 127.0.0.1 (0: a free one).
        reuse_port: share ``port`` with other servers (``SO_REUSEPORT``): a multi-node test runs one per
            "node" on one machine, where each real node serves its own at the same address.

    Attributes:
        url: its base URL once started.
        counts: answers given per outcome.
    """

    def __init__(self, model: str, slow_s: float = SLOW_S, port: int = 0, reuse_port: bool = False) -> None:
        self.model = model or "assistant"
        self.slow_s = slow_s
        self.counts: dict[str, int] = {o: 0 for o, _ in OUTCOME_WEIGHTS}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", port), self._handler(), reuse_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="stand-in-assistant", daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> StandInAssistant:
        self._thread.start()
        logger.info("stand-in assistant serving %r at %s", self.model, self.url)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _reply(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        user = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
        outcome, content = answer(user)
        with self._lock:
            self.counts[outcome] += 1
        if outcome == "slow":
            time.sleep(self.slow_s)
        return {"id": "stand-in", "object": "chat.completion", "model": self.model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": len(user.split()), "completion_tokens": len(content.split())}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - the http.server interface
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                elif self.path.rstrip("/") == "/health":  # what a launcher waits for (SGLang's route)
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                except json.JSONDecodeError as e:
                    self._send(400, {"error": {"message": f"bad JSON: {e}"}})
                    return
                self._send(200, server._reply(body))

            def log_message(self, *args: Any) -> None:  # quiet: the rehearsal reports the counts
                return

        return Handler
