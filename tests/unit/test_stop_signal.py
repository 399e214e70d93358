"""Preemption signals: SIGTERM (the scheduler's stop) and SIGUSR1 (its early warning, e.g.
``#SBATCH --signal=B:USR1@600`` forwarded by examples/launch_multinode.sh to the workers) set the
trainer's stop flag instead of killing it; the loop then checkpoints and exits 75."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch.distributed as dist

from cooper_mcore.job import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopSignal, TrainingStopped, job
from cooper_mcore.parallel import ParallelConfig


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signals_set_the_flag_and_handlers_come_back(sig):
    before = signal.getsignal(sig)
    stop = StopSignal()
    try:
        assert not stop.any_rank()
        os.kill(os.getpid(), sig)
        assert stop.caught == sig.name and stop.any_rank()
    finally:
        stop.restore()
    assert signal.getsignal(sig) is before
    assert EXIT_PREEMPTED == 75


def test_the_job_skeleton_stops_on_a_signal_and_cleans_up(tmp_path):
    """A job's room: metrics lines, the stop signal checked after a step, the world and handlers gone after."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingStopped) as info:
        with job(str(tmp_path / "out"), 3, parallel=ParallelConfig()) as room:
            room.log(1, {"loss": 1.0})
            os.kill(os.getpid(), signal.SIGTERM)
            if room.stop_requested():
                raise room.stopped(1, None)
    assert info.value.exit_code == EXIT_PREEMPTED and "preempted (SIGTERM) after step 1" in str(info.value)
    assert signal.getsignal(signal.SIGTERM) is before and not dist.is_initialized()
    assert [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}]


def test_a_second_ctrl_c_leaves_the_job_at_once(tmp_path):
    with pytest.raises(TrainingStopped) as info:
        with job(str(tmp_path), 3, parallel=ParallelConfig(), write_metrics=False) as room:
            room.step = 2
            raise KeyboardInterrupt
    assert info.value.exit_code == EXIT_INTERRUPTED and info.value.checkpoint is None
    assert "with 2 steps done" in str(info.value) and not (tmp_path / "metrics.jsonl").exists()


def test_the_stop_message_tells_how_to_go_on(tmp_path):
    """Resume only where the job resumes: VerifyRM training (model checkpoints) is told to start again."""
    with job(str(tmp_path), 3, parallel=ParallelConfig(), write_metrics=False) as room:
        resumes = str(room.stopped(2, "ck/step_2"))
        restarts = str(room.stopped(2, "ck/step_2", resumable=False))
        nothing = str(room.stopped(1, None, resumable=False))
    assert "checkpoint ck/step_2 written; run the same command with --resume auto" in resumes
    assert "--resume" not in restarts and "does not resume: run it again with an empty output folder" in restarts
    assert "no checkpoint: run the same command to start again" in nothing
