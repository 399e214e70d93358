"""Tests for cooper_mcore.metrics (JSONL/wandb logger, timers, progress bar, reduction) and the
reward-hacking detector in cooper_mcore.hacking_detector. wandb runs offline in a tmp dir, never online."""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cooper_mcore import metrics as M
from cooper_mcore.hacking_detector import RewardHackingDetector, reward_rule_gap
from cooper_mcore.metrics import (
    MetricsLogger,
    PhaseTimer,
    ProgressBar,
    read_metrics,
    reduce_metrics,
    resolve_wandb_mode,
)
from cooper_mcore.redaction import REDACTED, redact

SECRET = "sk-live-0123456789abcdef"


@pytest.fixture
def no_wandb_creds(monkeypatch, tmp_path):
    """An environment with no wandb credentials, mode or netrc; wandb writes under tmp_path."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path


# ----------------------------------------------------------------------------- redaction / mode


def test_redact_nested_keys_case_insensitive_without_mutating():
    cfg = {"api_key": SECRET, "HF_TOKEN": "hf_x", "lr": 1e-6, "max_tokens": 512, "tokenizer": "t",
           "api_key_env": "OPENAI_API_KEY",
           "rm": {"openai": {"Password": "pw", "base_url": "http://x"}, "layers": 2},
           "hosts": [{"client_secret": "s", "name": "a"}, "plain"], "pair": ({"auth_key": 1}, 2)}
    out = redact(cfg)
    assert out == {"api_key": REDACTED, "HF_TOKEN": REDACTED, "lr": 1e-6, "max_tokens": 512, "tokenizer": "t",
                   "api_key_env": "OPENAI_API_KEY",
                   "rm": {"openai": {"Password": REDACTED, "base_url": "http://x"}, "layers": 2},
                   "hosts": [{"client_secret": REDACTED, "name": "a"}, "plain"], "pair": ({"auth_key": REDACTED}, 2)}
    assert cfg["api_key"] == SECRET and cfg["rm"]["openai"]["Password"] == "pw"  # input untouched


def test_resolve_wandb_mode(no_wandb_creds, monkeypatch):
    assert resolve_wandb_mode() == "offline"
    assert resolve_wandb_mode(use_wandb=False) == "disabled"
    netrc_file = no_wandb_creds / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert resolve_wandb_mode() == "online"  # `wandb login` wrote a netrc entry
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert resolve_wandb_mode() == "offline"  # the netrc entry is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode() == "disabled"  # an explicit WANDB_MODE wins
    assert resolve_wandb_mode(use_wandb=False) == "disabled"


# ----------------------------------------------------------------------------- JSONL logger


def test_log_writes_sorted_float_lines_with_nulls(tmp_path):
    import numpy as np

    with MetricsLogger(str(tmp_path), use_wandb=False) as log:
        log.log(1, {"z": 1, "a": 0.5, "nan": float("nan"), "inf": -math.inf, "t": torch.tensor([2.5]),
                    "np": np.float32(0.25), "none": None, "step": 1})
        log.log(2, {"a": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith('{"step": 1, "a": 0.5,')
    first = json.loads(lines[0])
    assert list(first) == ["step", "a", "inf", "nan", "none", "np", "t", "z"]
    assert first["nan"] is None and first["inf"] is None and first["none"] is None
    assert first["z"] == 1.0 and isinstance(first["z"], float) and first["t"] == 2.5 and first["np"] == 0.25
    assert read_metrics(str(tmp_path)) == [first, {"step": 2, "a": 0.75}]


def test_each_line_is_fsynced_before_log_returns(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(M.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    log = MetricsLogger(str(tmp_path), use_wandb=False)
    for step in range(3):
        log.log(step, {"x": step})
        # visible to another reader while the logger is still open
        assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == list(range(step + 1))
    assert len(synced) == 3
    log.close()
    log.close()  # idempotent
    with pytest.raises(RuntimeError):
        log.log(3, {"x": 3})


@pytest.mark.parametrize("step, metrics", [
    (-1, {"x": 1.0}), ("3", {"x": 1.0}), (True, {"x": 1.0}), (1.5, {"x": 1.0}),
    (1, {"x": "high"}), (1, {"x": torch.ones(2)}), (1, {3: 1.0}), (1, {"step": 2, "x": 1.0}), (1, {"x": [1.0]}),
])
def test_log_rejects_bad_input(tmp_path, step, metrics):
    with MetricsLogger(str(tmp_path), use_wandb=False) as log:
        with pytest.raises(ValueError):
            log.log(step, metrics)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_bad_config_rejected(tmp_path):
    with pytest.raises(ValueError):
        MetricsLogger(str(tmp_path), config=["not", "a", "dict"], use_wandb=False)


def test_non_main_rank_is_a_noop(tmp_path, no_wandb_creds, monkeypatch):
    import wandb

    monkeypatch.setattr(wandb, "init", lambda **kw: pytest.fail("wandb.init on a non-main rank"))
    out = tmp_path / "run"
    with MetricsLogger(str(out), config={"a": 1}, is_main=False) as log:
        log.log(1, {"x": 1.0})
        assert log.wandb_run is None
    assert not out.exists()


def test_config_kept_redacted_and_written_once(tmp_path):
    config = {"openai_api_key": SECRET, "nested": {"token": SECRET}, "lr": 0.1}
    with MetricsLogger(str(tmp_path), config=config, use_wandb=False) as log:
        assert log.config == {"openai_api_key": REDACTED, "nested": {"token": REDACTED}, "lr": 0.1}  # wandb's
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # the run folder's record of it is config.yaml, the job's


def test_read_metrics_tolerates_truncated_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert read_metrics(str(path)) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"\n{"step": 3, "a": 3.0}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(str(path))
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError):
        read_metrics(str(path))


def test_reopening_after_a_crash_drops_the_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.')  # killed mid-write
    with MetricsLogger(str(tmp_path), use_wandb=False) as log:
        log.log(2, {"a": 2.5})
    assert path.read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.5}\n'


# ----------------------------------------------------------------------------- wandb


def _all_bytes_under(root) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_wandb_offline_without_credentials_and_config_redacted(tmp_path, no_wandb_creds, capfd, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="cooper_mcore.metrics"):
        with MetricsLogger(str(out), run_name="t1", config={"policy": {"api_key": SECRET}, "lr": 1e-6}) as log:
            assert log.wandb_mode == "offline"
            assert log.wandb_run is not None
            log.log(1, {"reward/mean": 0.5, "rule/acc": float("nan")})
            log.log(2, {"reward/mean": 0.6, "rule/acc": 0.5})
    assert log.wandb_run is None
    runs = list((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # wandb's own banner and summary (~30 lines) silenced; one log line says where the offline run is
    printed = capfd.readouterr()
    assert "wandb" not in printed.out + printed.err, printed
    said = [r.getMessage() for r in caplog.records if r.name == "cooper_mcore.metrics"]
    assert said == [f"wandb offline: the run is in {runs[0]} (`wandb sync {runs[0]}` uploads it)"]
    # wandb-core may still be flushing the run file after finish() returns: wait for it
    deadline, record = time.monotonic() + 10, b""
    while time.monotonic() < deadline:
        record = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
        if REDACTED.encode() in record and b"reward/mean" in record:
            break
        time.sleep(0.05)
    assert REDACTED.encode() in record and b"reward/mean" in record
    assert SECRET.encode() not in _all_bytes_under(tmp_path)
    assert len(read_metrics(str(out))) == 2


class _FakeRun:
    name = "fake"

    def __init__(self, fail_log: bool):
        self.fail_log, self.logged, self.finished = fail_log, [], 0

    def log(self, data, step):
        if self.fail_log:
            raise OSError("wandb service died")
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished += 1


def test_wandb_receives_redacted_config_and_steps(tmp_path, no_wandb_creds, monkeypatch):
    import wandb

    calls, run = [], _FakeRun(fail_log=False)
    monkeypatch.setattr(wandb, "init", lambda **kw: (calls.append(kw), run)[1])
    with MetricsLogger(str(tmp_path), run_name="r", config={"Secret_Sauce": SECRET, "a": 1},
                       wandb_project="proj", wandb_init_kwargs={"tags": ["x"]}) as log:
        log.log(7, {"kl": 0.1, "nan": float("nan")})
    (kw,) = calls
    assert kw["config"] == {"Secret_Sauce": REDACTED, "a": 1}
    assert (kw["project"], kw["name"], kw["mode"], kw["tags"]) == ("proj", "r", "offline", ["x"])
    assert run.logged[0][0] == 7 and run.logged[0][1]["kl"] == 0.1 and math.isnan(run.logged[0][1]["nan"])
    assert run.finished == 1


def test_wandb_init_failure_warns_and_continues(tmp_path, no_wandb_creds, monkeypatch, caplog):
    import wandb

    def boom(**kw):
        raise RuntimeError("no wandb-core")

    monkeypatch.setattr(wandb, "init", boom)
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.metrics"):
        with MetricsLogger(str(tmp_path)) as log:
            log.log(1, {"x": 1.0})
    assert log.wandb_run is None
    assert any("wandb init failed" in r.getMessage() for r in caplog.records)
    assert read_metrics(str(tmp_path)) == [{"step": 1, "x": 1.0}]


def test_wandb_log_failure_warns_once_and_continues(tmp_path, no_wandb_creds, monkeypatch, caplog):
    import wandb

    run = _FakeRun(fail_log=True)
    monkeypatch.setattr(wandb, "init", lambda **kw: run)
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.metrics"):
        with MetricsLogger(str(tmp_path)) as log:
            log.log(1, {"x": 1.0})
            log.log(2, {"x": 2.0})
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    assert sum("wandb log failed" in r.getMessage() for r in caplog.records) == 1
    assert run.finished == 1


# ----------------------------------------------------------------------------- PhaseTimer


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_phase_timer_accumulates_nests_and_resets():
    clock, events = _Clock(), []
    timer = PhaseTimer(sync=lambda: events.append(("sync", clock.t)), clock=clock)
    with timer.phase("rollout"):
        clock.t += 2.0
    with timer.phase("policy_update"):
        clock.t += 1.0
        with timer.phase("logprobs"):  # nested: counted in both, once in time/step
            clock.t += 0.5
        clock.t += 0.25
    with timer.phase("rollout"):  # second visit accumulates
        clock.t += 1.0
    clock.t += 10.0  # outside any phase: not counted
    out = timer.pop()
    assert out == {"time/rollout": 3.0, "time/policy_update": 1.75, "time/logprobs": 0.5, "time/step": 4.75}
    assert len(events) == 8  # entry and exit of each of the 4 phases
    assert timer.pop() == {"time/step": 0.0}


def test_phase_timer_records_on_exception_and_validates():
    clock = _Clock()
    timer = PhaseTimer(clock=clock)
    with pytest.raises(KeyError):
        with timer.phase("rm_score"):
            clock.t += 1.5
            raise KeyError("x")
    assert timer.active == []
    with timer.phase("a"):
        with pytest.raises(ValueError):
            with timer.phase("a"):
                pass
        with pytest.raises(RuntimeError):
            timer.pop()
    for bad in ("", "step", None):
        with pytest.raises(ValueError):
            with timer.phase(bad):
                pass
    assert timer.pop() == {"time/rm_score": 1.5, "time/a": 0.0, "time/step": 1.5}


def test_phase_timer_real_clock():
    timer = PhaseTimer()
    with timer.phase("weight_sync"):
        time.sleep(0.02)
    out = timer.pop()
    assert 0.02 <= out["time/weight_sync"] == out["time/step"] < 1.0


# ----------------------------------------------------------------------------- ProgressBar


def test_progress_bar_shows_chosen_metrics_on_stderr(capsys):
    bar = ProgressBar(10, start_step=2, is_main=True)
    bar.update(3, {"reward/mean": 0.5, "rule/acc": 0.25, "kl": 1.5})
    bar.update(4, {"reward/mean": 0.625, "eval/acc": 0.75})  # rule/acc keeps its last value
    bar.close()
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    final = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert "4/10" in final
    assert "reward/mean=0.625, rule/acc=0.25, eval/acc=0.75" in final
    assert "kl" not in final
    assert "<" in final  # elapsed<remaining: the ETA


def test_progress_bar_clamps_and_eta_counts_only_new_steps(capsys):
    bar = ProgressBar(5, start_step=3, is_main=True)
    assert bar._bar.format_dict["initial"] == 3
    bar.update(99, {})
    assert bar._bar.n == 5
    bar.close()
    with pytest.raises(ValueError):
        ProgressBar(3, start_step=4)


def test_progress_bar_disabled(capsys, monkeypatch):
    for bar in (ProgressBar(5, enabled=False), ProgressBar(5, is_main=False)):
        bar.update(1, {"reward/mean": 1.0})
        bar.close()
        assert not bar.enabled
    monkeypatch.setenv("RANK", "1")
    assert not ProgressBar(5).enabled  # auto-detected non-main rank
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- hacking detector


def _noise(rng: random.Random, amp: float) -> float:
    return rng.uniform(-amp, amp)


def test_clean_rising_accuracy_run_never_fires():
    rng, det = random.Random(0), RewardHackingDetector()
    for s in range(200):  # reward and accuracy both climb: healthy co-optimisation
        assert det.update(s, 0.3 + 0.5 * s / 199 + _noise(rng, 0.01), 0.4 + 0.3 * s / 199 + _noise(rng, 0.01)) is None
    assert det.fired_steps == [] and not det.should_stop


def test_paper_static_rm_collapse_fires_within_window(caplog):
    rng, det = random.Random(1), RewardHackingDetector(window=10)
    start, msgs = 40, []
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.hacking_detector"):
        for s in range(100):
            k = min(max(s - start, 0), 9) / 9  # 0 before the collapse, 1 after 10 steps of it
            msg = det.update(s, 0.45 + 0.48 * k + _noise(rng, 0.005), 0.58 - 0.08 * k + _noise(rng, 0.005))
            if msg:
                msgs.append((s, msg))
    assert msgs and start < msgs[0][0] <= start + 9
    assert "reward hacking" in msgs[0][1] and f"step {msgs[0][0]}" in msgs[0][1]
    assert any("reward hacking" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert det.last_acc_change is not None and not det.should_stop  # action="warn"


def test_sustained_hacking_respects_cooldown():
    det = RewardHackingDetector(window=10)
    for s in range(60):
        det.update(s, 0.2 + 0.02 * s, 0.8 - 0.01 * s)
    assert det.fired_steps == [9, 19, 29, 39, 49, 59]  # once per window, not every step


@pytest.mark.parametrize("reward, acc, amp", [
    (lambda s: 0.6, lambda s: 0.55, 0.015),  # flat with noise only
    (lambda s: 0.3 + 0.003 * s, lambda s: 0.7 - 0.003 * s, 0.005),  # diverging, 0.027/window (+ noise) < 0.05
    (lambda s: 0.2 + 0.05 * s, lambda s: 0.55, 0.015),  # reward soars, accuracy holds
    (lambda s: 0.6, lambda s: 0.9 - 0.01 * s, 0.015),  # accuracy falls, reward does not rise
])
def test_below_threshold_or_one_sided_does_not_fire(reward, acc, amp):
    # noise within +-amp moves a fitted change over a window of 10 by at most 2.73 * amp, so
    # trend + 2.73 * amp < 0.05 can never fire whatever the noise draws
    rng, det = random.Random(2), RewardHackingDetector()
    for s in range(80):
        assert det.update(s, reward(s) + _noise(rng, amp), acc(s) + _noise(rng, amp)) is None
    assert det.last_reward_change is not None  # the criterion was evaluated


def test_stop_action_and_non_finite_inputs():
    det = RewardHackingDetector(window=4, min_reward_rise=0.1, min_acc_drop=0.1, action="stop")
    assert det.update(0, float("nan"), 0.5) is None
    for s, (r, a) in enumerate([(0.4, 0.6), (0.5, 0.55), (0.6, float("inf"))]):
        assert det.update(s, r, a) is None and not det.should_stop
    msg = det.update(4, 0.7, 0.5)  # only 3 finite points so far: window not full
    assert msg is None
    msg = det.update(5, 0.8, 0.45)
    assert msg and "stopping" in msg and det.should_stop and det.fired_steps == [5]


@pytest.mark.parametrize("kwargs", [
    {"window": 2}, {"window": 10.0}, {"min_reward_rise": 0}, {"min_acc_drop": -0.1},
    {"min_acc_drop": float("nan")}, {"action": "halt"},
])
def test_detector_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        RewardHackingDetector(**kwargs)


def test_reward_rule_gap():
    assert reward_rule_gap(0.93, 0.50) == pytest.approx(0.43)


# ----------------------------------------------------------------------------- reduce_metrics


def test_reduce_metrics_uninitialised_is_identity():
    assert not dist.is_initialized()
    out = reduce_metrics({"b": torch.tensor(2.0), "a": 1, "c": float("nan")}, sum_keys=["a"])
    assert list(out) == ["a", "b", "c"] and out["a"] == 1.0 and out["b"] == 2.0 and math.isnan(out["c"])
    assert all(type(v) is float for v in out.values())
    with pytest.raises(ValueError):
        reduce_metrics({"a": 1.0}, op="median")
    with pytest.raises(ValueError):
        reduce_metrics({"a": 1.0}, sum_keys=["a"], max_keys=["a"])
    with pytest.raises(ValueError):
        reduce_metrics({"a": "x"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reduce_metrics_gloo_world_of_one(monkeypatch):
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: (calls.append(kw["op"]), real(t, **kw))[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        out = reduce_metrics({"time/rollout": 2.0, "pairs/valid": torch.tensor(3), "reward/mean": 0.5},
                             sum_keys=["pairs/valid"], max_keys=["time/rollout"])
    finally:
        dist.destroy_process_group()
    assert out == {"pairs/valid": 3.0, "reward/mean": 0.5, "time/rollout": 2.0}
    assert calls == []  # one rank: nothing to reduce, no collective issued (the ops: two-rank test below)


def _rank_worker(rank: int, port: int, q) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        out = reduce_metrics({"reward/mean": 0.2 + 0.4 * rank, "pairs/valid": 3 + rank, "time/step": 1.0 + rank},
                             sum_keys=["pairs/valid"], max_keys=["time/step"])
        try:
            reduce_metrics({("a" if rank == 0 else "b"): 1.0})
            err = None
        except ValueError as e:
            err = str(e)
        q.put((rank, out, err))
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the parent
        q.put((rank, repr(e), None))


@pytest.mark.skipif(sys.platform != "linux", reason="uses fork")
def test_reduce_metrics_two_gloo_ranks():
    ctx = mp.get_context("fork")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert [r[0] for r in results] == [0, 1]
    for _rank, out, err in results:
        assert isinstance(out, dict), out
        assert out == pytest.approx({"pairs/valid": 7.0, "reward/mean": 0.4, "time/step": 2.0})
        assert err and "differ between ranks" in err


def test_redact_keeps_data_field_selectors_and_saved_config_loads_back(tmp_path):
    """`answer_key: answer` names a data field, not a secret: a saved run config must load back as it was."""
    from cooper_mcore.config.schema import load_config, save_config

    assert redact({"answer_key": "answer", "question_key": "q", "api_key": "sk-x"}) == {
        "answer_key": "answer", "question_key": "q", "api_key": REDACTED}
    cfg = load_config(None, ["data.answer_key=solution", "data.question_key=problem"])
    save_config(cfg, str(tmp_path / "config.yaml"))
    back = load_config(str(tmp_path / "config.yaml"))
    assert (back.data.answer_key, back.data.question_key) == ("solution", "problem")


def test_phase_timer_records_each_phases_peak_memory_with_nesting():
    """Peaks per phase from an allocator trace: the interval readings are credited to every phase
    running through them, so an enclosing phase's peak includes its inner phases'."""
    readings = iter([0, 5, 9, 3, 4, 2])  # the peak of each interval between phase boundaries, in GiB

    timer = PhaseTimer(peak_memory=lambda: next(readings) * 2**30)
    with timer.phase("rollout"):  # 0 before it; enter rollout
        with timer.phase("weight_sync"):  # rollout alone: 5
            pass  # weight_sync (and rollout): 9
    # rollout alone after weight_sync: 3
    with timer.phase("policy_update"):  # outside any phase: 4 (credited to none)
        pass  # policy_update: 2
    out = timer.pop()
    assert out["memory/weight_sync"] == 9 and out["memory/rollout"] == 9 and out["memory/policy_update"] == 2
    assert "memory/step" not in out and set(PhaseTimer().pop()) == {"time/step"}  # no memory without a probe


def test_a_resume_from_an_older_checkpoint_keeps_the_old_lines_and_reads_the_redone_ones(tmp_path, caplog):
    """Killed after step 3 with the newest checkpoint at step 2: the resumed run redoes step 3. The
    file keeps both step-3 lines (no record is rewritten); readers get one history, the new line."""
    with MetricsLogger(str(tmp_path), use_wandb=False) as log:
        for step in (1, 2, 3):
            log.log(step, {"x": float(step)})
    with caplog.at_level("WARNING"), MetricsLogger(str(tmp_path), use_wandb=False, start_step=2) as log:
        log.log(3, {"x": 30.0})
        log.log(4, {"x": 40.0})
    assert "holds steps 3..3 logged after the checkpoint this run resumes from (step 2)" in caplog.text
    assert [r["step"] for r in read_metrics(str(tmp_path), history="all")] == [1, 2, 3, 3, 4]
    assert [(r["step"], r["x"]) for r in read_metrics(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_resume_at_the_last_logged_step_says_nothing(tmp_path, caplog):
    with MetricsLogger(str(tmp_path), use_wandb=False) as log:
        log.log(1, {"x": 1.0})
    with caplog.at_level("WARNING"), MetricsLogger(str(tmp_path), use_wandb=False, start_step=1):
        pass
    assert "logged after the checkpoint" not in caplog.text
