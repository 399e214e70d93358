"""A Cooper run folder: when a run may start or continue in it, and what a resume may change.

A run folder (``out``) that already holds a run (a ``metrics.jsonl`` with lines, or anything in
``checkpoints/``) is continued only with ``checkpoint.resume: auto`` (or a checkpoint of its own);
otherwise the run is refused before any work (:func:`check_run_folder`), unless
``checkpoint.overwrite: true``, which deletes that run's files first (:data:`RUN_FILES`).

A resume is the run it resumes: its settings are compared with the newest version of the folder's
config record (:mod:`cooper_mcore.config.versions`). Settings that change what is trained differ ->
refused with one line listing them (``old -> new``), unless ``checkpoint.allow_config_change``
(``--allow-config-change``); the accepted settings become the record's next version, starting at
the resumed step. Only the settings in :data:`MAY_CHANGE` (how the run is paced, observed,
checkpointed, evaluated and laid out in memory) differ freely, and still make a version;
docs/reliability.md says why for each.

:func:`open_run_folder` does all of it on the rank that holds the folder's lock
(:func:`cooper_mcore.job.hold_run_folder`).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional

from cooper_mcore.config.schema import CooperConfig, to_dict
from cooper_mcore.config.versions import RECORD_FILE, Change, ConfigRecord, config_changes, read_record, write_record
from cooper_mcore.job import CHECKPOINTS_DIR
from cooper_mcore.metrics import METRICS_FILE
from cooper_mcore.rl.rollouts import EVAL_SAMPLES_DIR

logger = logging.getLogger(__name__)

__all__ = ["LAUNCH_KEYS", "MAY_CHANGE", "RUN_FILES", "RunStart", "check_run_folder", "clear_run_folder", "may_change",
           "open_run_folder", "record_config"]

#: what a run writes into its folder (deleted by ``checkpoint.overwrite``; nothing else is touched; the lock
#: file stays: the run that deletes holds it). ``run_config.json``: a folder's second copy of its settings,
#: written before ``config.yaml`` became the one record.
RUN_FILES = (METRICS_FILE, CHECKPOINTS_DIR, RECORD_FILE, "run_config.json", "wandb", EVAL_SAMPLES_DIR)

#: The settings (dotted keys; a key ending in "." names a section) that a resume may change without
#: ``checkpoint.allow_config_change``: none changes the data, the models, the reward or the update. Every
#: other setting is compared, new ones included.
MAY_CHANGE = (
    "out",  # the folder itself, moved or reached by another path
    "checkpoint.",  # resume / overwrite / allow_config_change are this launch's; every / keep the cadence
    "logging.",  # where the metrics go and the reward-hacking watch
    "eval.", "data.eval_path", "data.eval_limit",  # held-out evaluation measures the run, it trains nothing
    "data.skip_malformed",  # a run that started has no malformed rows to skip, or skips the same
    "train.steps",  # extending a run is how it continues (constant learning rate after warm-up)
    # how a batch is cut: the same update up to floating-point order (losses are per token of the whole batch)
    "train.micro_batch_size", "train.max_tokens_per_micro_batch", "train.pack_sequences",
    "train.logprob_chunk_tokens",
    "train.max_nonfinite_steps", "train.max_steps_without_pairs",  # when to stop or warn
    "offload.",  # where tensors wait during rollouts: bit for bit the same numbers (the rehearsal's variants)
    "rollout.bucket_mb", "rollout.sglang_mem_fraction", "rollout.sglang_base_port",  # engine memory and ports
    "rollout.engine_threads", "rollout.engine_restarts",  # an engine process's resources and patience
    "reward.verifier_timeout_s", "reward.verifier_workers",  # the verifier's resources
    # where the assistant is and how long to wait for it (its model and prompt are compared)
    "rm.assistant_url", "rm.api_key_env", "rm.assistant_timeout_s", "rm.assistant_max_retries",
    "rm.on_assistant_failure",
    "model.trust_remote_code",  # permission to run a model folder's code, not which model
    "parallel.sequence_parallel", "parallel.timeout_minutes",  # activations' layout, the collectives' patience
)


#: this launch's own settings: neither compared nor a reason for a new version (the record keeps the first's)
LAUNCH_KEYS = ("out", "checkpoint.resume", "checkpoint.overwrite", "checkpoint.allow_config_change")


def may_change(key: str) -> bool:
    """Whether a resume may change the setting ``key`` freely (:data:`MAY_CHANGE`)."""
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in MAY_CHANGE)


def _run_history(out: str) -> list[str]:
    """What in the run folder ``out`` shows that a run was there (empty: nothing to lose)."""
    found = []
    metrics = os.path.join(out, METRICS_FILE)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(METRICS_FILE)
    ckpts = os.path.join(out, CHECKPOINTS_DIR)
    if os.path.isdir(ckpts) and os.listdir(ckpts):
        found.append(f"{CHECKPOINTS_DIR}/")
    return found


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def check_run_folder(out: str, resume: str, overwrite: bool) -> bool:
    """Refuse to start a run in a folder that holds another one (before any work, on every rank,
    and again under the folder's lock in :func:`open_run_folder`).

    A run in ``out`` is continued by ``resume="auto"`` or by a checkpoint under
    ``out/checkpoints``; ``resume="none"`` or another run's checkpoint would replace its
    checkpoints and append a second history to its ``metrics.jsonl``.

    Returns:
        Whether the folder's previous run must be deleted first (``overwrite`` and there is one).

    Raises:
        FileExistsError: ``out`` holds a run that this one would not continue, and not ``overwrite``.
        ValueError: ``overwrite`` with ``resume`` naming a checkpoint inside ``out`` (it would be deleted).
    """
    history = _run_history(out)
    if not history:
        return False
    if overwrite:
        if resume not in ("none", "auto") and _inside(resume, out):
            raise ValueError(f"checkpoint.overwrite=true deletes the run in {out!r}, including the checkpoint "
                             f"{resume!r} to resume from: resume from it without overwrite, or copy it elsewhere")
        return True
    if resume == "auto" or (resume != "none" and _inside(resume, os.path.join(out, CHECKPOINTS_DIR))):
        return False
    raise FileExistsError(f"run folder {out!r} already holds a run ({', '.join(history)}); checkpoint.resume="
                          f"{resume} would replace its checkpoints and mix two histories in its metrics: use --resume "
                          "auto to continue it, another --out, or --overwrite (checkpoint.overwrite=true) to start "
                          "over (its metrics and checkpoints are deleted)")


def clear_run_folder(out: str) -> None:
    """Delete what a previous run wrote into ``out`` (:data:`RUN_FILES`; nothing else)."""
    gone = []
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        else:
            continue
        gone.append(name)
    logger.warning("checkpoint.overwrite=true: deleted the previous run's %s in %s", ", ".join(gone), out)


@dataclass
class RunStart:
    """What the run folder's holder found before the run starts (the same on every rank)."""

    record: Optional[ConfigRecord] = None
    """The folder's config record that this run continues (None: the run starts a new one)."""
    changes: list[Change] = field(default_factory=list)
    """The settings that differ from the record's newest version."""
    allowed: bool = False
    """Whether some of ``changes`` needed ``checkpoint.allow_config_change``."""


def open_run_folder(cfg: CooperConfig) -> RunStart:
    """Check the run folder again (its lock held), clear it with ``checkpoint.overwrite``, and
    compare a continued run's settings with its record (the module doc).

    Raises:
        FileExistsError / ValueError: as :func:`check_run_folder`.
        ValueError: the settings differ from the record's newest version in what the run trains, and not
            ``checkpoint.allow_config_change`` (one line listing each key, old -> new).
    """
    out = cfg.out
    if check_run_folder(out, cfg.checkpoint.resume, cfg.checkpoint.overwrite):
        clear_run_folder(out)
    if not _run_history(out):  # nothing trained here yet: the run starts its own record
        return RunStart()
    record = read_record(os.path.join(out, RECORD_FILE))
    if record is None:
        logger.warning("%s holds a run but no %s: its settings start a new record", out, RECORD_FILE)
        return RunStart()
    changes = [c for c in config_changes(record.newest.config, to_dict(cfg)) if c.key not in LAUNCH_KEYS]
    compared = [c for c in changes if not may_change(c.key)]
    if compared and not cfg.checkpoint.allow_config_change:
        n = record.newest.version
        raise ValueError(f"run folder {out!r} holds a run whose settings ({RECORD_FILE}, version {n}) differ in "
                         f"what it trains: {'; '.join(map(str, compared))}. Resume with the recorded settings, use "
                         f"another --out for a new run, or pass --allow-config-change "
                         f"(checkpoint.allow_config_change=true) to continue with these as version {n + 1}")
    return RunStart(record, changes, bool(compared))


def _as_recorded(cfg: CooperConfig) -> dict:
    """The settings as the record keeps them: without this launch's consents (overwrite,
    allow_config_change), so that running the record again deletes or changes no run unasked."""
    settings = to_dict(cfg)
    settings["checkpoint"].update(overwrite=False, allow_config_change=False)
    return settings


def record_config(cfg: CooperConfig, start: RunStart, step: int) -> None:
    """Write the run's config record once it is restored to ``step`` (the writing rank): a new record,
    or the folder's with this run's settings as its next version when they differ (logged)."""
    path = os.path.join(cfg.out, RECORD_FILE)
    if start.record is None:
        write_record(path, ConfigRecord.start(_as_recorded(cfg), step))
        return
    if not start.changes:
        return  # the same settings: the record stands as it is
    record = start.record.then(_as_recorded(cfg), step, start.changes, start.allowed)
    write_record(path, record)
    log = logger.warning if start.allowed else logger.info
    log("%s: settings version %d from step %d%s: %s", path, record.newest.version, step,
        " (allowed by checkpoint.allow_config_change)" if start.allowed else "",
        "; ".join(record.newest.changed))
