"""Training observability: a JSONL + wandb metrics logger, phase timers, a progress bar and
cross-rank metric reduction (the reward-hacking detector that watches these metrics is
:mod:`cooper_mcore.hacking_detector`).

The trainer writes one flat ``dict[str, float]`` per step; its keys are named once, with their
meanings, in :mod:`cooper_mcore.metric_names` (rendered as ``docs/metrics.md``). Code refers to
those constants, never to the strings.

Typical loop::

    timer, detector = PhaseTimer(), RewardHackingDetector(action="stop")
    with MetricsLogger(out_dir, config=cfg, is_main=rank == 0) as log:
        bar = ProgressBar(total_steps, start_step=start)
        for step in range(start + 1, total_steps + 1):
            with timer.phase(Phase.ROLLOUT):
                ...
            m = {**step_metrics, **timer.pop()}
            m = reduce_metrics(m, max_keys=[k for k in m if k.startswith(TIME_PREFIX)])
            detector.update(step, m[K.REWARD_MEAN], m[K.RULE_ACC])
            log.log(step, m)
            bar.update(step, m)
        bar.close()
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import netrc
import operator
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Optional, TextIO
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from tqdm import tqdm

from cooper_mcore import atomic
from cooper_mcore.collectives import all_reduce
from cooper_mcore.metric_names import MetricKey, memory_key, time_key
from cooper_mcore.redaction import scrub, scrub_config

__all__ = [
    "DEFAULT_PROGRESS_KEYS", "METRICS_FILE", "JsonlWriter", "MetricsLogger", "PhaseTimer", "ProgressBar",
    "current_history", "read_metrics", "reduce_metrics", "resolve_wandb_mode", "write_json_atomic",
]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
DEFAULT_PROGRESS_KEYS = (MetricKey.REWARD_MEAN, MetricKey.RULE_ACC, MetricKey.EVAL_ACC)


# ----------------------------------------------------------------------------- wandb mode


def _has_wandb_credentials() -> bool:
    """Whether wandb could authenticate: an API key / identity token in the environment, or a
    netrc entry for the wandb host (what ``wandb login`` writes). Reads no network."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        auth = netrc.netrc(path).authenticators(host) if host and os.path.isfile(path) else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(use_wandb: bool = True) -> str:
    """The wandb mode :class:`MetricsLogger` uses.

    Args:
        use_wandb: False gives ``"disabled"``.

    Returns:
        ``"disabled"`` if ``use_wandb`` is False; else ``$WANDB_MODE`` when the user set it;
        else ``"online"`` with credentials (``WANDB_API_KEY`` or a ``wandb login``) and
        ``"offline"`` without (so a run never stops at a login prompt).
    """
    if not use_wandb:
        return "disabled"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if _has_wandb_credentials() else "offline"


# ----------------------------------------------------------------------------- values


def _to_float(name: str, value: Any) -> float:
    """A metric value as a float: Python numbers, numpy scalars and one-element tensors; None -> NaN."""
    if value is None:
        return math.nan
    if hasattr(value, "numel") and value.numel() != 1:
        raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (str, bytes)):
        raise ValueError(f"metric {name!r} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metric {name!r} must be a number, got {type(value).__name__}") from e


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise ValueError(f"step must be an int, got {step!r}")
    try:
        step = operator.index(step)
    except TypeError as e:
        raise ValueError(f"step must be an int, got {type(step).__name__}") from e
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


# ----------------------------------------------------------------------------- logger


