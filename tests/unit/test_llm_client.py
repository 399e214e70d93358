"""OpenAIChatClient against a real local HTTP server (tests/chat_server.py): a round trip through a
tiny model, retries, timeouts, a dead port, the concurrency bound and API-key handling."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from cooper_mcore.llm_client import ChatRequestError, OpenAIChatClient, chat_completions_url
from tests.chat_server import ChatServer, chat_to_text

pytestmark = pytest.mark.timeout(60)

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
SECRET = "sk-test-SECRET-0123456789abcdef"


@pytest.fixture
def server():
    with ChatServer(canned="ok") as s:
        yield s


def _client(url: str, **kw) -> OpenAIChatClient:
    kw.setdefault("api_key_env", None)
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 10)
    return OpenAIChatClient(url, "tiny", **kw)


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("base", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/",
                                  "http://h:1/v1/chat/completions"])
def test_url_forms(base):
    assert chat_completions_url(base) == "http://h:1/v1/chat/completions"


@pytest.mark.parametrize("kw", [dict(base_url="127.0.0.1:8000"), dict(base_url=""), dict(model=""),
                                dict(max_concurrency=0), dict(max_retries=-1), dict(timeout_s=0),
                                dict(backoff_s=-1.0)])
def test_invalid_arguments(kw):
    args = dict(base_url="http://127.0.0.1:1", model="m", api_key_env=None) | kw
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        OpenAIChatClient(**args)


def test_round_trip_through_tiny_model():
    with ChatServer(seed=3) as srv:
        with _client(srv.url + "/v1/") as client:
            text = client.chat(MSGS, temperature=0.0, max_tokens=5)
            again = client.chat_batch([MSGS, MSGS], temperature=0.0, max_tokens=5)
        expected, n = srv.lm.generate(chat_to_text(MSGS), 5)
    assert n == 5 and text == expected
    assert again == [expected, expected]
    assert [r.path for r in srv.requests] == ["/v1/chat/completions"] * 3
    body = srv.requests[0].body
    assert body["model"] == "tiny" and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["messages"] == MSGS
    # a different prompt goes through the model too (not a constant answer)
    assert srv.lm.generate(chat_to_text([{"role": "user", "content": "zzz"}]), 5)[0] != expected


def test_retries_after_server_errors(server):
    server.fail_first = 2
    with _client(server.url, max_retries=3) as client:
        assert client.chat(MSGS) == "ok"
        stats = client.stats
    assert len(server.requests) == 3
    assert stats["retries"] == 2 and stats["http_errors"] == 2 and stats["succeeded"] == 1 and stats["failed"] == 0


def test_429_retried_and_retry_after_honoured(server):
    server.fail_first, server.fail_status, server.retry_after = 1, 429, 0.4
    t0 = time.monotonic()
    with _client(server.url, max_retries=1) as client:
        assert client.chat(MSGS) == "ok"
    assert time.monotonic() - t0 >= 0.4
    assert len(server.requests) == 2


def test_exhausted_retries_raise_with_url_and_cause(server):
    server.fail_first = 100
    with _client(server.url, max_retries=2) as client, pytest.raises(ChatRequestError) as ei:
        client.chat(MSGS)
    err = ei.value
    assert server.url + "/v1/chat/completions" in str(err) and "HTTP 500" in str(err) and "3 attempt" in str(err)
    assert err.status == 500 and err.attempts == 3
    assert len(server.requests) == 3


@pytest.mark.parametrize("status", [400, 401, 404])
def test_client_errors_not_retried(server, status):
    server.fail_first, server.fail_status = 100, status
    with _client(server.url, max_retries=3) as client, pytest.raises(ChatRequestError, match="not retried") as ei:
        client.chat(MSGS)
    assert ei.value.status == status and len(server.requests) == 1


def test_timeout_retried_then_succeeds(server):
    server.delay_s, server.delay_first = 1.5, 1
    with _client(server.url, timeout_s=0.3, max_retries=2) as client:
        assert client.chat(MSGS) == "ok"
        assert client.stats["timeouts"] == 1 and client.stats["retries"] == 1


def test_timeouts_exhausted(server):
    server.delay_s = 1.5
    with _client(server.url, timeout_s=0.2, max_retries=1) as client:
        t0 = time.monotonic()
        with pytest.raises(ChatRequestError, match="timed out") as ei:
            client.chat(MSGS)
        assert server.url in str(ei.value) and ei.value.status is None
        assert client.chat_batch([MSGS]) == [None]
        assert time.monotonic() - t0 < 1.5 + 0.5  # four attempts of ~0.2 s, not four of 1.5 s
        assert client.stats["failed"] == 2 and client.stats["timeouts"] == 4


def test_dead_server_clear_error_in_bounded_time():
    url = _closed_port_url()
    t0 = time.monotonic()
    with _client(url, max_retries=2, backoff_s=0.05, timeout_s=2) as client:
        with pytest.raises(ChatRequestError) as ei:
            client.chat(MSGS)
        assert client.stats["connection_errors"] == 3
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert f"{url}/v1/chat/completions" in msg and "after 3 attempt" in msg and "ConnectionError" in msg


@pytest.mark.parametrize("bound", [3, 9])
def test_concurrency_bound(server, bound):
    server.delay_s = 0.25
    t0 = time.monotonic()
    with _client(server.url, max_concurrency=bound) as client:
        assert client.chat_batch([MSGS] * 9) == ["ok"] * 9
    elapsed = time.monotonic() - t0
    assert server.max_in_flight <= bound
    if bound == 3:
        assert elapsed >= 3 * 0.25 and server.max_in_flight >= 2
    else:
        assert server.max_in_flight > 3  # the bound above is the client's, not the server's


def test_batch_failed_items_are_none_and_counted(server):
    server.fail_first = 2
    with _client(server.url, max_retries=0, max_concurrency=1) as client:
        out = client.chat_batch([MSGS] * 4, max_tokens=[3, 4, 5, 6])
        assert out == [None, None, "ok", "ok"]
        assert client.stats["failed"] == 2 and client.stats["succeeded"] == 2
    assert [r.body["max_tokens"] for r in server.requests] == [3, 4, 5, 6]


def test_batch_argument_checks(server):
    with _client(server.url) as client:
        with pytest.raises(ValueError, match="max_tokens"):
            client.chat_batch([MSGS, MSGS], max_tokens=[5])
        with pytest.raises(ValueError, match="messages"):
            client.chat_batch([[{"text": "x"}]])
        assert client.chat_batch([]) == []
    with pytest.raises(RuntimeError, match="closed"):
        client.chat_batch([MSGS])
    assert server.requests == []


def test_api_key_sent_as_bearer_and_never_leaked(server, monkeypatch, caplog):
    monkeypatch.setenv("COOPER_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG, logger="cooper_mcore")
    with _client(server.url, api_key_env="COOPER_TEST_KEY", max_retries=1) as client:
        assert client.chat(MSGS) == "ok"
        assert server.requests[-1].headers["Authorization"] == f"Bearer {SECRET}"
        errors = []
        server.echo_auth = True
        for status in (401, 500):  # not retried, and retried then given up
            server.fail_first, server.fail_status = 10**6, status
            with pytest.raises(ChatRequestError) as ei:
                client.chat(MSGS)
            errors += [str(ei.value), repr(ei.value)]
            assert "Bearer ***" in str(ei.value)  # the server did echo it; the client redacted it
        assert client.chat_batch([MSGS]) == [None]
        errors.append(repr(client))
    assert all(SECRET not in e for e in errors)
    assert caplog.records and SECRET not in caplog.text


def test_no_key_no_authorization_header(server, monkeypatch):
    monkeypatch.delenv("COOPER_ABSENT_KEY", raising=False)
    with _client(server.url, api_key_env="COOPER_ABSENT_KEY") as client:
        assert client.chat(MSGS) == "ok"
    assert "Authorization" not in server.requests[0].headers


def test_extra_body_merged(server):
    with _client(server.url, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) as client:
        client.chat(MSGS, temperature=0.7, max_tokens=7)
    body = server.requests[0].body
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["max_tokens"] == 7
