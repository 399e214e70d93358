"""Fault-injection points for the reliability tests: SIGKILL this process at a named place.

The trainer calls :func:`fault_point` at the entry of every training phase (``rollout``,
``rm_score``, ``logprobs``, ``policy_update``, ``rm_update``, ``weight_sync``, ...: the names of
``time/<phase>``) and at five places inside a checkpoint write (``ckpt_policy``: the policy's
files are written, the RM's are not; ``ckpt_rm``: both models' files are written; ``ckpt_files``:
every file but the manifest; ``ckpt_manifest``: the manifest is written, the folder not yet
renamed; ``ckpt_renamed``: renamed, older checkpoints not yet pruned).

Nothing happens unless the environment variable ``COOPER_FAULT`` is set, to
``<point>@<step>[+<delay_s>][/TERM|/USR1|/INT|/INT2]``: at point ``<point>`` of step ``<step>`` (the
step being run or saved, 1-based) the process sends itself SIGKILL (or SIGTERM with ``/TERM``, a
preemption; or SIGUSR1 with ``/USR1``, the warning SLURM sends before a time limit; or SIGINT with
``/INT``, a Ctrl-C, and ``/INT2`` a Ctrl-C pressed twice), either at once or ``<delay_s>`` seconds
later from a timer thread (it then dies at a random moment *inside* the phase, or wherever it has
got to). A Ctrl-C goes to the whole process group when the process leads it (as a terminal sends
it: to the trainer's children too), else to the process alone. SIGKILL cannot be caught:
nothing is flushed or cleaned up, exactly as with an OOM kill or a lost node. The check is one environment lookup and a
string compare, so the hooks stay in production code at no cost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from cooper_mcore.metrics import PhaseTimer

logger = logging.getLogger(__name__)

FAULT_ENV = "COOPER_FAULT"


_SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "INT": signal.SIGINT}


def _parse(spec: str) -> tuple[str, int, float, signal.Signals, int]:
    usage = f"{FAULT_ENV}={spec!r}: expected <point>@<step>[+<delay_s>][/TERM|/USR1|/INT|/INT2]"
    try:
        body, _, sig = spec.partition("/")
        times = 2 if sig == "INT2" else 1
        point, rest = body.split("@", 1)
        step, _, delay = rest.partition("+")
        parsed = (point, int(step), float(delay) if delay else 0.0, _SIGNALS[sig[:-1] if times == 2 else sig or "KILL"],
                  times)
    except (ValueError, KeyError) as e:
        raise ValueError(usage) from e
    if not point or not parsed[2] >= 0:
        raise ValueError(usage)
    return parsed


def parse_fault(spec: str) -> tuple[str, int, float, signal.Signals]:
    """``"policy_update@3+0.05/TERM"`` -> ``("policy_update", 3, 0.05, SIGTERM)`` (``/INT2``: SIGINT).

    Raises:
        ValueError: on a malformed spec (naming it).
    """
    return _parse(spec)[:4]


def format_fault(point: str, step: int, delay_s: float = 0.0, sig: signal.Signals = signal.SIGKILL,
                 times: int = 1) -> str:
    """The ``COOPER_FAULT`` value for :func:`parse_fault` (``times=2``: SIGINT twice, ``/INT2``)."""
    spec = f"{point}@{step}+{delay_s!r}" if delay_s else f"{point}@{step}"
    if times == 2 and sig == signal.SIGINT:
        return spec + "/INT2"
    return spec + ("" if sig == signal.SIGKILL else "/" + signal.Signals(sig).name[3:])


def _send(sig: signal.Signals, times: int) -> None:
    """Send ``sig`` ``times`` times, each handled before the next is sent (two Ctrl-C presses, not
    one merged signal); SIGINT to the process group when this process leads it, as a terminal does."""
    for _ in range(times):
        if sig == signal.SIGINT and os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)
        if times > 1:  # Python runs the handler in the main thread at its next check: let it
            time.sleep(0.05)


def fault_point(point: str, step: int) -> None:
    """Signal this process here if ``COOPER_FAULT`` names this point and step (see module doc)."""
    spec: Optional[str] = os.environ.get(FAULT_ENV)
    if not spec or not spec.startswith(point + "@"):
        return
    name, at, delay, sig, times = _parse(spec)
    if name != point or at != step:
        return
    logger.warning("fault injection: %s%s at %s of step %d%s", sig.name, " twice" if times > 1 else "", point, step,
                   f" after {delay:.3f}s" if delay else "")
    if not delay:
        _send(sig, times)
        return
    timer = threading.Timer(delay, _send, args=(sig, times))
    timer.daemon = True
    timer.start()


class FaultPhaseTimer(PhaseTimer):
    """A :class:`~cooper_mcore.metrics.PhaseTimer` whose phases are fault points.

    Args:
        step: returns the step being run (1-based) when a phase is entered.
    """

    def __init__(self, step: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._step = step

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Fire :func:`fault_point` for ``name``, then time the block as the base class does."""
        fault_point(name, self._step())
        with super().phase(name):
            yield
