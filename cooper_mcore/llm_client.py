"""A small client for OpenAI-compatible chat-completions servers (OpenAI, SGLang, vLLM).

A generic client with no knowledge of the trainer: it asks the assistant LLM for the reward model's
negatives (:mod:`cooper_mcore.negatives`) and the LLM judge of the annotation job
(:mod:`cooper_mcore.jobs.annotate`), and checks endpoints for the launchers. It posts
``{base_url}/v1/chat/completions`` with :mod:`requests`, one session per worker thread, retries
transient failures (connection errors, timeouts, HTTP 429 and 5xx) with exponential backoff, and
runs batches concurrently under a bound on in-flight requests.

The API key is read from an environment variable (``OPENAI_API_KEY`` unless told otherwise), sent
as ``Authorization: Bearer ...`` and never written to logs, exceptions or ``repr``.

:func:`check_endpoint` (or :meth:`OpenAIChatClient.check_ready`) asks a server once, with a short
timeout and no retries, whether it answers and serves the model, so that a run can refuse to start
instead of masking every request's failure later.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import requests

logger = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, str]]
"""A chat: ``[{"role": "system" | "user" | "assistant", "content": "..."}, ...]``."""

_MAX_BACKOFF_S = 60.0
_BODY_SNIPPET = 300
_BEARER = re.compile(r"(Bearer\s+)\S+", re.IGNORECASE)


class ChatRequestError(RuntimeError):
    """A chat request failed for good: retries exhausted, or a non-retryable answer.

    Attributes:
        url: the endpoint that was called.
        status: the last HTTP status, None if no response came back.
        attempts: how many attempts were made.
    """

    def __init__(self, message: str, url: str, status: Optional[int] = None, attempts: int = 0):
        super().__init__(message)
        self.url = url
        self.status = status
        self.attempts = attempts


def chat_completions_url(base_url: str) -> str:
    """The chat-completions endpoint of a server.

    Accepts ``http://host:port``, ``http://host:port/v1`` or the full endpoint, with or without a
    trailing slash.

    Args:
        base_url: the server's base URL.

    Returns:
        ``.../v1/chat/completions``.

    Raises:
        ValueError: if ``base_url`` is not an http(s) URL.
    """
    if not isinstance(base_url, str) or not re.match(r"^https?://[^/\s]+", base_url):
        raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:30000, got {base_url!r}")
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


def models_url(base_url: str) -> str:
    """The model-list endpoint (``.../v1/models``) of the server behind ``base_url``.

    Raises:
        ValueError: if ``base_url`` is not an http(s) URL.
    """
    return chat_completions_url(base_url)[: -len("/chat/completions")] + "/models"


def check_endpoint(base_url: str, model: str, api_key_env: Optional[str] = "OPENAI_API_KEY",
                   timeout_s: float = 10.0, hint: str = "") -> str:
    """Check once that an OpenAI-compatible server answers at ``base_url`` and serves ``model``.

    See :meth:`OpenAIChatClient.check_ready` (this builds a client and calls it).

    Returns:
        ``"models"`` or ``"chat"``: how the server was checked.

    Raises:
        ValueError: the server does not answer, rejects the key, or does not serve ``model``; the
            message names the URL, the cause and what to do (``hint`` is appended).
    """
    with OpenAIChatClient(base_url, model, api_key_env=api_key_env, timeout_s=timeout_s, max_retries=0) as client:
        return client.check_ready(timeout_s=timeout_s, hint=hint)


def _retry_after_s(resp: requests.Response) -> Optional[float]:
    """The server's ``Retry-After`` in seconds, if given as a number."""
    value = resp.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _cause(e: requests.RequestException, timeout_s: float) -> str:
    """A short reason for a failed request: requests' messages nest urllib3's."""
    if isinstance(e, requests.Timeout):
        return f"no answer within {timeout_s:g} s"
    if isinstance(e, requests.ConnectionError):
        errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(e))
        return f"no connection: {errno.group(1)}" if errno else "no connection"
    return f"{type(e).__name__}: {e}"


