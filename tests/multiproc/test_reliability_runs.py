"""Bad inputs and interruptions on real runs (README "Reliability"): tiny CPU Cooper runs in
subprocesses, each in its own session (a Ctrl-C goes to its process group only, never to pytest).

* ``--resume none`` on a finished run folder is refused before any work, nothing in it changes;
  ``checkpoint.overwrite=true`` starts over with one history;
* a checkpoint that cannot be written (a file-size limit, as a full disk) stops the run with exit
  74 and one line naming the checkpoint; the converter's failed writes exit non-zero too;
* Ctrl-C during a checkpoint write: once, the run stops right after that checkpoint (exit 75);
  twice, it stops at once (exit 130) naming the checkpoint to resume from, kills megatron-core's
  writer processes and leaves nothing running; ``--resume auto`` then continues;
* prompts too long for the policy's context are skipped and counted (``data/skipped_too_long``);
* a collective that one rank never joins ends at the timeout with one line naming the rank, the
  call and the group (exit 69);
* a run folder belongs to one run: a second run on the same ``--out`` is refused with one line naming
  the first (every rank of a torchrun job, none left waiting), whose metrics stay its own; a resume
  that changes what is trained is refused naming the keys, and allowed as a new config version.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from cooper_mcore.exit_codes import EXIT_PEER_LOST
from tests.conftest import ROOT, WORKERS, _free_port, hold_lock, last_json

pytestmark = pytest.mark.multiproc
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
STOP_BOUND_S = 30  # from the Ctrl-C to the exit


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from cooper_mcore.demo.assets import build_tiny_assets

    root = tmp_path_factory.mktemp("assets")
    paths = build_tiny_assets(str(root), n_train=32, n_eval=4, sft_steps=0)
    rows = [json.loads(line) for line in open(paths["train"])]
    # two prompts whose rollouts cannot fit the policy's context (512 positions, 8 new tokens)
    rows += [{"id": f"long{i}", "question": "1+" * 300 + "1=", "answer": "301"} for i in range(2)]
    paths["train_long"] = str(root / "train_long.jsonl")
    with open(paths["train_long"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


def _args(assets, out, *overrides):
    return ["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out", str(out),
            f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"model.rm_ckpt={assets['rm_ckpt']}", f"data.train_path={assets['train']}",
            f"data.eval_path={assets['eval']}", "eval.every=0", "logging.wandb=false", "rollout.max_new_tokens=8",
            "rollout.group_size=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
            "checkpoint.resume=none", *overrides]


def _start(assets, out, *overrides, env=None, limit_file_bytes=None):
    """Start ``cooper train`` in a new session (its own process group); stderr to ``<out>.log``."""
    log = open(f"{out}.log", "w")

    def limit():
        if limit_file_bytes:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    proc = subprocess.Popen([sys.executable, "-m", "cooper_mcore", *_args(assets, out, *overrides)], cwd=ROOT,
                            env=dict(ENV, **(env or {})), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=limit)
    proc.log_path = f"{out}.log"
    return proc


def _run(assets, out, *overrides, **kw):
    proc = _start(assets, out, *overrides, **kw)
    try:
        rc = proc.wait(timeout=600)
    finally:
        _kill_group(proc)
    return rc, open(proc.log_path).read()


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _steps(out):
    return [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))]


def _errors(log):
    return [line for line in log.splitlines() if " ERROR cooper_mcore: " in line]


def test_resume_none_on_a_finished_run_is_refused_and_overwrite_starts_over(assets, tmp_path):
    out = tmp_path / "run"
    rc, log = _run(assets, out, "train.steps=2", "checkpoint.every=2")
    assert rc == 0, log[-3000:]
    before = {p: os.stat(os.path.join(d, p)).st_mtime_ns for d, _, files in os.walk(out) for p in files}
    metrics = open(out / "metrics.jsonl").read()

    rc, log = _run(assets, out, "train.steps=2", "checkpoint.every=2")  # --resume none again
    assert rc == 2, log[-3000:]
    (line,) = _errors(log)
    assert f"run folder '{out}' already holds a run (metrics.jsonl, checkpoints/)" in line
    assert "use --resume auto to continue it, another --out, or --overwrite (checkpoint.overwrite=true)" in line
    assert "Traceback" not in log and "megatron-core CPU mode" not in log  # refused before any work
    after = {p: os.stat(os.path.join(d, p)).st_mtime_ns for d, _, files in os.walk(out) for p in files}
    assert after == before and open(out / "metrics.jsonl").read() == metrics  # nothing touched

    rc, log = _run(assets, out, "train.steps=2", "checkpoint.every=2", "--overwrite")
    assert rc == 0, log[-3000:]
    assert "checkpoint.overwrite=true: deleted the previous run's metrics.jsonl, checkpoints" in log
    assert _steps(out) == [1, 2]  # one history, not 1, 2, 1, 2
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2"]


def test_a_checkpoint_that_cannot_be_written_stops_the_run_with_an_error(assets, tmp_path):
    out = tmp_path / "run"
    # the shard files (~700 kB) exceed the limit, the metrics and config files do not: EFBIG, as a full disk
    rc, log = _run(assets, out, "train.steps=3", "checkpoint.every=1", limit_file_bytes=300_000)
    assert rc == 74, log[-3000:]
    (line,) = _errors(log)
    assert f"stopping after step 1: could not write checkpoint {out}/checkpoints/step_1 (the policy model's " \
           "files): no space left on the device (or a quota or file-size limit; " in line
    assert "The newest complete checkpoint is none" in line and "--resume auto" in line
    assert "unexpected error" not in log and _steps(out) == [1]
    assert os.listdir(out / "checkpoints") == ["step_1.tmp"]  # incomplete, ignored by resume


def test_failed_conversion_writes_exit_non_zero_and_leave_nothing(assets, tmp_path):
    for args, out in ((["hf-to-mcore", "--hf-dir", assets["policy_hf"]], tmp_path / "mcore"),
                      (["mcore-to-hf", "--ckpt", assets["policy_ckpt"]], tmp_path / "hf")):
        r = subprocess.run([sys.executable, "-m", "cooper_mcore", "convert", *args, "--out", str(out)], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=600,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)))
        assert r.returncode != 0, r.stderr[-3000:]
        assert not out.exists() and os.listdir(tmp_path) == [p for p in os.listdir(tmp_path) if ".tmp" not in p]


def _wait_for(proc, pattern, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, open(proc.log_path).read()):
            return time.monotonic()
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in the log:\n{open(proc.log_path).read()[-3000:]}")


def _interrupted(assets, out, fault):
    """Run with a Ctrl-C injected by ``fault``; return (exit code, seconds from the Ctrl-C to the exit
    of the whole process group, log)."""
    proc = _start(assets, out, "train.steps=3", "checkpoint.every=1", env={"COOPER_FAULT": fault})
    try:
        sent = _wait_for(proc, r"fault injection: SIGINT")
        rc = proc.wait(timeout=120)
        while _group_alive(proc.pid) and time.monotonic() - sent < 120:  # children too: nothing left running
            time.sleep(0.1)
        return rc, time.monotonic() - sent, open(proc.log_path).read()
    finally:
        _kill_group(proc)


def test_ctrl_c_during_a_checkpoint_write_stops_after_it_and_resumes(assets, tmp_path):
    out = tmp_path / "run"
    rc, seconds, log = _interrupted(assets, out, "ckpt_files@2/INT")  # to the process group, writers included
    assert rc == 75, log[-3000:]
    assert seconds < STOP_BOUND_S, seconds
    (line,) = _errors(log)
    assert f"stopped by Ctrl-C (SIGINT) after step 2: checkpoint {out}/checkpoints/step_2 written" in line
    assert "--resume auto" in line and "Traceback" not in log
    rc, log = _run(assets, out, "train.steps=3", "checkpoint.every=1", "checkpoint.resume=auto")
    assert rc == 0, log[-3000:]
    assert f"resumed from {out}/checkpoints/step_2 (step 2)" in log and _steps(out) == [1, 2, 3]


def test_ctrl_c_twice_stops_at_once_and_the_half_written_checkpoint_is_not_resumed(assets, tmp_path):
    out = tmp_path / "run"
    rc, seconds, log = _interrupted(assets, out, "ckpt_policy@2/INT2")  # inside step 2's checkpoint write
    assert rc == 130, log[-3000:]
    assert seconds < STOP_BOUND_S, seconds  # the process and every child of it
    (line,) = _errors(log)
    assert "interrupted (Ctrl-C twice) with 2 steps done: stopped at once" in line
    assert f"that checkpoint is {out}/checkpoints/step_1: run the same command with --resume auto" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2.tmp"]
    rc, log = _run(assets, out, "train.steps=3", "checkpoint.every=1", "checkpoint.resume=auto")
    assert rc == 0, log[-3000:]
    assert f"resumed from {out}/checkpoints/step_1 (step 1)" in log
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_3"]


def test_prompts_too_long_for_the_policy_are_skipped_and_counted(assets, tmp_path):
    out = tmp_path / "run"
    rc, log = _run(assets, out, "train.steps=1", f"data.train_path={assets['train_long']}")
    assert rc == 0, log[-3000:]
    assert re.search(r"skipping 2 of 34 prompts longer than 504 tokens .*first ids: long0, long1", log), log[-3000:]
    (m,) = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert m["data/skipped_too_long"] == 2


def test_a_collective_timeout_is_one_line_naming_rank_call_and_group(tmp_path):
    env = dict(ENV, COOPER_TEST_DONE=str(tmp_path / "done"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(WORKERS / "collective_timeout.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    got = last_json(r.stdout)
    assert got["rc"] == EXIT_PEER_LOST and got["seconds"] < 60, got
    (line,) = got["errors"]
    assert line.startswith("rank 0 of 2: torch.distributed.all_reduce over ranks [0, 1] timed out, called from "
                           "cooper_mcore/collectives.py"), line
    assert "(any_rank)" in line and "parallel.timeout_minutes" in line and "Timed out waiting 5000ms" in line
    assert "unexpected error" not in r.stderr


# --------------------------------------------------------------------------- one run per folder


def _wait_for_holder(lock, proc, timeout=300):
    """Wait until ``proc`` has written itself into the lock file ``lock``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(open(lock).read())["pid"] == proc.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{lock} never named pid {proc.pid}:\n{open(proc.log_path).read()[-3000:]}")


