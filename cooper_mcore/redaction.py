"""Keep secrets (API keys, tokens) out of everything a run writes: logs, configs, wandb.

Secrets come from the environment only. Two complementary guards, one rule for what looks
secret (:func:`looks_secret`: a name containing ``secret``, ``password``, ``passwd`` or
``credential``, or ending in ``key``, ``token`` or ``apikey``, in any case; data-field selectors
such as ``answer_key`` excepted):

* :func:`redact` hides config *entries* by their names (``api_key``, ``hf_token``);
* :func:`scrub` hides secret *values* wherever they appear, e.g. a key pasted into
  ``rm.api_key_env`` or into a URL by mistake. The secret values are those of the environment
  variables whose names look secret (``OPENAI_API_KEY``, ``WANDB_API_KEY``, ``HF_TOKEN``) plus any
  variable named explicitly (a config's ``rm.api_key_env``), when at least
  :data:`MIN_SECRET_CHARS` long (so that short values such as ``1`` are never treated as secrets).

Both write :data:`REDACTED` in place of what they hide. :func:`install_log_filter` puts a
:class:`SecretFilter` on the root logger's handlers so that no log line (or traceback) shows a
secret value.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional

REDACTED = "***"
MIN_SECRET_CHARS = 8
_SECRET_PARTS = ("secret", "password", "passwd", "credential")
_SECRET_ENDINGS = ("key", "token", "apikey")
# settings that name a data field ("answer_key: answer"), not secrets
_FIELD_SELECTORS = {f"{f}_key" for f in ("question", "answer", "reference", "completion", "label", "id",
                                          "answer_type", "gold", "pred", "prompt", "response")}


def looks_secret(name: str) -> bool:
    """Whether a setting's or an environment variable's name marks its value as a secret."""
    low = name.lower()
    if low in _FIELD_SELECTORS:
        return False
    return any(p in low for p in _SECRET_PARTS) or low.endswith(_SECRET_ENDINGS)


def redact(obj: Any) -> Any:
    """A copy of ``obj`` with the values of secret-named entries (:func:`looks_secret`) replaced by
    :data:`REDACTED`, whatever the value. Settings that merely mention tokens or name an environment
    variable or a data field (``max_new_tokens``, ``tokenizer``, ``api_key_env``, ``answer_key``) are
    kept. Nested mappings, lists and tuples are walked; the input is not modified.

    Args:
        obj: a config (usually a dict; a dataclass should be passed through ``dataclasses.asdict``).

    Returns:
        The redacted copy (mappings become plain dicts; other leaves are returned as-is).
    """
    if isinstance(obj, Mapping):
        return {k: REDACTED if looks_secret(str(k)) else redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [redact(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def secret_values(extra_env: Iterable[str] = ()) -> list[str]:
    """The current secret values, longest first.

    Args:
        extra_env: names of further environment variables that hold secrets.
    """
    names = {n for n in os.environ if looks_secret(n)} | {n for n in extra_env if n}
    values = {os.environ[n] for n in names if len(os.environ.get(n, "")) >= MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def env_names_in(obj: Any) -> list[str]:
    """The environment variable names a config points at: string values of keys ending in ``_env``
    (``rm.api_key_env``), at any depth of mappings and lists."""
    if isinstance(obj, Mapping):
        return [n for k, v in obj.items()
                for n in ([v] if str(k).endswith("_env") and isinstance(v, str) else env_names_in(v))]
    if isinstance(obj, (list, tuple)):
        return [n for v in obj for n in env_names_in(v)]
    return []


def scrub_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config (nested mappings) with secret-named entries and every secret value hidden: the
    form in which configs are written to files and sent to wandb."""
    return scrub(redact(dict(config)), secret_values(env_names_in(config)))


def scrub(obj: Any, secrets: Optional[list[str]] = None) -> Any:
    """A copy of ``obj`` with every secret value replaced by ``***`` in its strings.

    Args:
        obj: a string, or mappings / lists / tuples of them (other leaves are returned as-is).
        secrets: the values to hide (default: :func:`secret_values`).
    """
    secrets = secret_values() if secrets is None else secrets
    if not secrets:
        return obj
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, REDACTED)
        return obj
    if isinstance(obj, Mapping):
        return {scrub(k, secrets): scrub(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(scrub(v, secrets) for v in obj)
    return obj


class SecretFilter(logging.Filter):
    """A handler filter that rewrites records whose message or traceback holds a secret value.

    Args:
        extra_env: further environment variables whose values are secrets.
    """

    def __init__(self, extra_env: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = secret_values(extra_env)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        msg = record.getMessage()
        clean = scrub(msg, self.secrets)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, self.secrets)
        return True


def install_log_filter(extra_env: Iterable[str] = ()) -> SecretFilter:
    """Put one :class:`SecretFilter` on each handler of the root logger (replacing an earlier one).

    Call it after logging is configured, and again when more secret variables become known.
    """
    filt = SecretFilter(extra_env)
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, SecretFilter)]:
            handler.removeFilter(old)
        handler.addFilter(filt)
    return filt
