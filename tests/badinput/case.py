"""A bad-input case as data, and the one checker that runs every case.

A :class:`Case` names what the user runs (the arguments of ``cooper``, with ``{name}`` placeholders
for the paths its setup makes) and what they must get. :func:`check_case` runs it in-process through
:func:`cooper_mcore.cli.main` and checks, for every case alike:

* the exit code (2, the CLI's user error, unless the case documents another);
* exactly one ERROR line that names the culprit (the case's substrings: the setting, flag or file),
  no traceback anywhere, nothing on stdout (no result was given); a refusal by the parser instead
  ends stderr with argparse's one ``cooper <command>: error: argument --flag: ...`` line;
* nothing lost: every file, folder and link under the case's folder is as it was (bytes, mode, target)
  and nothing new is there (``--out`` not created where it did not exist), but for what the case
  says the command may leave; what its error says it kept is there; the shared checkpoints the cases
  read are untouched;
* a warning the command must give first, where the case names one;
* the user's fix (``then``), where the case gives one, runs next on the same files and exits 0.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from cooper_mcore.cli import EXIT_USER_ERROR, main
from tests.conftest import ROOT

#: the placeholders every case may use, besides ``{tmp}`` (the case's folder) and ``{runs}``
#: (:func:`tests.conftest.checkpoint_runs`, read only)
FIXED = {"root": str(ROOT), "tiny": str(ROOT / "examples" / "tiny_cpu.yaml"),
         "sft_preset": str(ROOT / "examples" / "jobs" / "sft_tiny_cpu.yaml"),
         "rm_preset": str(ROOT / "examples" / "jobs" / "verify_rm_tiny_cpu.yaml"),
         "verifybench": str(ROOT / "tests" / "fixtures" / "verifybench_tiny.jsonl")}
#: ``cooper train``'s tiny preset on the checkpoints of ``{runs}``: a run that passes every check
TINY_RUN = ("--config", "{tiny}", "model.policy_ckpt={runs}/policy_src", "model.policy_hf={runs}/hf",
            "model.rm_ckpt={runs}/rm_src", "data.train_path={runs}/prompts.jsonl",
            "data.eval_path={runs}/prompts.jsonl", "logging.wandb=false")


@dataclass
class Env:
    """What a case's setup works with."""

    tmp: Path
    """The case's own folder: every file the setup makes goes here (and is checked for loss after)."""
    runs: Path
    """:func:`tests.conftest.checkpoint_runs`: shared by every case, read only (copy before changing)."""
    monkeypatch: pytest.MonkeyPatch
    """For a setup that changes the environment the command sees (undone after the case)."""
    cleanup: Callable[[Callable[[], None]], None]
    """Registers what to undo after the case (a process to stop, a mode to restore)."""


def no_setup(env: Env) -> dict[str, str]:
    """The setup of a case that needs no files of its own."""
    return {}


@dataclass(frozen=True)
class Case:
    """One bad input: what the user runs and what they must get (the module doc)."""

    id: str
    """The test's id: what is wrong, in a few words."""
    argv: tuple[str, ...]
    """The arguments of ``cooper``; ``{name}`` is a value of the setup's (or ``{tmp}``, :data:`FIXED`)."""
    names: tuple[str, ...]
    """Substrings the one error line must hold (placeholders filled): the setting, flag or file, what is wrong."""
    setup: Callable[[Env], dict[str, str]] = no_setup
    """Makes the case's files in ``env.tmp`` (a corrupted shard, a held lock, a run folder); returns placeholders."""
    code: int = EXIT_USER_ERROR
    """The exit code the command must end with."""
    usage: bool = False
    """Refused by the parser (argparse's ``error: argument --flag: ...``), not by the command."""
    listed: int = 0
    """The config check's list: this many problems, one per line under ``invalid config (N problems):``."""
    then: tuple[str, ...] = ()
    """The user's fix, run next on the same files: its ``cooper`` arguments must exit 0."""
    leaves: tuple[str, ...] = ()
    """Patterns (relative to ``env.tmp``) of what the refused command may write (a run that stopped after steps)."""
    kept: tuple[str, ...] = ()
    """Paths (relative to ``env.tmp``) the command must leave: what its error says it kept."""
    warns: tuple[str, ...] = ()
    """Substrings of one WARNING line the command must log before it stops (what it said at its start)."""


