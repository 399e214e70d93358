"""Dead and failing services: the assistant endpoint (negatives), the LLM judge (annotation) and
the SGLang rollout engine over HTTP, against real local HTTP servers that answer 500/503, close
connections without answering, or are not there at all.

Bounded retries with exponential backoff, then: assistant failures are masked and counted (or
stop the run naming the endpoint), judge failures drop and count rows (or stop before anything
is written), and a dead rollout engine is an error naming its URL.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from cooper_mcore.jobs.annotate import JudgeUnavailable, annotate
from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.negatives.assistant import LLMAssistant
from cooper_mcore.negatives.pairs import (
    AssistantUnavailable,
    build_pairs,
    check_negative_failures,
    pair_stats,
)
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.sglang_engine import SGLangEngine
from cooper_mcore.rollout.sglang_http import SGLangHTTPClient
from cooper_mcore.types import Prompt, RolloutGroup, Sample
from tests.chat_server import ChatServer

pytestmark = pytest.mark.timeout(120)


class AllWrong:
    """A verifier stand-in: every candidate is wrong (so every assistant answer is kept)."""

    def verify_batch(self, golds, preds):
        return [SimpleNamespace(correct=False) for _ in preds]


class DropServer:
    """Accepts TCP connections, reads a little and closes them without an answer."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.05)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            try:
                conn.recv(65536)
            except OSError:
                pass
            conn.close()

    def close(self):
        self._stop = True
        self.thread.join(timeout=2)
        self.sock.close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _groups(n):
    return [RolloutGroup(Prompt(id=f"p{i}", question=f"{i}+1=?", answer=str(i + 1)),
                         [Sample(prompt_id=f"p{i}", token_ids=[1], text=f"so \\boxed{{{i + 1}}}", rule_correct=True)])
            for i in range(n)]


def _client(url, retries=2, backoff=0.01, **kw):
    return OpenAIChatClient(url, "assistant", api_key_env=None, max_retries=retries, backoff_s=backoff, **kw)


# --------------------------------------------------------------------------- assistant


def test_failing_assistant_pairs_are_masked_and_counted():
    with ChatServer(canned="It is \\boxed{7}.") as server:
        server.fail_first = 3  # with one request at a time: the first prompt's 3 attempts all fail
        client = _client(server.url, retries=2, max_concurrency=1)
        gen = LLMAssistant(client, AllWrong())
        pairs = build_pairs(_groups(3), gen)
        assert len(server.requests) == 3 + 2  # 3 attempts for p0, then one each for p1, p2
        url = server.url
    assert [(p.prompt.id, p.rejected is not None, p.valid, p.failed) for p in pairs] == [
        ("p0", False, False, True), ("p1", True, True, False), ("p2", True, True, False)]
    assert pair_stats(pairs) == {"total": 3, "valid": 2, "no_positive": 0, "no_negative": 1, "failed": 1}
    assert gen.stats["failed_requests"] == 1 and client.stats["retries"] == 2
    assert check_negative_failures(pairs, "mask", url) == 1
    with pytest.raises(AssistantUnavailable, match=f"assistant endpoint {url} failed for 1 of 3 prompts"):
        check_negative_failures(pairs, "stop", url)


@pytest.mark.parametrize("kind", ["http500", "dropped", "dead"])
def test_unreachable_assistant_every_pair_masked_after_bounded_retries(kind):
    server = drop = None
    if kind == "http500":
        server = ChatServer(canned="x").start()
        server.fail_first = 10**6
        url = server.url
    elif kind == "dropped":
        drop = DropServer()
        url = drop.url
    else:
        url = _closed_port_url()
    try:
        client = _client(url, retries=2, backoff=0.05, timeout_s=2.0)
        t0 = time.monotonic()
        pairs = build_pairs(_groups(4), LLMAssistant(client, AllWrong()))
        elapsed = time.monotonic() - t0
        assert [p.failed for p in pairs] == [True] * 4 and not any(p.valid for p in pairs)
        assert client.stats["requests"] == 4 and client.stats["failed"] == 4 and client.stats["retries"] == 8
        # backoff 0.05 s then 0.1 s (each up to 25% longer), requests concurrent: bounded, no hang (the
        # bound is loose: a loaded 2-core CI machine was seen at 14 s; a hang would be the 2 s timeouts x 12)
        assert 0.15 <= elapsed < 60.0
        if server is not None:
            assert len(server.requests) == 4 * 3
        if drop is not None:
            assert drop.connections == 4 * 3
        with pytest.raises(AssistantUnavailable, match=f"{url} failed for 4 of 4"):
            check_negative_failures(pairs, "stop", url)
    finally:
        if server is not None:
            server.stop()
        if drop is not None:
            drop.close()


def test_backoff_is_exponential():
    with ChatServer(canned="x") as server:
        server.fail_first = 3
        client = _client(server.url, retries=3, backoff=0.2)
        t0 = time.monotonic()
        assert client.chat([{"role": "user", "content": "hi"}]) == "x"
        elapsed = time.monotonic() - t0
    # waits 0.2, 0.4, 0.8 s (x1 to x1.25 jitter) before attempts 2, 3, 4
    assert 1.4 <= elapsed < 1.75 + 1.0, elapsed