class MetricsLogger:
    """Writes one JSON line per step to ``<out_dir>/metrics.jsonl`` and mirrors it to wandb.

    Each line is ``{"step": N, <metric keys sorted>...}`` with float values, NaN/inf written
    as ``null``. Every line is flushed and fsync'd, so a killed run loses at most the line being
    written; a torn last line left by a crash is cut off when the file is reopened, so a resumed
    run appends cleanly. The (redacted, see :func:`redact`) config goes to the wandb run; the run
    folder's record of it is ``config.yaml`` (:mod:`cooper_mcore.config.versions`). One writer per
    file: the job's rank 0, which holds the run folder (:func:`cooper_mcore.job.hold_run_folder`).

    wandb runs in the mode :func:`resolve_wandb_mode` picks, with console capture off; offline (no
    credentials) its own console output is silenced and one log line says where the run is. A failure
    to start wandb, or to log to it, logs a warning and the run continues without wandb. On ranks
    with ``is_main=False`` every method is a no-op and nothing is created.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, out_dir: str, run_name: Optional[str] = None, config: Optional[dict] = None,
                 start_step: int = 0, use_wandb: bool = True, wandb_project: str = "cooper_mcore", is_main: bool = True,
                 wandb_init_kwargs: Optional[dict] = None) -> None:
        """Open the metrics file and start wandb (on the main rank only).

        Args:
            out_dir: run folder (created); ``metrics.jsonl`` is appended to if it exists.
            run_name: wandb run name (None: wandb picks one).
            config: run configuration; redacted before it is written or sent anywhere.
            start_step: the steps already done (a resumed run): lines of later steps already in the file
                (logged after the checkpoint the run resumes from) are kept, and superseded by the
                redone steps' lines (:func:`read_metrics`); a warning says so.
            use_wandb: False disables wandb (JSONL only).
            wandb_project: wandb project name.
            is_main: whether this process writes (rank 0); False makes the logger a no-op.
            wandb_init_kwargs: extra ``wandb.init`` arguments (e.g. ``entity``, ``tags``, ``group``).

        Raises:
            ValueError: if ``config`` is not a mapping.
        """
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict or None, got {type(config).__name__}")
        self.is_main = bool(is_main)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.config = scrub_config(dict(config or {}))
        run_name = scrub(run_name) if run_name else run_name
        self.wandb_mode = resolve_wandb_mode(use_wandb)
        self._file = JsonlWriter(None)
        self._run: Any = None
        self._closed = False
        if not self.is_main:
            return
        os.makedirs(out_dir, exist_ok=True)
        _warn_superseded(self.path, start_step)
        self._file = JsonlWriter(self.path)
        if self.wandb_mode != "disabled":
            self._run = self._init_wandb(run_name, wandb_project, dict(wandb_init_kwargs or {}))

    def _init_wandb(self, run_name: Optional[str], project: str, extra: dict) -> Any:
        try:
            import wandb

            # offline (no credentials): wandb's own ~30 lines of banner and summary are silenced, one line below
            offline = self.wandb_mode == "offline"
            kwargs: dict[str, Any] = {"project": project, "name": run_name, "config": self.config,
                                      "mode": self.wandb_mode,
                                      "settings": wandb.Settings(console="off", silent=offline)}
            if not os.environ.get("WANDB_DIR"):
                kwargs["dir"] = self.out_dir
            kwargs.update(extra)
            run = wandb.init(**kwargs)
        except Exception as e:  # wandb must never kill the run
            logger.warning("wandb init failed (%s: %s); continuing without wandb, metrics still go to %s",
                           type(e).__name__, e, self.path)
            return None
        if offline:
            folder = os.path.dirname(getattr(run, "dir", "") or "") or "wandb/"  # run.dir: the run folder's files/
            logger.info("wandb offline: the run is in %s (`wandb sync %s` uploads it)", folder, folder)
        else:
            logger.info("wandb run %s (mode %s)", getattr(run, "name", None), self.wandb_mode)
        return run

    @property
    def wandb_run(self) -> Any:
        """The live wandb run, or None (disabled, failed, not main, or closed)."""
        return self._run

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one step's metrics to ``metrics.jsonl`` and log them to wandb.

        Args:
            step: training step (int >= 0).
            metrics: metric name -> number (floats, ints, numpy scalars, one-element tensors;
                None and non-finite values are written as null). A ``"step"`` key is allowed
                only if it equals ``step``.

        Raises:
            ValueError: on a bad step, a non-string key or a non-numeric value.
            RuntimeError: if the logger is closed.
        """
        if not self.is_main:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        step = _check_step(step)
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str):
                raise ValueError(f"metric names must be strings, got {name!r}")
            if name == MetricKey.STEP:
                if _to_float(name, value) != step:
                    raise ValueError(f"metrics['step']={value!r} disagrees with step={step}")
                continue
            values[name] = _to_float(name, value)
        record: dict[str, Any] = {MetricKey.STEP: step}
        record.update((k, v if math.isfinite(v) else None) for k, v in sorted(values.items()))
        self._file.write(record)
        if self._run is not None:
            try:
                self._run.log(values, step=step)
            except Exception as e:  # wandb must never kill the run
                logger.warning("wandb log failed at step %d (%s: %s); continuing without wandb",
                               step, type(e).__name__, e)
                self._finish_wandb()

    def _finish_wandb(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish()
        except Exception as e:  # wandb must never kill the run
            logger.warning("wandb finish failed (%s: %s)", type(e).__name__, e)

    def close(self) -> None:
        """Close the metrics file and finish the wandb run. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finish_wandb()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlWriter:
    """Appends one JSON object per line to a file (on the writing rank), flushed and fsync'd after
    each line, so a killed job loses at most the line being written; a torn last line left by an
    earlier crash is cut off when the file is opened. With no path every call is a no-op.

    Args:
        path: the file (appended to if it exists), or None.
    """

    def __init__(self, path: Optional[str]) -> None:
        self._f: Optional[TextIO] = None
        if path:
            _drop_torn_tail(path)
            self._f = open(path, "a", encoding="utf-8")  # closed in close()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line; NaN and infinities are written as null."""
        if self._f is not None:
            self._f.write(json.dumps(_finite(record), allow_nan=False, default=str) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._f is not None:
            self._f.close()
            self._f = None


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of mappings and lists) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _drop_torn_tail(path: str) -> None:
    """Cut a partial last line (no trailing newline) left by a killed run, so appends stay valid."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(data) - keep)
        f.truncate(keep)


def _warn_superseded(path: str, start_step: int) -> None:
    """Say that a resumed run redoes steps the file already has (logged after its checkpoint)."""
    if not os.path.exists(path):
        return
    later = [r["step"] for r in read_metrics(path, history="all") if isinstance(r.get("step"), int)
             and r["step"] > start_step]
    if later:
        logger.warning("%s holds steps %d..%d logged after the checkpoint this run resumes from (step %d): their "
                       "lines stay in the file, and the redone steps' lines supersede them (read_metrics, cooper "
                       "plot and the demo report read the newest history)", path, min(later), max(later), start_step)


def current_history(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history a run's lines tell after its resumes: a line whose step is not after the line before
    it starts a resumed segment, which supersedes the earlier lines of that step and later ones.

    >>> [r["step"] for r in current_history([{"step": s} for s in (1, 2, 3, 2, 3, 4)])]
    [1, 2, 3, 4]
    """
    out: list[dict[str, Any]] = []
    for line in lines:
        step = line.get("step")
        if isinstance(step, int):
            while out and isinstance(out[-1].get("step"), int) and out[-1]["step"] >= step:
                out.pop()
        out.append(line)
    return out


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON under a temporary name, then rename it to ``path``
    (:func:`cooper_mcore.atomic.write_json_atomic`: a special file at ``path`` is refused)."""
    atomic.write_json_atomic(path, obj)


def read_metrics(path: str, history: Literal["current", "all"] = "current") -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file (or a run folder containing one).

    A torn last line (a run killed mid-write) is skipped; a corrupt line anywhere else is an
    error. ``null`` values are returned as None.

    Args:
        path: the JSONL file, or the ``out_dir`` that holds ``metrics.jsonl``.
        history: "current": the run's history after its resumes (:func:`current_history`: a resume from a
            checkpoint older than the last logged step redoes those steps, and their new lines supersede
            the old ones, which stay in the file); "all": every line.

    Returns:
        The complete lines as dicts, in file order.

    Raises:
        ValueError: if a line other than the last is not a JSON object.
        FileNotFoundError: if the file does not exist.
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: the write was cut short
                logger.warning("%s: ignoring a truncated last line", path)
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({e})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(record).__name__}")
        out.append(record)
    return current_history(out) if history == "current" else out


# ----------------------------------------------------------------------------- timing


class PhaseTimer:
    """Wall-clock seconds per training phase, accumulated over one step.

    ``with timer.phase("rollout"): ...`` adds the block's duration to ``time/rollout`` (a phase
    entered several times in a step accumulates). :meth:`pop` returns the step's times and
    resets.

    Nesting: phases may nest; each phase's time is inclusive (an inner phase's time is counted
    in its own key *and* in the enclosing phase). ``time/step`` is the sum of the *outermost*
    phases only, so nested time is not counted twice; time outside any phase is not counted.
    A phase cannot be nested inside itself.

    GPU work is asynchronous, so pass ``sync=torch.cuda.synchronize`` to time it: ``sync`` is
    called at every phase entry and exit, before the clock is read.

    With ``peak_memory`` (on a GPU: :func:`cuda_peak_memory`), each phase's peak memory is recorded
    too, as ``memory/<phase>`` in GiB: the most the allocator held at any moment inside the phase
    (nested phases count toward their enclosing phases' peaks).
    """

    def __init__(self, sync: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 peak_memory: Optional[Callable[[], int]] = None) -> None:
        """Create a timer.

        Args:
            sync: called at every phase boundary before reading the clock (e.g.
                ``torch.cuda.synchronize``); None for no synchronisation.
            clock: monotonic clock in seconds (injectable for tests).
            peak_memory: returns the peak bytes since its last call and starts a new interval
                (:func:`cuda_peak_memory`); None records no memory.
        """
        self._sync = sync
        self._clock = clock
        self._peak_memory = peak_memory
        self._times: dict[str, float] = {}
        self._peaks: dict[str, int] = {}
        self._active: list[str] = []
        self._step_total = 0.0

    def _fold_peak(self) -> None:
        """Credit the peak of the interval that ends now to every running phase."""
        if self._peak_memory is not None:
            peak = self._peak_memory()
            for name in self._active:
                self._peaks[name] = max(self._peaks.get(name, 0), peak)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name``.

        Args:
            name: phase name (reported as ``time/<name>``); not ``"step"``.

        Raises:
            ValueError: on an empty name, ``"step"``, or a phase nested in itself.
        """
        if not isinstance(name, str) or not name or time_key(name) == MetricKey.TIME_STEP:
            raise ValueError(f"phase name must be a non-empty string other than 'step', got {name!r}")
        if name in self._active:
            raise ValueError(f"phase {name!r} is already running (phases: {self._active})")
        if self._sync is not None:
            self._sync()
        self._fold_peak()
        start = self._clock()
        self._active.append(name)
        try:
            yield
        finally:
            try:
                if self._sync is not None:
                    self._sync()
            finally:
                elapsed = self._clock() - start
                self._fold_peak()
                self._active.pop()
                self._times[name] = self._times.get(name, 0.0) + elapsed
                if not self._active:
                    self._step_total += elapsed

    @property
    def active(self) -> list[str]:
        """The phases currently running, outermost first."""
        return list(self._active)

    def pop(self) -> dict[str, float]:
        """Return this step's ``{"time/<phase>": seconds, ..., "time/step": total}`` (and
        ``memory/<phase>`` in GiB when recording memory) and reset.

        Raises:
            RuntimeError: if called while a phase is running.
        """
        if self._active:
            raise RuntimeError(f"PhaseTimer.pop() called inside phase(s) {self._active}")
        out = {time_key(k): v for k, v in self._times.items()}
        out[MetricKey.TIME_STEP] = self._step_total
        out.update({memory_key(k): v / 2**30 for k, v in self._peaks.items()})
        self._times, self._peaks, self._step_total = {}, {}, 0.0
        return out


def cuda_peak_memory() -> int:
    """The most the CUDA allocator held since the last call (bytes); starts a new interval."""
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return peak


# ----------------------------------------------------------------------------- progress


def _is_main_process() -> bool:
    """Rank 0 of torch.distributed when initialised, else ``$RANK`` (default 0) == 0."""
    try:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return os.environ.get("RANK", "0") == "0"


class ProgressBar:
    """A tqdm progress bar over training steps with an ETA and a few metrics in its postfix.

    Writes to stderr. Disabled (every call a no-op) when ``enabled`` is False and on non-main
    ranks. Metrics that are not logged every step (``eval/acc``) keep their last value.
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True,
                 keys: Sequence[str] = DEFAULT_PROGRESS_KEYS, is_main: Optional[bool] = None,
                 file: Optional[TextIO] = None) -> None:
        """Create the bar.

        Args:
            total_steps: number of steps in the run.
            start_step: steps already done (when resuming); the ETA counts only new steps.
            enabled: False disables the bar.
            keys: metric keys shown in the postfix, in order.
            is_main: whether this is the main rank; None detects it (torch.distributed rank or
                ``$RANK``).
            file: stream to write to (default: ``sys.stderr`` at construction).

        Raises:
            ValueError: if ``total_steps`` < 0 or ``start_step`` is outside [0, total_steps].
        """
        total_steps, start_step = _check_step(total_steps), _check_step(start_step)
        if start_step > total_steps:
            raise ValueError(f"start_step {start_step} > total_steps {total_steps}")
        self.total_steps = total_steps
        self.keys = tuple(keys)
        self.enabled = bool(enabled) and (_is_main_process() if is_main is None else bool(is_main))
        self._postfix: dict[str, float] = {}
        self._bar: Any = None
        if self.enabled:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=file if file is not None else sys.stderr, desc="train")

    def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None) -> None:
        """Move the bar to ``step`` completed steps and refresh the postfix.

        Args:
            step: steps completed so far, i.e. the 1-based number of the step just finished
                (pass ``step + 1`` with a 0-based counter); clamped to ``total_steps``.
            metrics: this step's metrics; the chosen keys that are present and numeric are shown.
        """
        if self._bar is None:
            return
        step = min(_check_step(step), self.total_steps)
        for k in self.keys:
            if metrics and k in metrics:
                with contextlib.suppress(ValueError):
                    self._postfix[k] = _to_float(k, metrics[k])
        if self._postfix:
            self._bar.set_postfix_str(", ".join(f"{k}={v:.4g}" for k, v in self._postfix.items()), refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ----------------------------------------------------------------------------- reduction

_OPS = ("mean", "sum", "max")


def reduce_metrics(metrics: Mapping[str, Any], group: Any = None, op: str = "mean",
                   sum_keys: Iterable[str] = (), max_keys: Iterable[str] = ()) -> dict[str, float]:
    """Reduce a metrics dict across the ranks of ``group`` so every rank gets the same numbers.

    Keys are sorted, so ranks agree on the layout; values go into one flat float64 tensor and
    one ``all_reduce`` (plus one more if any key is max-reduced). A CRC of the key names rides
    along: ranks with different keys of the same count raise ValueError on every rank instead of
    mixing metrics up (different counts are the backend's problem: gloo errors, NCCL may hang).
    Tensors go through :mod:`cooper_mcore.collectives` (on the compute device). Without an initialised process
    group this is the identity (values converted to float).

    Args:
        metrics: name -> number or one-element tensor; every rank must pass the same keys.
        group: process group (None: the default group).
        op: reduction for keys not listed below: ``"mean"``, ``"sum"`` or ``"max"``.
        sum_keys: keys to sum (e.g. counts such as ``pairs/valid``).
        max_keys: keys to take the max of (e.g. ``time/*``: the slowest rank sets the pace).

    Returns:
        name -> reduced float.

    Raises:
        ValueError: on an unknown op, a key in both ``sum_keys`` and ``max_keys``, a non-numeric
            value, or keys that differ between ranks.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    sum_set, max_set = set(sum_keys), set(max_keys)
    if sum_set & max_set:
        raise ValueError(f"keys both summed and maxed: {sorted(sum_set & max_set)}")
    values = {k: _to_float(k, metrics[k]) for k in sorted(metrics)}
    if not (dist.is_available() and dist.is_initialized()):
        return values
    keys = list(values)
    ops = {k: "sum" if k in sum_set else "max" if k in max_set else op for k in keys}
    add_keys = [k for k in keys if ops[k] != "max"]
    max_keys_l = [k for k in keys if ops[k] == "max"]
    checksum = float(zlib.crc32("\0".join(keys).encode()))  # < 2**32: exact in float64 even summed
    world = dist.get_world_size(group)

    add = all_reduce(torch.tensor([checksum] + [values[k] for k in add_keys], dtype=torch.float64),
                     dist.ReduceOp.SUM, group).cpu().tolist()
    if add[0] != checksum * world:
        raise ValueError(f"reduce_metrics: metric keys differ between ranks (this rank has {keys})")
    out = {k: v / world if ops[k] == "mean" else v for k, v in zip(add_keys, add[1:])}
    if max_keys_l:
        mx = all_reduce(torch.tensor([values[k] for k in max_keys_l], dtype=torch.float64), dist.ReduceOp.MAX, group)
        out.update(zip(max_keys_l, mx.cpu().tolist()))
    return {k: out[k] for k in keys}
