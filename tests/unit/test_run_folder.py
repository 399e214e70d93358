"""A run folder belongs to one run, and a resume is the run it resumes.

* the folder lock (:mod:`cooper_mcore.run_lock`): a second process is refused with one line naming
  the holder (pid, host, since when); the lock of a SIGKILLed holder is free at once and taken over;
  a record of another host refreshed lately is refused (file locks that do not reach across nodes),
  a stale one taken over; one process cannot hold a folder twice;
* :func:`cooper_mcore.job.hold_run_folder` in a world: the check's result reaches the caller, its
  error is raised and the lock released;
* the config record (:mod:`cooper_mcore.config.versions`) and what a Cooper resume may change
  (:mod:`cooper_mcore.rl.run_folder`): a change of what is trained is refused naming each key (old ->
  new), allowed with the flag as a new version; a folder written before versions reads as version 1;
* a lock removes the folders it created for its file when they stayed empty (a refused run leaves no
  ``--out``), and keeps one the run wrote into.

What ``cooper train``, ``sft`` and ``train-rm`` tell the user about a folder another run holds, or a
resume that changes what is trained, are cases of the bad-input tier (``tests/badinput/run_folders.py``);
the real runs are in tests/multiproc/test_reliability_runs.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cooper_mcore.config.schema import CooperConfig, describe, load_config, save_config, to_dict
from cooper_mcore.config.versions import ConfigRecord, config_changes, read_record, write_record
from cooper_mcore.rl.run_folder import LAUNCH_KEYS, MAY_CHANGE, may_change, open_run_folder, record_config
from cooper_mcore.run_lock import STALE_S, FolderInUse, RunLock
from tests.conftest import ROOT, hold_lock


def _holder_line(pid: int) -> str:
    return f"is in use by another run: pid {pid} on host {socket.gethostname()} since "


def test_a_second_process_is_refused_and_a_killed_holders_lock_is_taken_over(tmp_path, caplog):
    path = str(tmp_path / "run" / "run.lock")
    holder = hold_lock(path)
    try:
        with pytest.raises(FolderInUse) as refused:
            RunLock(path, "run folder 'run'").acquire()
        line = str(refused.value)
        assert line.startswith("run folder 'run' " + _holder_line(holder.pid)) and "\n" not in line
        assert f"use another --out (lock file {path}, with its command)" in line
        started = json.loads(open(path).read())["started"]  # ISO 8601 with the offset, as the line says it
        assert f"since {started};" in line and time.time() - _epoch(started) < 60
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(path, "run folder 'run'")
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.run_lock"):
        lock.acquire()  # the kernel dropped the dead holder's lock; its record is still in the file
    try:
        assert f"taking over from a run that is gone: pid {holder.pid} on host" in caplog.text
        record = json.loads(open(path).read())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert record["command"] == " ".join(sys.argv)
    finally:
        lock.release()
    assert not os.path.exists(path)  # a clean release leaves nothing behind


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def _record(path, host: str, pid: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "started": "2026-11-29T10:00:00+00:00", "command": "cooper train"}, f)


def test_a_fresh_record_of_another_host_is_refused_and_a_stale_one_taken_over(tmp_path):
    path = str(tmp_path / "run.lock")
    _record(path, "node-7", 4242)  # a holder the lock cannot see: locks that do not reach across nodes
    with pytest.raises(FolderInUse, match=r"^run folder 'r' is in use by another run: pid 4242 on host node-7 since "
                                          r"2026-11-29T10:00:00\+00:00, its lock file .* refreshed \d+ s ago "
                                          r"\(file locks may not reach across the nodes"):
        RunLock(path, "run folder 'r'").acquire()
    old = time.time() - STALE_S - 1
    os.utime(path, (old, old))  # no refresh for longer than STALE_S: that run is gone
    with RunLock(path, "run folder 'r'"):
        assert json.loads(open(path).read())["pid"] == os.getpid()


def test_without_file_locks_a_live_holder_of_this_host_is_still_refused(tmp_path, monkeypatch, caplog):
    import cooper_mcore.run_lock as run_lock

    def no_locks(fd, op):
        raise OSError(run_lock.errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "lockf", no_locks)  # NFS without lockd
    path = str(tmp_path / "run.lock")
    _record(path, socket.gethostname(), os.getppid())  # a live process of this host
    with pytest.raises(FolderInUse, match=f"pid {os.getppid()} on host"):
        RunLock(path, "run folder 'r'").acquire()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record(path, socket.gethostname(), gone.pid)  # a process that has ended
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.run_lock"), RunLock(path, "run folder 'r'"):
        assert "does not lock files" in caplog.text and "taking over" in caplog.text


def test_one_process_cannot_hold_a_folder_twice(tmp_path):
    path = str(tmp_path / "run.lock")
    with RunLock(path, "run folder 'r'"):
        with pytest.raises(FolderInUse, match="already used by this process"):
            RunLock(str(tmp_path / "." / "run.lock"), "run folder 'r'").acquire()
    with RunLock(path, "run folder 'r'"):  # released: free again
        pass


def test_a_lock_removes_the_folders_it_made_when_they_stayed_empty(tmp_path):
    with RunLock(str(tmp_path / "runs" / "new" / "run.lock"), "run folder 'new'"):
        assert (tmp_path / "runs" / "new").is_dir()
    assert os.listdir(tmp_path) == []  # both folders it made: the run wrote nothing
    with RunLock(str(tmp_path / "runs" / "new" / "run.lock"), "run folder 'new'"):
        (tmp_path / "runs" / "new" / "metrics.jsonl").write_text("")
    assert os.listdir(tmp_path / "runs" / "new") == ["metrics.jsonl"]  # what the run wrote stays, with its folders
    with RunLock(str(tmp_path / "run.lock"), "run folder 'x'"):  # a folder that was there stays
        pass
    assert os.listdir(tmp_path) == ["runs"]


def test_hold_run_folder_hands_over_the_check_and_releases_on_errors(world, tmp_path):
    from cooper_mcore.job import hold_run_folder

    out = tmp_path / "run"
    with hold_run_folder(str(out), lambda: {"checked": True}) as found:
        assert found == {"checked": True} and (out / "run.lock").is_file()
    assert not (out / "run.lock").exists()

    def refuse():
        raise FileExistsError("out_dir is not empty")

    with pytest.raises(FileExistsError, match="out_dir is not empty"):
        with hold_run_folder(str(out), refuse):
            pytest.fail("a refused folder's block ran")
    assert not (out / "run.lock").exists()  # released: the next run may try
    lock_beside = tmp_path / "policy.lock"
    with hold_run_folder(str(tmp_path / "policy"), lock_file=str(lock_beside)):
        assert lock_beside.is_file() and not (tmp_path / "policy").exists()


# --------------------------------------------------------------------------- the config record


def _cfg(out, *overrides: str) -> CooperConfig:
    return load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), [f"out={out}", *overrides])


def test_every_setting_a_resume_may_change_is_a_setting_of_a_cooper_run():
    keys = [k for k, _, _ in describe(CooperConfig())]
    for free in MAY_CHANGE + LAUNCH_KEYS:  # a setting, or a section ("name.") of some
        assert free in keys or (free.endswith(".") and any(k.startswith(free) for k in keys)), free
    assert may_change("train.steps") and may_change("offload.release_engine") and may_change("logging.wandb")
    assert not may_change("reward.mode") and not may_change("model.init") and not may_change("train.seed")
    assert not may_change("train.steps_x") and not may_change("optim.lr") and not may_change("rm.optim.lr")


def test_the_record_keeps_versions_and_reads_as_a_preset(tmp_path):
    path = str(tmp_path / "config.yaml")
    first = to_dict(_cfg(tmp_path))
    record = ConfigRecord.start(first)
    write_record(path, record)
    assert read_record(path) == record  # every value comes back as it was written (floats, nulls, lists)
    second = to_dict(_cfg(tmp_path, "reward.mode=rule", "optim.lr=2e-6", "rollout.stop=[x]"))
    changes = config_changes(record.newest.config, second)
    assert [str(c) for c in changes] == ['rollout.stop: [] -> ["x"]', 'reward.mode: "cooper" -> "rule"',
                                         "optim.lr: 0.0001 -> 2e-06"]
    write_record(path, record.then(second, 7, changes, allowed=True))
    back = read_record(path)
    assert [(v.version, v.step, v.allowed) for v in back.versions] == [(1, 0, False), (2, 7, True)]
    assert back.newest.changed[1] == 'reward.mode: "cooper" -> "rule"'
    assert load_config(path).reward.mode.value == "rule"  # `cooper train --config <out>/config.yaml`: the newest


def test_a_folder_from_before_versions_reads_as_version_one(tmp_path):
    path = str(tmp_path / "config.yaml")
    save_config(_cfg(tmp_path), path)  # what a run wrote before the record had versions
    record = read_record(path)
    assert [(v.version, v.step) for v in record.versions] == [(1, 0)]
    assert config_changes(record.newest.config, to_dict(_cfg(tmp_path))) == []
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="bad.yaml is not a config record"):
        read_record(str(tmp_path / "bad.yaml"))


def _with_history(out) -> None:  # a run of tiny_cpu.yaml's 8 steps, stopped after 2
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def test_a_resume_that_changes_what_is_trained_is_refused_unless_allowed(tmp_path, caplog):
    out = tmp_path / "run"
    _with_history(out)
    save_config(_cfg(out), str(out / "config.yaml"))  # an old folder: its config as version 1
    before = (out / "config.yaml").read_text()
    changed = ["checkpoint.resume=auto", "reward.mode=rule", "model.init=random", "train.steps=12"]
    with pytest.raises(ValueError) as refused:
        open_run_folder(_cfg(out, *changed))
    line = str(refused.value)
    assert line.startswith(f"run folder '{out}' holds a run whose settings (config.yaml, version 1) differ in what "
                           'it trains: model.init: "checkpoint" -> "random"; reward.mode: "cooper" -> "rule". ')
    assert "train.steps" not in line and "\n" not in line
    assert "--allow-config-change (checkpoint.allow_config_change=true) to continue with these as version 2" in line
    assert (out / "config.yaml").read_text() == before  # nothing written

    start = open_run_folder(_cfg(out, "checkpoint.resume=auto", "train.steps=12"))  # free: a version, no consent
    assert [str(c) for c in start.changes] == ["train.steps: 8 -> 12"] and not start.allowed
    start = open_run_folder(_cfg(out, *changed, "checkpoint.allow_config_change=true"))
    assert start.allowed and len(start.changes) == 3
    with caplog.at_level(logging.WARNING):
        record_config(_cfg(out, *changed, "checkpoint.allow_config_change=true"), start, 2)
    assert "settings version 2 from step 2 (allowed by checkpoint.allow_config_change)" in caplog.text
    record = read_record(str(out / "config.yaml"))
    assert [(v.version, v.step, v.allowed) for v in record.versions] == [(1, 0, False), (2, 2, True)]
    assert record.newest.config["reward"]["mode"] == "rule"
    assert record.newest.config["checkpoint"]["allow_config_change"] is False  # a consent is not a setting
    assert open_run_folder(_cfg(out, *changed)).changes == []  # the new version is now the one compared


def test_the_same_settings_leave_the_record_and_a_new_folder_starts_one(tmp_path):
    out = tmp_path / "run"
    start = open_run_folder(_cfg(out))
    assert start.record is None
    record_config(_cfg(out), start, 0)
    written = (out / "config.yaml").read_text()
    _with_history(out)
    start = open_run_folder(_cfg(out, "checkpoint.resume=auto", "checkpoint.every=5", "offload.policy_params=true"))
    assert [c.key for c in start.changes] == ["offload.policy_params", "checkpoint.every"]
    again = open_run_folder(_cfg(out, "checkpoint.resume=auto"))  # only the launch's own settings differ
    assert again.changes == []
    record_config(_cfg(out, "checkpoint.resume=auto"), again, 2)
    assert (out / "config.yaml").read_text() == written
