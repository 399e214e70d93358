"""JSON calls to an SGLang HTTP server (native and OpenAI-compatible endpoints): bounded retries
with backoff for idempotent calls and for connections that never reached the server, and errors
that name the server, the operation and the attempts. See ``docs/sglang.md``.
"""

from __future__ import annotations

import logging
import subprocess
import time
from typing import Any, Optional

import requests
import urllib3

logger = logging.getLogger(__name__)

_RETRY_STATUS = (500, 502, 503, 504)  # server-side failures worth another try for idempotent requests


def _is_connect_failure(exc: requests.exceptions.ConnectionError) -> bool:
    """True when the request never reached the server (safe to retry any operation)."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError))


class SGLangHTTPClient:
    """JSON calls to an SGLang server with bounded retries and errors that name the server.

    A request that never reached the server (connection refused, connect timeout) is retried
    with exponential backoff (``backoff_s``, doubling) up to ``max_retries`` times. An
    *idempotent* request (generation, reads, cache flush: sending it twice changes nothing) is
    also retried when the connection drops mid-request or the server answers HTTP 500, 502, 503
    or 504. Weight-update calls are not idempotent and fail at once on those. After the retries
    the error names the server, the operation and the number of attempts; a dead engine stops the
    run with it (there is nothing to mask without rollouts).

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        connect_timeout_s / request_timeout_s: per-request limits (a read timeout is not retried).
        max_retries: extra attempts (exponential backoff from ``backoff_s``).
    """

    def __init__(self, base_url: str, connect_timeout_s: float = 5.0, request_timeout_s: float = 1800.0,
                 max_retries: int = 3, backoff_s: float = 0.5) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"SGLang server URL must start with http:// or https://, got {base_url!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._session = requests.Session()

    def request(self, method: str, path: str, op: str, payload: Optional[dict] = None,
                idempotent: bool = False, timeout_s: Optional[float] = None) -> Any:
        """One request; returns the decoded JSON (or the text, or None for an empty body). Raises:
            ConnectionError: the server could not be reached after the retries.
            TimeoutError: no answer within the request timeout.
            RuntimeError: an HTTP error status, or ``{"success": false}``.
        """
        url = self.base_url + path
        timeout = (self.connect_timeout_s, timeout_s or self.request_timeout_s)
        for attempt in range(self.max_retries + 1):
            try:
                resp = self._session.request(method, url, json=payload, timeout=timeout)
                if not (idempotent and resp.status_code in _RETRY_STATUS) or attempt == self.max_retries:
                    break
                delay = self.backoff_s * 2**attempt
                logger.warning("SGLang %s at %s: HTTP %d; retrying in %.2fs", op, url, resp.status_code, delay)
                time.sleep(delay)
            except requests.exceptions.ConnectionError as e:
                if not (_is_connect_failure(e) or idempotent) or attempt == self.max_retries:
                    raise ConnectionError(f"SGLang server {self.base_url}: {op} ({method} {path}) failed after "
                                          f"{attempt + 1} attempt(s): {e}") from e
                delay = self.backoff_s * 2**attempt
                logger.warning("SGLang %s at %s: %s; retrying in %.2fs", op, url, type(e).__name__, delay)
                time.sleep(delay)
            except requests.exceptions.Timeout as e:
                raise TimeoutError(f"SGLang server {self.base_url}: {op} ({method} {path}) got no answer within "
                                   f"{timeout[1]}s") from e
        if resp.status_code >= 400:
            tries = f" after {attempt + 1} attempt(s)" if idempotent and resp.status_code in _RETRY_STATUS else ""
            raise RuntimeError(f"SGLang server {self.base_url}: {op} ({method} {path}) answered HTTP "
                               f"{resp.status_code}{tries}: {resp.text[:500]!r}")
        if not resp.content:
            return None
        try:
            body = resp.json()
        except ValueError:
            return resp.text
        if isinstance(body, dict) and body.get("success") is False:
            raise RuntimeError(f"SGLang server {self.base_url}: {op} failed: {str(body.get('message'))[:500]!r}")
        return body

    def wait_until_ready(self, timeout_s: float, path: str = "/health_generate", poll_s: float = 1.0,
                         process: Optional[subprocess.Popen] = None) -> None:
        """Poll ``path`` until it answers 200 (``/health_generate`` runs a 1-token generation). Raises:
            TimeoutError: not ready within ``timeout_s`` (with the last status or error).
            RuntimeError: ``process`` (the launched server) exited.
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"SGLang server {self.base_url} exited with code {process.returncode} "
                                   "before it was ready")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"SGLang server {self.base_url} not ready after {timeout_s}s "
                                   f"(last {path}: {last})")
            try:
                resp = self._session.get(self.base_url + path, timeout=(min(self.connect_timeout_s, remaining),
                                                                        max(min(remaining, 60.0), 0.1)))
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except requests.exceptions.RequestException as e:
                last = type(e).__name__
            time.sleep(max(min(poll_s, deadline - time.monotonic()), 0))

    def close(self) -> None:
        """Close the HTTP session."""
        self._session.close()