def fill(texts: Sequence[str], values: dict[str, str]) -> list[str]:
    """``texts`` with each ``{name}`` of ``values`` replaced (other braces, as in ``data.template={question}``,
    are left as they are)."""
    return [re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), t) for t in texts]


def run_cli(argv: Sequence[str]) -> int:
    """``cooper <argv>`` in this process: its exit code (the parser's too, which exits)."""
    try:
        return main(list(argv))
    except SystemExit as e:
        return int(e.code or 0)


def one_clear_line(caplog: pytest.LogCaptureFixture, stderr: str, *names: str, listed: int = 0) -> str:
    """The error logged: one ERROR record that names each of ``names`` in one line (or, ``listed``, the
    config check's list of that many problems), and no traceback anywhere."""
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, caplog.text
    message = errors[0].getMessage()
    assert errors[0].exc_info is None, message
    if listed:
        first, *problems = message.splitlines()
        assert first == f"invalid config ({listed} problems):" and len(problems) == listed, message
        assert all(p.startswith("  - ") and p.strip() for p in problems), message
    else:
        assert "\n" not in message, message
    assert "Traceback" not in caplog.text and "Traceback" not in stderr
    assert "unexpected error" not in caplog.text
    for name in names:
        assert name in message, (name, message)
    return message


def usage_line(caplog: pytest.LogCaptureFixture, stderr: str, *names: str) -> str:
    """The parser's refusal: stderr ends with its one ``cooper <command>: error: ...`` line naming each of
    ``names``; nothing was logged as an error (the command never ran)."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("cooper ") and ": error: " in lines[-1], stderr
    assert sum(": error: " in line for line in lines) == 1, stderr
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "Traceback" not in stderr
    for name in names:
        assert name in lines[-1], (name, lines[-1])
    return lines[-1]


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` (not following links): a file's mode and SHA-1, a folder's mode, a
    link's target, another kind's type and mode (a FIFO is never opened)."""
    entries: dict[str, tuple] = {}
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, folder)
            if stat.S_ISLNK(st.st_mode):
                entries[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    entries[rel] = ("file", st.st_mode, hashlib.sha1(f.read()).hexdigest())
            else:
                entries[rel] = ("other", st.st_mode)
    return entries


def nothing_lost(before: dict[str, tuple], after: dict[str, tuple], leaves: Sequence[str]) -> None:
    """What was there is unchanged, and nothing new is there but what matches ``leaves``."""
    changed = sorted(rel for rel, entry in before.items() if after.get(rel) != entry)
    assert not changed, f"changed or removed: {changed}"
    new = sorted(rel for rel in set(after) - set(before) if not any(fnmatch.fnmatch(rel, p) for p in leaves))
    assert not new, f"left behind: {new}"


def check_case(case: Case, env: Env, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    """Run ``case`` and check what the user gets (the module doc)."""
    values = {**FIXED, "tmp": str(env.tmp), "runs": str(env.runs)}
    values.update(case.setup(env))
    argv, names = fill(case.argv, values), fill(case.names, values)
    before, shared = snapshot(env.tmp), snapshot(env.runs)
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rc = run_cli(argv)
    out, err = capsys.readouterr()
    assert rc == case.code, f"exit {rc}, not {case.code}: {caplog.text}{err[-3000:]}"
    if case.usage:
        usage_line(caplog, err, *names)
    else:
        one_clear_line(caplog, err, *names, listed=case.listed)
    assert out == "", f"a refused command printed a result: {out[-2000:]}"
    nothing_lost(before, snapshot(env.tmp), case.leaves)
    missing = [path for path in fill(case.kept, values) if not (env.tmp / path).exists()]
    assert not missing, f"not kept: {missing}"
    if case.warns:
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(all(w in line for w in fill(case.warns, values)) for line in warnings), warnings
    if case.then:
        caplog.clear()
        rc = run_cli(fill(case.then, values))
        assert rc == 0, f"the fix exited {rc}: {caplog.text}{capsys.readouterr().err[-3000:]}"
    nothing_lost(shared, snapshot(env.runs), ())  # the checkpoints every case reads
