"""Preemption signals: SIGTERM (the scheduler's stop) and SIGUSR1 (its early warning, e.g.
``#SBATCH --signal=B:USR1@600`` forwarded by examples/launch_multinode.sh to the workers) set the
trainer's stop flag instead of killing it; the loop then checkpoints and exits 75."""

from __future__ import annotations

import os
import signal

import pytest

from cooper_mcore.rl.loop import EXIT_PREEMPTED, StopSignal


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
