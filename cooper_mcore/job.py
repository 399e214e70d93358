"""The skeleton every training job runs in (the Cooper loop, SFT, VerifyRM training).

:func:`job` enters the job's distributed world (:func:`cooper_mcore.parallel.job_world`: what the
caller has initialised is used, what is missing is set up and torn down on exit), holds its run
folder (:func:`hold_run_folder`), writes its config record (:mod:`cooper_mcore.config.versions`),
then opens the metrics log (:class:`~cooper_mcore.metrics.MetricsLogger`, rank 0 writes), the
progress bar and the stop signal (:func:`job_room`) and hands them over as one :class:`JobRoom`;
the training-checkpoint room of the run folder (``<out>/checkpoints``: manifest, resume, pruning,
:mod:`cooper_mcore.checkpoint.training`) is :attr:`JobRoom.ckpt_dir`, found by :func:`resume_path`
and listed by :meth:`JobRoom.newest_checkpoint`. The Cooper loop, which clears, resumes and
records its folder itself, takes the same steps one by one.

A run folder belongs to one run: rank 0 takes the folder's lock (``<out>/run.lock``,
:class:`cooper_mcore.run_lock.RunLock`) before anything is written there and keeps it until the
job ends, and checks the folder holding it; the other ranks learn the outcome from it, so a
refused job stops on every rank with the same one line (naming the run that holds the folder).

Stop signals: SIGTERM (preemption), SIGUSR1 (a scheduler's early warning before its time limit)
or a first Ctrl-C (SIGINT) is caught into a flag that the job checks at the end of each step
(:meth:`JobRoom.stop_requested`, collective); a second Ctrl-C stops at once and leaves the room as
:class:`TrainingStopped` with ``EXIT_INTERRUPTED`` naming the newest complete checkpoint. Forked
children (megatron-core's checkpoint writers) ignore the stop signals: the job decides.

A collective that fails in the body (another rank gone: its process or its node; or a timeout,
:func:`cooper_mcore.parallel.collective_failure`) leaves the room as :class:`TrainingStopped` with
``EXIT_PEER_LOST``, one line naming the collective, the newest complete checkpoint and the command
that continues from it (:meth:`JobRoom.lost`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch.distributed as dist

from cooper_mcore.checkpoint.training import complete_checkpoints, find_resume
from cooper_mcore.collectives import any_rank
from cooper_mcore.config.versions import RECORD_FILE, ConfigRecord, write_record
from cooper_mcore.exit_codes import (  # noqa: F401 - the jobs' exit codes, importable from here as before
    EXIT_CHECKPOINT_FAILED,
    EXIT_ENGINE_LOST,
    EXIT_INTERRUPTED,
    EXIT_NO_SIGNAL,
    EXIT_NONFINITE,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
)
from cooper_mcore.metrics import METRICS_FILE, MetricsLogger, ProgressBar
from cooper_mcore.parallel import CollectiveFailed, ParallelConfig, collective_failure, job_world
from cooper_mcore.run_lock import LOCK_FILE, RunLock

logger = logging.getLogger(__name__)
T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CHECKPOINTS_DIR = "checkpoints"


class TrainingStopped(RuntimeError):
    """The run stopped early (a stop signal, non-finite numbers, a checkpoint that could not be
    written); ``exit_code`` is the CLI's; ``checkpoint`` the newest complete checkpoint (or None)."""

    def __init__(self, message: str, exit_code: int, checkpoint: Optional[str]) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


class StopSignal:
    """Catch SIGTERM, SIGUSR1 and a first SIGINT into a flag checked at the end of every step (and
    after every checkpoint); a second SIGINT raises ``KeyboardInterrupt``; restore on exit.

    A process forked while the handlers are installed (megatron-core's checkpoint writers)
    inherits them; there they do nothing, so a Ctrl-C sent to the whole process group (the
    terminal's) leaves the writers alone and the trainer decides.
    """

    def __init__(self) -> None:
        self.caught: Optional[str] = None
        self.interrupts = 0
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked child: the trainer decides
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise KeyboardInterrupt
            logger.warning("Ctrl-C (SIGINT): will write a checkpoint and exit at the end of this step; press Ctrl-C "
                           "again to stop at once (the steps since the last complete checkpoint are then lost)")
        elif self.caught is None:
            logger.warning("%s: will write a checkpoint and exit at the end of this step", name)
        if self.caught is None:
            self.caught = name

    def any_rank(self) -> bool:
        """Whether any rank caught a stop signal (collective: every rank calls it once per step)."""
        return any_rank(self.caught is not None)

    def describe(self) -> str:
        """What stopped the job, for its message."""
        if self.caught == "SIGINT":
            return "stopped by Ctrl-C (SIGINT)"
        return f"preempted ({self.caught or 'a stop signal on another rank'})"

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def resume_path(ckpt_dir: str, resume: str) -> Optional[str]:
    """Rank 0 verifies the candidates (reading them once) and tells the others (collective)."""
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            answer = [("ok", find_resume(ckpt_dir, resume))]
        except ValueError as e:
            answer = [("error", str(e))]
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise ValueError(value)
    return value