def _model_ids(resp: requests.Response) -> Optional[set[str]]:
    """The ids of an OpenAI model list (``{"data": [{"id": ...}, ...]}``); None if it is not one."""
    try:
        data = resp.json()["data"]
        ids = {m["id"] for m in data}
    except (ValueError, KeyError, TypeError):
        return None
    return ids if all(isinstance(i, str) for i in ids) else None


class OpenAIChatClient:
    """Chat completions against an OpenAI-compatible server, with retries and bounded concurrency.

    Args:
        base_url: server URL, e.g. ``http://127.0.0.1:30000`` or ``https://api.openai.com/v1``.
        model: the model name sent in each request.
        api_key_env: name of the environment variable holding the API key; None or an unset
            variable sends no ``Authorization`` header (local SGLang/vLLM servers need none).
        timeout_s: per-attempt timeout (connect and between bytes read), in seconds.
        max_retries: retries after the first attempt (so at most ``max_retries + 1`` attempts).
        backoff_s: the first retry waits this long; each further retry doubles it (capped at 60 s,
            with up to 25% jitter; a numeric ``Retry-After`` from the server is honoured).
        max_concurrency: most requests in flight at once from this client (all threads together).
        extra_body: extra fields merged into every request body, e.g.
            ``{"chat_template_kwargs": {"enable_thinking": False}}``.

    Raises:
        ValueError: for an invalid argument (named in the message).
    """

    def __init__(self, base_url: str, model: str, api_key_env: Optional[str] = "OPENAI_API_KEY",
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 1.0,
                 max_concurrency: int = 64, extra_body: Optional[Mapping[str, Any]] = None):
        self.url = chat_completions_url(base_url)
        if not model or not isinstance(model, str):
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if int(max_retries) != max_retries or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries}")
        if not backoff_s >= 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        if int(max_concurrency) != max_concurrency or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency}")
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_concurrency = int(max_concurrency)
        self.extra_body = dict(extra_body or {})
        self._api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self._api_key:
            logger.info("environment variable %s is not set; sending requests without an API key", api_key_env)
        self._headers = {"Content-Type": "application/json"}
        if self._api_key:
            self._headers["Authorization"] = f"Bearer {self._api_key}"
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sessions: list[requests.Session] = []
        self._executor: Optional[ThreadPoolExecutor] = None
        self._closed = False
        self._stats = dict.fromkeys(("requests", "succeeded", "failed", "retries", "timeouts",
                                     "connection_errors", "http_errors"), 0)

    def __repr__(self) -> str:
        key = f"${self.api_key_env} set" if self._api_key else "no key"
        return (f"OpenAIChatClient(url={self.url!r}, model={self.model!r}, {key}, timeout_s={self.timeout_s}, "
                f"max_retries={self.max_retries}, max_concurrency={self.max_concurrency})")

    def __enter__(self) -> OpenAIChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction (or :meth:`reset_stats`): requests, succeeded, failed,
        retries, timeouts, connection_errors, http_errors (the last three count attempts)."""
        with self._lock:
            return dict(self._stats)

    def reset_stats(self) -> None:
        """Zero the counters."""
        with self._lock:
            for k in self._stats:
                self._stats[k] = 0

    def close(self) -> None:
        """Stop the worker threads and close the HTTP sessions. Idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            sessions, self._sessions = self._sessions, []
        if executor is not None:
            executor.shutdown(wait=True)
        for s in sessions:
            s.close()

    def chat(self, messages: Messages, temperature: float = 0.7, max_tokens: int = 512) -> str:
        """One chat completion.

        Args:
            messages: the chat, OpenAI style.
            temperature: sampling temperature.
            max_tokens: completion length limit.

        Returns:
            The assistant message's content.

        Raises:
            ValueError: for malformed arguments.
            ChatRequestError: when the request failed after retries, or at once on a
                non-retryable answer (HTTP 4xx other than 429, or a malformed response body).
        """
        payload = self._payload(messages, temperature, max_tokens)
        self._count("requests")
        try:
            text = self._request(payload)
        except ChatRequestError:
            self._count("failed")
            raise
        self._count("succeeded")
        return text

    def check_ready(self, timeout_s: float = 10.0, hint: str = "") -> str:
        """Ask the server once (no retries) whether it answers and serves :attr:`model`.

        ``GET .../v1/models`` first: if it lists model ids, :attr:`model` must be one of them.
        A server without that route (HTTP 404, 405 or 501) is sent one chat completion of one
        token instead, which must succeed. Meant to run once before training starts.

        Args:
            timeout_s: per-request timeout (connect and read), in seconds.
            hint: appended to the error message (what the caller's user should do).

        Returns:
            ``"models"`` (the model list names the model) or ``"chat"`` (a 1-token completion
            came back).

        Raises:
            ValueError: no connection or no answer within ``timeout_s``, HTTP 401/403 (the key),
                the model not served, or any other failure; the message names the URL.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        todo = " " + hint if hint else ""
        url = models_url(self.url)
        try:
            with self._session().get(url, headers=self._headers, timeout=timeout_s) as resp:
                status, body = resp.status_code, resp.text[:_BODY_SNIPPET]
                listed = _model_ids(resp) if status == 200 else None
        except requests.RequestException as e:
            raise ValueError(self._redact(
                f"OpenAI-compatible endpoint {url} does not answer ({_cause(e, timeout_s)}): is the server "
                f"running and the URL right?{todo}")) from None
        if status in (401, 403):
            raise ValueError(f"{url} refused the request (HTTP {status}): check the API key in "
                             f"${self.api_key_env or 'OPENAI_API_KEY'}.{todo}")
        if listed is not None:
            if self.model not in listed:
                raise ValueError(f"{url} serves {sorted(listed)[:20]}, not model {self.model!r}: set the "
                                 f"served name (SGLang: --served-model-name) or the model name to match.{todo}")
            return "models"
        if status not in (200, 404, 405, 501):
            raise ValueError(self._redact(f"{url} answered HTTP {status}: {body!r}.{todo}"))
        payload = self._payload([{"role": "user", "content": "Say OK."}], 0.0, 1)
        try:
            with self._session().post(self.url, json=payload, headers=self._headers, timeout=timeout_s) as resp:
                if resp.status_code != 200:
                    raise ValueError(self._redact(
                        f"a 1-token chat completion for model {self.model!r} at {self.url} failed with HTTP "
                        f"{resp.status_code}: {resp.text[:_BODY_SNIPPET]!r}.{todo}"))
                self._content(resp, 1)
        except requests.RequestException as e:
            raise ValueError(self._redact(
                f"OpenAI-compatible endpoint {self.url} does not answer ({_cause(e, timeout_s)}): is the server "
                f"running and the URL right?{todo}")) from None
        except ChatRequestError as e:
            raise ValueError(f"{e}.{todo}") from None
        return "chat"

    def chat_batch(self, batch: Sequence[Messages], temperature: float = 0.7,
                   max_tokens: Union[int, Sequence[int]] = 512) -> list[Optional[str]]:
        """Many chat completions, concurrently (at most ``max_concurrency`` in flight).

        Args:
            batch: one chat per request.
            temperature: sampling temperature for all.
            max_tokens: one limit for all, or one per chat.

        Returns:
            The contents in order; None where a request failed for good (counted in
            ``stats["failed"]`` and logged without the key).

        Raises:
            ValueError: for malformed arguments (e.g. ``max_tokens`` of the wrong length).
        """
        n = len(batch)
        limits = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != n:
            raise ValueError(f"max_tokens has {len(limits)} entries for a batch of {n} chats")
        payloads = [self._payload(m, temperature, t) for m, t in zip(batch, limits)]
        if n == 0:
            return []
        futures = [self._pool().submit(self._one, p) for p in payloads]
        return [f.result() for f in futures]

    # internals ---------------------------------------------------------------------------------

    def _one(self, payload: dict[str, Any]) -> Optional[str]:
        self._count("requests")
        try:
            text = self._request(payload)
        except ChatRequestError as e:
            self._count("failed")
            logger.warning("%s", e)
            return None
        self._count("succeeded")
        return text

    def _payload(self, messages: Messages, temperature: float, max_tokens: int) -> dict[str, Any]:
        if not messages or not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        payload: dict[str, Any] = dict(self.extra_body)
        payload.update(model=self.model, messages=[dict(m) for m in messages], temperature=float(temperature),
                       max_tokens=max_tokens)
        return payload

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("OpenAIChatClient is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="chat-client")
            return self._executor

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _redact(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return _BEARER.sub(r"\1***", text)

    def _backoff(self, retry: int, retry_after: Optional[float]) -> float:
        delay = min(self.backoff_s * 2 ** (retry - 1), _MAX_BACKOFF_S) * random.uniform(1.0, 1.25)
        if retry_after is not None:
            delay = max(delay, min(retry_after, _MAX_BACKOFF_S))
        return delay

    def _request(self, payload: dict[str, Any]) -> str:
        """POST with retries; the content, or :class:`ChatRequestError`."""
        attempts = self.max_retries + 1
        last_cause, last_status, retry_after = "no attempt made", None, None
        for attempt in range(attempts):
            if self._closed:
                raise RuntimeError("OpenAIChatClient is closed")
            if attempt:
                self._count("retries")
                time.sleep(self._backoff(attempt, retry_after))
            retry_after = None
            try:
                with self._slots:
                    resp = self._session().post(self.url, json=payload, headers=self._headers, timeout=self.timeout_s)
            except requests.Timeout as e:
                self._count("timeouts")
                last_cause, last_status = f"timed out after {self.timeout_s:g} s ({type(e).__name__})", None
                logger.debug("chat attempt %d/%d to %s: %s", attempt + 1, attempts, self.url, last_cause)
                continue
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
                self._count("connection_errors")
                last_cause, last_status = self._redact(f"{type(e).__name__}: {e}"), None
                logger.debug("chat attempt %d/%d to %s: %s", attempt + 1, attempts, self.url, last_cause)
                continue
            except requests.RequestException as e:
                raise ChatRequestError(self._redact(f"chat request to {self.url} failed: {type(e).__name__}: {e}"),
                                       self.url, None, attempt + 1) from None
            with resp:
                if resp.status_code == 200:
                    return self._content(resp, attempt + 1)
                self._count("http_errors")
                last_status = resp.status_code
                last_cause = self._redact(f"HTTP {resp.status_code}: {resp.text[:_BODY_SNIPPET]!r}")
                if resp.status_code != 429 and resp.status_code < 500:
                    raise ChatRequestError(f"chat request to {self.url} failed with {last_cause} (not retried)",
                                           self.url, last_status, attempt + 1)
                retry_after = _retry_after_s(resp)
                logger.debug("chat attempt %d/%d to %s: %s", attempt + 1, attempts, self.url, last_cause)
        raise ChatRequestError(f"chat request to {self.url} failed after {attempts} attempt(s); "
                               f"last cause: {last_cause}", self.url, last_status, attempts)

    def _content(self, resp: requests.Response, attempts: int) -> str:
        try:
            choice = resp.json()["choices"][0]
            content = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ChatRequestError(
                self._redact(f"chat response from {self.url} is not a chat completion ({type(e).__name__}: {e}); "
                             f"body starts {resp.text[:_BODY_SNIPPET]!r}"), self.url, resp.status_code, attempts
            ) from None
        if not isinstance(content, str):
            raise ChatRequestError(f"chat response from {self.url} has no text content (got {type(content).__name__}, "
                                   f"finish_reason={choice.get('finish_reason')!r})", self.url, resp.status_code,
                                   attempts)
        if choice.get("finish_reason") == "length":
            logger.debug("chat completion from %s stopped at max_tokens", self.url)
        return content
