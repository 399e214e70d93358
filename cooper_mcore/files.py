"""Clear errors for broken JSON files and for writes that run out of disk space.

Only the standard library is imported here, so any module (the config checks, the training
checkpoint) can use it without loading torch or megatron-core.

A full disk does not reach the caller as ``ENOSPC`` with a path: torch's zip writer (``torch.save``,
which megatron-core uses for ``common.pt`` and inside its forked ``.distcp`` writers) reports a
short write as ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs
598``, which megatron-core wraps into ``RuntimeError("Worker failure: ...")`` and then into
torch's ``CheckpointException`` (the original only in its ``failures``). :func:`explain_write_errors`
looks through all of that (and at the free space on the output's file system) and raises
:class:`NoSpaceLeftError` naming the output path instead.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

#: errno values of a write that did not fit: full disk, quota, file size limit (``ulimit -f``)
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: messages of the same failure when the errno is lost (torch's zip writer, C++ streams, text of a
#: wrapped OSError)
_NO_SPACE_TEXT = re.compile(
    r"unexpected pos \d+ vs \d+|no space left on device|disk quota exceeded|file too large|"
    r"\[errno (28|27|122)\]|file write failed|basic_ios::clear",
    re.IGNORECASE,
)
#: below this many free bytes on the output's file system a failed write is taken for a full disk
LOW_SPACE_BYTES = 1 << 20


class NoSpaceLeftError(OSError):
    """A write ran out of disk space (or hit a quota or file-size limit).

    ``str(err)`` and ``err.args[0]`` are the whole message (the path, the free space, what the
    writer said and what to do); ``err.errno`` is ``ENOSPC`` and ``err.filename`` (also
    ``err.path``) the output that could not be written, as for an ``OSError`` from the system.
    """

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.strerror = os.strerror(errno.ENOSPC)
        self.filename = path
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0])


def read_json_object(path: str, what: str = "") -> dict[str, Any]:
    """A JSON file that must hold one object, with errors that name the file.

    Args:
        path: the file.
        what: how to describe it in errors (default: the path).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8, not valid JSON (with the line and column), or not an object.
    """
    name = what or path
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text (byte {e.start}); the file is damaged: "
                         "restore or rewrite it") from None
    except IsADirectoryError:
        raise ValueError(f"{name} is a directory, expected a JSON file") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}; "
                         "fix or restore the file") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must hold a JSON object, found {type(value).__name__}")
    return value


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the exceptions inside a ``CheckpointException``."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple) and e:  # torch.distributed.checkpoint's (exception, traceback)
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())


def _no_space_cause(exc: BaseException) -> Optional[BaseException]:
    """The exception in ``exc`` (itself or one it wraps) that says a write did not fit, or None:
    an ``OSError`` with such an errno, else the shortest message that says so (the innermost: a
    ``CheckpointException``'s text repeats its failures' tracebacks)."""
    causes = list(_causes(exc))
    for e in causes:
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return e
    said = [e for e in causes if _NO_SPACE_TEXT.search(str(e))]
    return min(said, key=lambda e: len(str(e))) if said else None


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything it wraps) is a write that did not fit on the disk."""
    return _no_space_cause(exc) is not None


def free_bytes(path: str) -> Optional[int]:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent); None if unknown."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


def no_space_error(exc: BaseException, path: str, what: str = "output") -> Optional[NoSpaceLeftError]:
    """The :class:`NoSpaceLeftError` that ``exc`` means while writing ``path``, or None if it is
    another failure (a full disk is recognised by errno, by the messages of torch's writers, or by
    less than :data:`LOW_SPACE_BYTES` left on the file system)."""
    if isinstance(exc, NoSpaceLeftError):
        exc = exc.__cause__ or exc
    free = free_bytes(path)
    cause = _no_space_cause(exc)
    # an I/O failure (not e.g. a ValueError about a shape) with the disk all but full
    io_failure = isinstance(exc, (OSError, RuntimeError)) or not isinstance(exc, Exception)
    if cause is None and not (io_failure and free is not None and free < LOW_SPACE_BYTES):
        return None
    said = str(cause if cause is not None else exc).strip()
    first = said.splitlines()[0] if said else type(exc).__name__
    free_text = f"{_size(free)} free on its file system" if free is not None else "free space unknown"
    return NoSpaceLeftError(
        f"no space left on device while writing the {what} {path!r} ({free_text}; the writer said: "
        f"{first[:300]}); nothing half-written is kept: free some space (or raise the quota or file-size "
        "limit) or choose an output on another file system, and run the command again",
        path,
    )


@contextmanager
def explain_write_errors(path: str, what: str = "output") -> Iterator[None]:
    """Turn a write that ran out of disk space inside the block into a :class:`NoSpaceLeftError`
    naming ``path`` (other errors pass through unchanged).

    Example::

        with explain_write_errors(ckpt_dir, "checkpoint"):
            dist_checkpointing.save(sharded, ckpt_dir)
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        err = no_space_error(e, path, what)
        if err is None:
            raise
        raise err from (e.__cause__ if isinstance(e, NoSpaceLeftError) and e.__cause__ else e)
