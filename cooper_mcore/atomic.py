"""Atomic file output: write under a temporary name in the target's folder, rename over the target.

Every command that replaces a file this way goes through this module (``cooper verify --out``,
``cooper annotate --out/--judgements``, ``cooper eval-rm --predictions``, the run folders' JSON
files, checkpoint manifests, the demo's stage files), so the rules are the same everywhere:

* A target that exists and is not a regular file (a device such as ``/dev/full`` or ``/dev/null``,
  a FIFO, a socket, a folder) is refused with ``ValueError("<path> exists and is not a regular file
  ...")``: a rename would replace the special file itself (as root, the device node) with a
  regular file. Commands call :func:`check_output_path` before any work, so the refusal comes
  first, and :func:`atomic_path` checks again before it renames.
* A symbolic link is followed: the file it points to is replaced, the link stays (a link to a
  special file is refused like the special file).
* The temporary file is unique (``mkstemp``), in the same folder (the rename stays on one file
  system), removed when the write fails or is interrupted, and gets the permissions a plain
  ``open(path, "w")`` would give (the umask's, or those of the file it replaces).

Only the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_open", "atomic_path", "check_output_path", "write_json_atomic"]

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def check_output_path(path: str) -> str:
    """The file that writing ``path`` atomically replaces (``path`` with symbolic links resolved).

    Raises:
        ValueError: ``path`` (or the file a link points to) exists and is not a regular file.
    """
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return real
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        via = f" ({real})" if real != os.path.abspath(path) else ""
        raise ValueError(f"{path} exists and is not a regular file{via}: it is {kind}, which would be replaced "
                         "by the output; give the path of a regular file (or of one that does not exist yet)")
    return real


def _permissions(real: str) -> int:
    try:
        return stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str, fsync: bool = False) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, rename it over ``path``.

    The block writes the temporary path by any means (``open``, ``pyarrow.parquet.write_table``,
    ...). When it raises (or is interrupted), the temporary file is removed and ``path`` is left as
    it was.

    Args:
        path: the output file; its folder is created if missing.
        fsync: flush the file and its folder to the disk (checkpoint manifests).

    Raises:
        ValueError: ``path`` exists and is not a regular file (see the module doc).
    """
    real = check_output_path(path)
    folder = os.path.dirname(real)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _permissions(real))
        if fsync:
            fsync_path(tmp)
        check_output_path(path)  # it may have been made a special file while the block ran
        os.replace(tmp, real)
        if fsync:
            fsync_path(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", encoding: str | None = "utf-8", fsync: bool = False) -> Iterator[IO[Any]]:
    """``open(path, mode)`` written atomically (:func:`atomic_path`); ``mode`` is ``"w"`` or ``"wb"``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path, fsync=fsync) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f


def write_json_atomic(path: str, obj: Any, indent: int | None = 2, fsync: bool = False) -> None:
    """Write ``obj`` as JSON (keys sorted, a final newline) atomically to ``path``."""
    with atomic_open(path, fsync=fsync) as f:
        json.dump(obj, f, indent=indent, sort_keys=True, default=str)
        f.write("\n")


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder: so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(path: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``<path>.lock`` (created beside ``path``) for the block.

    For a folder that several processes may build at once (the tiny assets of rehearsals run side
    by side): they take turns, and the later ones find and reuse what the first wrote. Not
    re-entrant: a process must not take the same lock twice.
    """
    lock = os.path.abspath(path).rstrip(os.sep) + ".lock"
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

