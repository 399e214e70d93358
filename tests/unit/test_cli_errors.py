"""How the `cooper` command turns errors into what the user reads: an environment error (a full disk,
a path refused by the system) one line naming the path, exit code 2; a library's own user error its
exit code; anything else a traceback. The bad inputs users meet, each through the CLI, are the
bad-input tier's cases (``tests/badinput/``)."""

from __future__ import annotations

import errno
import os

import pytest

from cooper_mcore import cli
from cooper_mcore.cli import EXIT_USER_ERROR, environment_error, main
from tests.badinput.case import one_clear_line


def _verify_input(tmp_path) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text('{"gold": "1", "pred": "1"}\n')
    return str(src)


# -- ENOSPC --------------------------------------------------------------------------------------

def test_no_space_left_on_device(tmp_path, monkeypatch, caplog, capsys):
    """A write() on a full disk raises ENOSPC naming no path: the message names the command's --out."""
    def full_disk(args):
        with open("/dev/full" if os.path.exists("/dev/full") else os.devnull, "w") as f:
            f.write("x")
            if f.name == os.devnull:  # no /dev/full here: raise what it would
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cli, "handler", lambda command: full_disk)
    out = tmp_path / "out" / "v.jsonl"
    assert main(["verify", "--in", _verify_input(tmp_path), "--out", str(out)]) == EXIT_USER_ERROR
    one_clear_line(caplog, capsys.readouterr().err, "no space left", str(out))


# -- what is not the user's: a traceback --------------------------------------------------------

def test_other_os_errors_keep_their_traceback(monkeypatch, caplog):
    def broken(args):
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(cli, "handler", lambda command: broken)
    assert main(["verify", "--in", "a", "--out", "b"]) == 1
    assert "unexpected error" in caplog.text and "Traceback" in caplog.text


def test_library_errors_named_by_class(monkeypatch, caplog):
    """TrainingStopped (matched by name: the CLI does not import the trainer) keeps its exit code."""
    from cooper_mcore.job import TrainingStopped

    def stopped(args):
        raise TrainingStopped("preempted (SIGTERM) after step 3: checkpoint x written", 75, "x")

    monkeypatch.setattr(cli, "handler", lambda command: stopped)
    assert main(["verify", "--in", "a", "--out", "b"]) == 75
    assert "preempted (SIGTERM) after step 3" in caplog.text and "Traceback" not in caplog.text


@pytest.mark.parametrize("code, fragment", [
    (errno.EACCES, "permission denied on '/x/y'"),
    (errno.EROFS, "'/x/y' is on a read-only file system"),
    (errno.EISDIR, "'/x/y' is a folder, where a file is expected"),
    (errno.ENOTDIR, "'/x/y': a file is in the way"),
    (errno.ENOSPC, "no space left on the device of '/x/y'"),
    (errno.EDQUOT, "disk quota exceeded writing '/x/y'"),
])
def test_environment_error_messages(code, fragment):
    msg = environment_error(OSError(code, os.strerror(code), "/x/y"))
    assert msg is not None and msg.startswith(fragment) and "\n" not in msg
    assert environment_error(OSError(errno.ECONNRESET, "reset")) is None

