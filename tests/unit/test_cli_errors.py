"""User and environment errors of the `cooper` command: one line naming the file, path or setting,
exit code 2, no traceback. Each runs the CLI in-process (``cooper_mcore.cli.main``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cooper_mcore import cli
from cooper_mcore.cli import EXIT_USER_ERROR, environment_error, main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")


def _one_clear_line(caplog, capsys, *names: str) -> str:
    """The error logged: one ERROR line that names each of ``names``, and no traceback anywhere."""
    err = capsys.readouterr().err
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, caplog.text
    message = errors[0].getMessage()
    assert "\n" not in message and errors[0].exc_info is None, message
    assert "Traceback" not in caplog.text and "Traceback" not in err
    assert "unexpected error" not in caplog.text
    for name in names:
        assert name in message, message
    return message


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder this process may not write into. Root writes through any mode bits, so there the
    folder is refused the way the kernel refuses it to another user (os.access says no)."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root
        real_access = os.access

        def access(path, mode, *args, **kwargs):
            if os.path.abspath(path) == str(folder) and mode & os.W_OK:
                return False
            return real_access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    yield folder
    folder.chmod(0o755)


def _verify_input(tmp_path) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text('{"gold": "1", "pred": "1"}\n')
    return str(src)


# -- PermissionError -----------------------------------------------------------------------------

def test_train_into_a_read_only_folder(read_only, caplog, capsys):
    out = read_only / "run"
    assert main(["train", "--config", TINY, "--out", str(out)]) == EXIT_USER_ERROR
    msg = _one_clear_line(caplog, capsys, str(read_only), "permission denied", "--out")
    assert msg.startswith("permission denied")
    assert not out.exists()


def test_train_rm_into_a_read_only_folder(read_only, tmp_path, caplog, capsys):
    data = tmp_path / "labeled.jsonl"
    data.write_text("")
    rc = main(["train-rm", "--ckpt", str(tmp_path / "rm"), "--train", str(data), "--out", str(read_only / "rm")])
    assert rc == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, str(read_only), "permission denied")


# -- IsADirectoryError / NotADirectoryError ----------------------------------------------------

def test_out_names_a_folder_where_a_file_is_expected(tmp_path, caplog, capsys):
    folder = tmp_path / "results"
    folder.mkdir()
    assert main(["verify", "--in", _verify_input(tmp_path), "--out", str(folder)]) == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, str(folder), "is a folder, where a file is expected")
    assert os.listdir(folder) == []


def test_preset_names_a_folder(tmp_path, caplog, capsys):
    assert main(["config", "--config", str(tmp_path)]) == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, str(tmp_path), "is a folder")


def test_out_goes_through_a_file(tmp_path, caplog, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    out = a_file / "sub" / "verdicts.jsonl"
    assert main(["verify", "--in", _verify_input(tmp_path), "--out", str(out)]) == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, str(a_file), "a file is in the way")


def test_tiny_assets_out_is_a_file(tmp_path, caplog, capsys):
    a_file = tmp_path / "assets"
    a_file.write_text("x")
    assert main(["tiny-assets", "--out", str(a_file)]) == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, str(a_file), "a file is in the way")


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
    _one_clear_line(caplog, capsys, "no space left", str(out))


# -- YAML and preset shape -----------------------------------------------------------------------

@pytest.mark.parametrize("text, line, what", [
    ("train:\n\tsteps: 2\n", "line 2", "a tab: YAML indents with spaces only"),
    ("train:\n  steps: 2\n  steps: 3\n", "line 3", "found duplicate key steps"),
    ("train: [1\nalgo: {}\n", "line 2", "did not find expected"),
], ids=["tab", "duplicate_key", "syntax"])
def test_a_yaml_error_names_the_file_and_line(tmp_path, caplog, capsys, text, line, what):
    preset = tmp_path / "bad.yaml"
    preset.write_text(text)
    assert main(["config", "--config", str(preset)]) == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, str(preset), line, what)


@pytest.mark.parametrize("text, what", [
    ("", "is empty"),
    ("# nothing but a comment\n", "is empty"),
    ("- train\n- algo\n", "must be a mapping of sections (model:, train:, ...), got a list"),
], ids=["empty", "comment_only", "list"])
def test_a_preset_that_is_not_a_mapping_of_sections(tmp_path, caplog, capsys, text, what):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    assert main(["config", "--config", str(preset)]) == EXIT_USER_ERROR
    msg = _one_clear_line(caplog, capsys, str(preset), what)
    assert "Key ''" not in msg


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


def test_tiny_assets_unknown_family(tmp_path, caplog, capsys):
    assert main(["tiny-assets", "--out", str(tmp_path / "assets"), "--rm-family", "qwen9"]) == EXIT_USER_ERROR
    _one_clear_line(caplog, capsys, "rm_family 'qwen9'", "is not a tiny family")
