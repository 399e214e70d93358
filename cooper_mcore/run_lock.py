"""A run folder belongs to one run: an exclusive lock on a file, with its holder recorded in it.

:class:`RunLock` takes a POSIX record lock (``fcntl.lockf``) on its file without waiting and
writes its holder into it (:class:`Holder`: host, pid, start time, command line). A second run
meets the lock and is refused with one line naming the holder (:class:`FolderInUse`). The kernel
releases the lock when its process dies, however it dies, so a SIGKILLed run's folder is free at
once; a clean release removes the file, and the folders the lock created for it when they stayed
empty (a run refused before it wrote anything leaves no ``--out`` behind). POSIX locks rather than
``flock``: forked children (the checkpoint writers megatron-core forks) do not inherit them, so a
writer left behind by a killed trainer never keeps the folder locked, and they are the locks NFS
forwards to its server.

Shared file systems: NFS (v4, or v3 with lockd) and GPFS lock across nodes; Lustre does only when
mounted with ``-o flock`` (``localflock`` locks per node). So the recorded holder is checked too:
the holder refreshes the file's modification time every :data:`HEARTBEAT_S` seconds, and a run
that gets the lock but finds the record of a run on another host refreshed within
:data:`STALE_S` seconds is refused as well (on one host the lock alone decides). Where the file
system refuses locks altogether (``ENOLCK``: NFS without lockd), the record is all there is; a
warning says so.

Only the standard library is imported here; :func:`cooper_mcore.job.hold_run_folder` takes the
lock on rank 0 of a job and tells the other ranks.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

from cooper_mcore.redaction import scrub

__all__ = ["HEARTBEAT_S", "LOCK_FILE", "STALE_S", "FolderInUse", "Holder", "RunLock"]

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
#: seconds between the holder's refreshes of the lock file's modification time
HEARTBEAT_S = 30.0
#: a record of another host not refreshed for this long belongs to a run that is gone (five refreshes missed:
#: room for the clocks of two nodes to disagree by a minute)
STALE_S = 150.0
_BUSY = (errno.EACCES, errno.EAGAIN)  # lockf's "held by another process"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # the file system does not lock
_ATTEMPTS = 5  # a file removed by its releasing holder between our open and our lock: open it again


class FolderInUse(ValueError):
    """Another run holds the folder (the message names it, in one line)."""


@dataclass(frozen=True)
class Holder:
    """The run that holds a lock, as written in its file."""

    host: str
    """The holder's host name."""
    pid: int
    """Its process id on that host."""
    started: str
    """When it took the lock (ISO 8601, local time with its offset)."""
    command: str
    """Its command line (secrets scrubbed)."""

    @classmethod
    def me(cls) -> Holder:
        """This process."""
        return cls(socket.gethostname(), os.getpid(),
                   datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   scrub(" ".join(sys.argv)))

    @classmethod
    def parse(cls, text: str) -> Optional[Holder]:
        """The holder written in ``text`` (None: empty or not a record, e.g. a file torn by a crash)."""
        try:
            record = json.loads(text)
            return cls(str(record["host"]), int(record["pid"]), str(record["started"]), str(record["command"]))
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        """``pid P on host H since T`` (its command is in the lock file)."""
        return f"pid {self.pid} on host {self.host} since {self.started}"

    def alive_here(self) -> bool:
        """Whether the holder is a live process of this host (False for another host's)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


class RunLock:
    """An exclusive lock on the file ``path`` that guards the output ``guards``, one holder at a
    time (the module doc).

    Not re-entrant: a process that holds ``path`` is refused a second hold of it (POSIX locks do
    not exclude the process that holds them, and closing a second descriptor would drop the first).
    """

    _held_here: set[str] = set()  # the real paths this process holds

    def __init__(self, path: str, guards: str) -> None:
        self.path = path
        self.guards = guards
        self._real = os.path.realpath(path)
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._made: list[str] = []  # the folders acquire() created for the file, innermost first

    def acquire(self) -> None:
        """Take the lock and write this process into it; a refresher thread keeps it fresh.

        Raises:
            FolderInUse: another run holds it (naming the holder, and how to tell if it is gone).
            OSError: the file cannot be created or written (a read-only folder, ...).
        """
        if self._real in RunLock._held_here:
            raise FolderInUse(f"{self.guards} is already used by this process (pid {os.getpid()}): one run at a time")
        self._made = _missing_folders(os.path.dirname(self._real))
        self._stop = threading.Event()
        for _ in range(_ATTEMPTS):
            os.makedirs(os.path.dirname(self._real), exist_ok=True)
            try:
                fd = os.open(self._real, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # another run's release removed the folder it had made: make it again
                continue
            try:
                locked = self._lock(fd)
                if self._same_file(fd):
                    self._check_record(fd, locked)
                    self._write_record(fd)
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # removed by its releasing holder after we opened it: open the new one
        else:
            raise FolderInUse(f"{self.path} keeps being replaced: are other runs starting in {self.guards}?")
        self._fd = fd
        RunLock._held_here.add(self._real)
        self._heartbeat = threading.Thread(target=self._refresh, name=f"run-lock {self.path}", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Remove the file, drop the lock and remove the folders :meth:`acquire` created that stayed
        empty (idempotent)."""
        if self._fd is None:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            os.unlink(self._real)  # while still locked: a run that opened this file opens the next one
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)  # drops the lock
            self._fd = None
            RunLock._held_here.discard(self._real)
        for folder in self._made:
            try:
                os.rmdir(folder)
            except OSError:  # not empty (the run wrote there), or gone: keep what is there
                break

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _lock(self, fd: int) -> bool:
        """Lock ``fd`` without waiting: True when locked, False when the file system has no locks.

        Raises:
            FolderInUse: another process holds the lock.
        """
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in _BUSY:
                holder = Holder.parse(_read(fd))
                who = holder.describe() if holder else "one that has not written its record yet"
                raise FolderInUse(f"{self.guards} is in use by another run: {who}; wait for it to end or use "
                                  f"another --out (lock file {self.path}, with its command)") from None
            if e.errno not in _NO_LOCKS:
                raise
        logger.warning("%s: the file system does not lock files; only the holder recorded in it keeps a second run "
                       "out of %s", self.path, self.guards)
        return False

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self._real).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _check_record(self, fd: int, locked: bool) -> None:
        """Refuse a record left by a live run that the lock did not exclude: one on another host
        (refreshed within :data:`STALE_S`), or, without locks, a live process of this host."""
        holder = Holder.parse(_read(fd))
        if holder is None:
            return
        here = holder.host == socket.gethostname()
        age = time.time() - os.fstat(fd).st_mtime
        if here and not locked and holder.pid != os.getpid() and holder.alive_here():
            raise FolderInUse(f"{self.guards} is in use by another run: {holder.describe()}; wait for it to end or "
                              f"use another --out (lock file {self.path})")
        if not here and age < STALE_S:
            raise FolderInUse(f"{self.guards} is in use by another run: {holder.describe()}, its lock file "
                              f"{self.path} refreshed {age:.0f} s ago (file locks may not reach across the nodes "
                              f"of this file system); if that run is gone, run again once the file is "
                              f"{STALE_S:.0f} s old, or delete it")
        logger.warning("%s: taking over from a run that is gone: %s", self.path, holder.describe())

    def _write_record(self, fd: int) -> None:
        data = (json.dumps(asdict(Holder.me()), sort_keys=True) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def _refresh(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self._fd)  # type: ignore[arg-type]  # the descriptor: never a file that replaced it
            except OSError:  # the folder is gone: nothing to refresh
                return


def _missing_folders(folder: str) -> list[str]:
    """The folders on the way to ``folder`` (itself included) that do not exist yet, innermost first."""
    missing = []
    while not os.path.exists(folder) and folder != os.path.dirname(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _read(fd: int) -> str:
    return os.pread(fd, 1 << 16, 0).decode("utf-8", errors="replace")