def _error_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_a_run_folder_belongs_to_one_run_and_a_resume_is_the_run_it_resumes(assets, tmp_path, caplog):
    """Measured before the lock: two runs 2 s apart on one --out, the first ended with the second's rows in
    its metrics (steps 1, 1, 2), the second died on the first's half-written checkpoint (exit 74); a resume
    with reward.mode=rule continued silently and rewrote config.yaml as a rule run."""
    from cooper_mcore.cli import main as cli_main
    from cooper_mcore.config.versions import read_record

    out = tmp_path / "run"
    first = _start(assets, out, "train.steps=2", "checkpoint.every=1")
    try:
        _wait_for_holder(out / "run.lock", first)
        with caplog.at_level(logging.ERROR):  # the same job again (as a requeue would: --resume auto), in-process
            assert cli_main(_args(assets, out, "train.steps=2", "checkpoint.every=1", "checkpoint.resume=auto")) == 2
        rc = first.wait(timeout=600)
    finally:
        _kill_group(first)
    assert rc == 0, open(first.log_path).read()[-3000:]
    (line,) = _error_lines(caplog)
    assert line.startswith(f"run folder '{out}' is in use by another run: pid {first.pid} on host "
                           f"{socket.gethostname()} since "), line
    assert _steps(out) == [1, 2] and sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]
    record = (out / "config.yaml").read_text()

    caplog.clear()
    resume = ("train.steps=3", "checkpoint.every=1", "checkpoint.resume=auto", "reward.mode=rule")
    assert cli_main(_args(assets, out, *resume)) == 2
    (line,) = _error_lines(caplog)
    assert 'differ in what it trains: reward.mode: "cooper" -> "rule". ' in line and "--allow-config-change" in line
    assert _steps(out) == [1, 2] and (out / "config.yaml").read_text() == record  # nothing written

    assert cli_main([*_args(assets, out, *resume), "--allow-config-change"]) == 0
    assert _steps(out) == [1, 2, 3]
    versions = read_record(str(out / "config.yaml")).versions
    assert [(v.version, v.step, v.allowed) for v in versions] == [(1, 0, False), (2, 2, True)]
    assert versions[1].changed == ['reward.mode: "cooper" -> "rule"', "train.steps: 2 -> 3"]
    assert versions[0].config["reward"]["mode"] == "cooper" and versions[1].config["reward"]["mode"] == "rule"
    assert not (out / "run.lock").exists()


def test_every_rank_of_a_refused_torchrun_job_stops_with_the_holders_line(assets, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    holder = hold_lock(str(out / "run.lock"))
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               "--log-dir", str(logs), "--redirects", "3", "-m", "cooper_mcore",
               *_args(assets, out, "train.prompts_per_step=4")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode != 0
    ranks = sorted(glob.glob(str(logs / "**" / "stderr.log"), recursive=True))
    assert len(ranks) == 2, r.stderr[-3000:]
    texts = [open(path).read() for path in ranks]
    line = f"run folder '{out}' is in use by another run: pid {holder.pid} on host"
    # rank 0 met the lock; rank 1 learned it from rank 0 instead of waiting for it; both refuse with exit 2, and
    # the line every rank raises is printed once per node
    assert sum(text.count(line) for text in texts) == 1, texts
    assert all("Traceback" not in text and "timed out" not in text for text in texts)
    assert "failed (exitcode: 2)" in r.stderr, r.stderr[-3000:]  # the first rank out; torchrun then stops the other
    assert os.listdir(out) == ["run.lock"]  # nothing written
