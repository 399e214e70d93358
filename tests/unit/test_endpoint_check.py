"""check_endpoint: one start-up request to an OpenAI-compatible server, against real local servers
(tests/chat_server.py, which has no model list, and a server with ``GET /v1/models``), a dead port,
a server that does not answer in time, one that fails, and one that rejects the key."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cooper_mcore.llm_client import check_endpoint, models_url
from tests.chat_server import ChatServer

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-test-SECRET-0123456789abcdef"


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class ModelListServer:
    """Answers ``GET /v1/models`` with the given ids (or the given status); records the paths."""

    def __init__(self, ids: list[str], status: int = 200):
        self.ids, self.status, self.paths = ids, status, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                owner.paths.append(self.path)
                body = json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in owner.ids]})
                if owner.status != 200:
                    body = json.dumps({"error": f"you sent {self.headers.get('Authorization')}"})
                data = body.encode()
                self.send_response(owner.status if self.path == "/v1/models" else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> ModelListServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def test_models_url():
    assert models_url("http://h:1") == "http://h:1/v1/models"
    assert models_url("https://api.example.com/v1/") == "https://api.example.com/v1/models"
    assert models_url("http://h:1/v1/chat/completions") == "http://h:1/v1/models"
    with pytest.raises(ValueError, match="http"):
        models_url("127.0.0.1:30010")


def test_server_without_model_list_is_asked_for_one_token():
    with ChatServer(canned="OK") as server:
        assert check_endpoint(server.url, "Qwen2.5-7B-Instruct", api_key_env=None) == "chat"
        (req,) = server.requests  # GET /v1/models got 501 (not recorded), then one chat request
        assert req.path == "/v1/chat/completions"
        assert (req.body["model"], req.body["max_tokens"]) == ("Qwen2.5-7B-Instruct", 1)


def test_model_list_must_name_the_model():
    with ModelListServer(["Qwen2.5-7B-Instruct"]) as server:
        assert check_endpoint(server.url, "Qwen2.5-7B-Instruct", api_key_env=None) == "models"
        with pytest.raises(ValueError, match=r"serves \['Qwen2.5-7B-Instruct'\], not model 'Llama'") as e:
            check_endpoint(server.url + "/v1", "Llama", api_key_env=None)
        assert f"{server.url}/v1/models" in str(e.value) and "--served-model-name" in str(e.value)
        assert server.paths == ["/v1/models", "/v1/models"]


def test_dead_port_names_the_url_and_the_hint():
    url = _closed_port_url()
    with pytest.raises(ValueError) as e:
        check_endpoint(url, "m", api_key_env=None, timeout_s=2, hint="Set rm.assistant_url.")
    msg = str(e.value)
    assert f"{url}/v1/models does not answer (no connection: Connection refused)" in msg
    assert msg.endswith("Set rm.assistant_url.")


def test_no_answer_within_the_timeout():
    with ChatServer(canned="OK") as server:
        server.delay_s = 3.0
        with pytest.raises(ValueError, match=r"does not answer \(no answer within 0.5 s\)"):
            check_endpoint(server.url, "m", api_key_env=None, timeout_s=0.5)


def test_a_failing_server_is_not_retried():
    with ChatServer(canned="OK") as server:
        server.fail_first, server.fail_status = 5, 503
        with pytest.raises(ValueError, match="1-token chat completion for model 'm' .* failed with HTTP 503"):
            check_endpoint(server.url, "m", api_key_env=None)
        assert len(server.requests) == 1


def test_a_rejected_key_is_named_but_not_shown(monkeypatch):
    monkeypatch.setenv("COOPER_TEST_KEY", SECRET)
    with ModelListServer([], status=401) as server:
        with pytest.raises(ValueError, match=r"HTTP 401\): check the API key in \$COOPER_TEST_KEY") as e:
            check_endpoint(server.url, "m", api_key_env="COOPER_TEST_KEY")
    assert SECRET not in str(e.value)