def newest_checkpoint(ckpt_dir: str) -> Optional[str]:
    """The newest complete training checkpoint under ``ckpt_dir`` (None: none yet)."""
    steps = complete_checkpoints(ckpt_dir)
    return os.path.join(ckpt_dir, f"step_{steps[-1]}") if steps else None


@dataclass
class JobRoom:
    """What a job's loop uses: its metrics log, progress bar, stop signal and checkpoint folder."""

    out: str
    """The job's output folder."""
    main: bool
    """Whether this rank writes (rank 0)."""
    metrics: MetricsLogger
    """The ``metrics.jsonl`` (and wandb) log; a no-op off rank 0."""
    progress: ProgressBar
    """The step bar (rank 0)."""
    stop: StopSignal
    """The caught stop signal."""
    step: int = 0
    """Steps done (the last one logged)."""

    @property
    def ckpt_dir(self) -> str:
        """The training-checkpoint room, ``<out>/checkpoints``."""
        return os.path.join(self.out, CHECKPOINTS_DIR)

    def newest_checkpoint(self) -> Optional[str]:
        """The newest complete training checkpoint of this job (None: none yet)."""
        return newest_checkpoint(self.ckpt_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one step's metrics line and move the progress bar to ``step``."""
        self.metrics.log(step, metrics)
        self.progress.update(step, metrics)
        self.step = step

    def stop_requested(self) -> bool:
        """Whether any rank caught a stop signal (collective: every rank calls it once per step)."""
        return self.stop.any_rank()

    def stopped(self, step: int, checkpoint: Optional[str], resumable: bool = True) -> TrainingStopped:
        """The error that ends a job stopped by a signal after ``step``.

        Args:
            step: the last step done.
            checkpoint: the checkpoint written last (None: none).
            resumable: whether the job continues from ``checkpoint`` with ``--resume auto``; a job that
                does not (VerifyRM training writes model checkpoints) is told to start again elsewhere,
                since its output folder is no longer empty.
        """
        if checkpoint is None:
            written = "no checkpoint: run the same command to start again"
        elif resumable:
            written = f"checkpoint {checkpoint} written; run the same command with --resume auto to continue"
        else:
            written = (f"model checkpoint {checkpoint} written; this job does not resume: run it again with an "
                       "empty output folder")
        return TrainingStopped(f"{self.stop.describe()} after step {step}: {written}", EXIT_PREEMPTED, checkpoint)

    def lost(self, failure: CollectiveFailed) -> TrainingStopped:
        """The error that ends a job whose collective failed (another rank gone, or a timeout): what failed, the
        newest complete checkpoint and the command that continues from it, in one line (``EXIT_PEER_LOST``).
        Every rank that sees the failure says so: none can know which others are still there."""
        last = self.newest_checkpoint()
        if last is None:
            then = "no complete checkpoint yet: run the same command on every node to start over"
        else:
            then = (f"the newest complete checkpoint is {last}: run the same command on every node with --resume "
                    "auto to continue from it")
        return TrainingStopped(f"{failure}; {then}", EXIT_PEER_LOST, last)


def _nothing() -> None:
    return None


@contextmanager
def hold_run_folder(out: str, prepare: Callable[[], T] = _nothing, lock_file: str = "") -> Iterator[T]:
    """Hold the run folder ``out`` for this job until the block ends (collective; the module doc).

    Rank 0 takes the folder's lock and, holding it, runs ``prepare`` (the job's checks of the
    folder, its clearing); every rank gets what ``prepare`` returned, or raises the error rank 0
    met, so no rank waits for a refused one.

    Args:
        out: the job's output folder.
        prepare: run on rank 0 with the lock held; its result must pickle (it is broadcast).
        lock_file: the lock's file (default ``<out>/run.lock``; a job whose output must not exist
            before it is complete locks a file beside it).

    Raises:
        cooper_mcore.run_lock.FolderInUse: another run holds the folder (one line naming it).
        Exception: what ``prepare`` raised (on rank 0 with its traceback, elsewhere a copy).
    """
    lock = RunLock(lock_file or os.path.join(out, LOCK_FILE), guards=f"run folder {out!r}")
    outcome: list[Any] = [None]
    error: Optional[BaseException] = None
    dist.barrier()  # every rank has made its own checks of the folder before rank 0 writes into it
    if dist.get_rank() == 0:
        try:
            lock.acquire()
            outcome = [("ok", prepare())]
        except BaseException as e:
            lock.release()
            if not isinstance(e, Exception):  # Ctrl-C and the like: this process is going down
                raise
            error, outcome = e, [("error", e)]
    try:
        dist.broadcast_object_list(outcome, src=0)
    except BaseException:
        lock.release()
        raise
    kind, value = outcome[0]
    if kind == "error":
        raise error if error is not None else value
    try:
        yield value
    finally:
        lock.release()  # a no-op off rank 0


@contextmanager
def job(out: str, total_steps: int, *, parallel: Optional[ParallelConfig] = None, seed: int = 1234,
        config: Optional[dict[str, Any]] = None, metrics_dir: Optional[str] = None, write_metrics: bool = True,
        use_wandb: bool = False, wandb_project: str = "cooper_mcore", run_name: Optional[str] = None,
        check: Callable[[], object] = _nothing, lock_file: str = "") -> Iterator[JobRoom]:
    """The world, run folder, metrics log, progress bar and stop signal of a training job (module doc).

    Args:
        out: the job's output folder (its checkpoint room is ``out/checkpoints``).
        total_steps: the job's steps (the progress bar's end).
        parallel: the model-parallel layout of the world to set up where none is (None: the
            caller's world, which must be initialised).
        seed: megatron's RNG seed when the world is set up here.
        config: the job's config: its record ``out/config.yaml`` (redacted; with ``write_metrics``)
            and wandb's.
        metrics_dir: where ``metrics.jsonl`` goes (default ``out``).
        write_metrics: False: no metrics file and no config record (the log is a no-op; a job
            whose output folder is a model checkpoint written whole at the end).
        use_wandb / wandb_project / run_name: the wandb mirror of the metrics.
        check: the job's check of its output folder, run on rank 0 holding the folder's lock
            (:func:`hold_run_folder`; it raises to refuse).
        lock_file: the folder lock's file (:func:`hold_run_folder`).

    Yields:
        The job's :class:`JobRoom`; on exit the stop handlers are restored, the bar and the log
        closed, the folder released and the world torn down where it was set up here. A body that
        raises before anything was logged leaves the folder as the job found it (:func:`_take_back`).

    Raises:
        cooper_mcore.run_lock.FolderInUse: another run holds the folder.
        TrainingStopped: a second Ctrl-C in the body (``EXIT_INTERRUPTED``).
    """
    world = job_world(parallel, seed) if parallel is not None else _callers_world()
    with world, hold_run_folder(out, check, lock_file):
        recorded = config is not None and write_metrics and dist.get_rank() == 0
        if recorded:
            write_record(os.path.join(out, RECORD_FILE), ConfigRecord.start(config))
        try:
            with job_room(out, total_steps, config=config, metrics_dir=metrics_dir, write_metrics=write_metrics,
                          use_wandb=use_wandb, wandb_project=wandb_project, run_name=run_name) as room:
                yield room
        except BaseException:
            if recorded:
                _take_back(out, metrics_dir or out)
            raise


def _take_back(out: str, metrics_dir: str) -> None:
    """What a job that failed before it logged anything had started in its folder (its config record,
    its empty metrics log and checkpoint room) is removed: a job refused at its start (a damaged
    checkpoint, a tokenizer that does not fit) leaves the folder as it found it, and the same command,
    its input fixed, runs again there. A job that logged a line keeps everything."""
    metrics = os.path.join(metrics_dir, METRICS_FILE)
    if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
        return
    for path in (metrics, os.path.join(out, RECORD_FILE)):
        with suppress(FileNotFoundError):
            os.remove(path)
    with suppress(OSError):  # not empty: keep it
        os.rmdir(os.path.join(out, CHECKPOINTS_DIR))


@contextmanager
def job_room(out: str, total_steps: int, *, start_step: int = 0, config: Optional[dict[str, Any]] = None,
             metrics_dir: Optional[str] = None, write_metrics: bool = True, use_wandb: bool = False,
             wandb_project: str = "cooper_mcore", run_name: Optional[str] = None) -> Iterator[JobRoom]:
    """The metrics log, progress bar and stop signal of a job whose world and folder are held
    (:func:`job`'s arguments; ``start_step``: steps already done, for a resumed run).

    Raises:
        TrainingStopped: a second Ctrl-C in the body (``EXIT_INTERRUPTED``), or a collective that failed in it
            (``EXIT_PEER_LOST``, :meth:`JobRoom.lost`).
    """
    main = dist.get_rank() == 0
    room = JobRoom(out, main, MetricsLogger(metrics_dir or out, run_name=run_name, config=config,
                                            start_step=start_step, use_wandb=use_wandb and write_metrics,
                                            wandb_project=wandb_project, is_main=main and write_metrics),
                   ProgressBar(total_steps, start_step=start_step, enabled=main), StopSignal(), start_step)
    try:
        yield room
    except KeyboardInterrupt:  # a second Ctrl-C (the first is a stop signal)
        last = room.newest_checkpoint()
        raise TrainingStopped(f"interrupted (Ctrl-C twice) with {room.step} steps done: stopped at once, the "
                              "steps since the newest complete checkpoint are lost; that checkpoint is "
                              f"{last or 'none (the run starts over)'}: "
                              "run the same command with --resume auto to continue from it",
                              EXIT_INTERRUPTED, last) from None
    except RuntimeError as e:
        failure = collective_failure(e)
        if failure is None:
            raise
        raise room.lost(failure) from e
    finally:
        room.stop.restore()
        room.progress.close()
        room.metrics.close()


@contextmanager
def _callers_world() -> Iterator[None]:
    if not dist.is_initialized():
        raise RuntimeError("job(parallel=None) needs an initialised distributed world")
    yield