def test_on_failure_setting_is_checked():
    with pytest.raises(ValueError, match="'mask' or 'stop'"):
        check_negative_failures([], "retry", "http://x")


# --------------------------------------------------------------------------- LLM judge


def _triples(path, n=3):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"{i}+1?", "reference": str(i + 1), "completion": str(i + 1)}) + "\n")
    return str(path)


class AllRight:
    def verify_batch(self, golds, preds):
        return [SimpleNamespace(correct=True) for _ in preds]


def test_failing_judge_masks_rows_or_stops_naming_the_endpoint(tmp_path):
    inp = _triples(tmp_path / "in.jsonl")
    with ChatServer(canned="yes") as server:
        server.fail_first = 3  # the first row's request, attempts 1-3, one request at a time
        client = _client(server.url, retries=2, max_concurrency=1)
        stats = annotate(inp, str(tmp_path / "masked.jsonl"), client, AllRight())
        assert stats["judge_failed"] == 1 and stats["kept"] == 2 and stats["rows"] == 3
        kept = [json.loads(line) for line in open(tmp_path / "masked.jsonl")]
        assert [r["question"] for r in kept] == ["1+1?", "2+1?"] and all(r["label"] is True for r in kept)

        server.fail_first = 10**6
        out = tmp_path / "stopped.jsonl"
        with pytest.raises(JudgeUnavailable, match=f"LLM judge at {server.url}/v1/chat/completions failed for 3 of 3"):
            annotate(inp, str(out), client, AllRight(), on_judge_failure="stop")
        assert not out.exists()
    with pytest.raises(ValueError, match="on_judge_failure"):
        annotate(inp, str(tmp_path / "x.jsonl"), client, AllRight(), on_judge_failure="skip")


def test_dead_judge_with_mask_is_an_error_naming_the_endpoint(tmp_path):
    # every request failed: not an empty output with exit 0, an error naming the judge; nothing written
    inp = _triples(tmp_path / "in.jsonl", n=2)
    client = _client(_closed_port_url(), retries=1)
    out = tmp_path / "out.jsonl"
    with pytest.raises(JudgeUnavailable, match=rf"judge at {client.url} \(model 'assistant'\) gave no answer with "
                                               r"text for any of the 2 rows \(2 requests failed"):
        annotate(inp, str(out), client, AllRight())
    assert not out.exists()


# --------------------------------------------------------------------------- rollout engine (SGLang HTTP)


class FlakySGLang:
    """/generate answers ``fail_status`` for the first ``fail_first`` requests, then one result per prompt."""

    def __init__(self, fail_first=0, fail_status=503):
        self.fail_first, self.fail_status, self.calls = fail_first, fail_status, 0
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                flaky.calls += 1
                if flaky.calls <= flaky.fail_first:
                    status, doc = flaky.fail_status, {"detail": "overloaded"}
                else:
                    n = len(body.get("text") or body.get("input_ids"))
                    status = 200
                    doc = [{"text": "4", "output_ids": [7],
                            "meta_info": {"id": str(i), "finish_reason": {"type": "length"}}} for i in range(n)]
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _engine(url, retries=2):
    return SGLangEngine(client=SGLangHTTPClient(url, max_retries=retries, backoff_s=0.02, connect_timeout_s=1),
                        tp_size=1)


def test_engine_503s_are_retried_then_generation_succeeds():
    fake = FlakySGLang(fail_first=2)
    try:
        outs = _engine(fake.url).generate(["2+2="], SamplingParams(logprobs=False))
        assert [o.token_ids for o in outs] == [[7]] and fake.calls == 3
    finally:
        fake.close()


@pytest.mark.parametrize("status", [500, 503])
def test_failing_engine_stops_with_its_url_after_retries(status):
    fake = FlakySGLang(fail_first=10**6, fail_status=status)
    try:
        with pytest.raises(RuntimeError, match=f"SGLang server {fake.url}: generate .*HTTP {status} after 3 attempt"):
            _engine(fake.url).generate(["2+2="], SamplingParams(logprobs=False))
        assert fake.calls == 3
    finally:
        fake.close()


def test_engine_that_drops_connections_stops_with_its_url():
    drop = DropServer()
    try:
        with pytest.raises(ConnectionError, match=f"SGLang server {drop.url}: generate .*3 attempt"):
            _engine(drop.url).generate(["2+2="], SamplingParams(logprobs=False))
        assert drop.connections == 3
    finally:
        drop.close()


def test_weight_updates_are_not_resent_on_a_server_error():
    fake = FlakySGLang(fail_first=10**6, fail_status=503)
    try:
        client = SGLangHTTPClient(fake.url, max_retries=3, backoff_s=0.01)
        with pytest.raises(RuntimeError, match="HTTP 503: "):
            client.request("POST", "/update_weights_from_tensor", "update_weights_from_tensor", {})
        assert fake.calls == 1
    finally:
        fake.close()
