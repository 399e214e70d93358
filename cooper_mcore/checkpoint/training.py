"""Training checkpoints: both models, both optimizers, schedulers, RNG, data position, step.

Layout of ``<out>/checkpoints/step_<n>/``:

* ``policy/`` and ``rm/``: megatron-core distributed checkpoints of each model with its
  optimizer state (``dp_reshardable``), scheduler state in the common part;
* ``trainer.json``: step, data-iterator state and anything JSON-able the loop keeps;
* ``rng/rank<r>.pt``: every rank's RNG states (tensors only; loaded with ``weights_only``);
* ``ranks/rank<r>.json``: a rank's own JSON-able loop state, where the loop keeps one (the rollouts an
  asynchronous run generated ahead, on each engine's rank);
* ``cooper_model.json`` in ``policy/`` and ``rm/``, so each is also a model checkpoint that
  ``cooper convert mcore-to-hf`` exports.

* ``manifest.json``: every other file of the folder with its size and CRC-32, written last.

A checkpoint is written under ``step_<n>.tmp``; when every rank has finished, rank 0 writes the
manifest and renames the folder to ``step_<n>``, so a process killed at any moment leaves either
a complete ``step_<n>`` or a ``*.tmp`` folder that is ignored (and removed later).

A part that fails to write on any rank (a full disk, a file-size limit; megatron-core's own
``CheckpointException`` included) raises :class:`CheckpointWriteError` on every rank (the ranks
agree after each part instead of meeting at a barrier, so none waits for one that failed). A
``KeyboardInterrupt`` (a second Ctrl-C) kills the writer processes megatron-core forked for this
write before it propagates. megatron-core's writer hands its results back through an in-process
queue (:mod:`cooper_mcore.compat.megatron_fixes`), not through a Manager process of its own that a
Ctrl-C or a SIGTERM sent to every process of the job could kill in the middle of the write.

Resuming verifies before loading: a ``step_<n>`` folder without a manifest, or with a file that
is missing or whose size or CRC-32 disagrees with it (a truncated copy, a flipped bit, a partial
rsync), is reported with its path and reason (``logging.warning``) and the next older checkpoint
is tried. ``resume: auto`` starts from scratch only when there is no ``step_<n>`` folder at all;
when there are some but none verifies, it raises ``ValueError`` (silently restarting a long run
from step 0 would throw its progress away; move the folders aside or set ``resume: none``).

The manifest and its check are :mod:`cooper_mcore.checkpoint.manifest`'s (CRC-32 in parallel
pieces); resuming verifies the whole checkpoint once, on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import random
import re
import shutil
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from torch.distributed.checkpoint.api import CheckpointException

from cooper_mcore.atomic import fsync_path
from cooper_mcore.checkpoint.manifest import complete_checkpoints, step_folders, verify_checkpoint, write_manifest
from cooper_mcore.checkpoint.model import EXTRA_DIR, check_checkpoint_format, drop_absent_extra_state, write_meta
from cooper_mcore.collectives import any_rank
from cooper_mcore.files import free_bytes, is_no_space
from cooper_mcore.train.faults import fault_point
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.step import adam_step, restore_adam_step

logger = logging.getLogger(__name__)
_TMP_RE = re.compile(r"^step_(\d+)\.tmp$")


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(),
             "numpy": torch.tensor(np.frombuffer(json.dumps(_np_state()).encode(), dtype=np.uint8).copy()),
             "python": torch.tensor(np.frombuffer(json.dumps(random.getstate()).encode(), dtype=np.uint8).copy()),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _np_state() -> list:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), pos, has_gauss, gauss]


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = json.loads(bytes(state["numpy"].numpy()).decode())
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    py = json.loads(bytes(state["python"].numpy()).decode())
    random.setstate((py[0], tuple(py[1]), py[2]))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model: ModelState) -> dict:
    model_sd = model.module.sharded_state_dict()
    state = {"model": model_sd}
    if model.optimizer is not None:
        state["optimizer"] = model.optimizer.sharded_state_dict(
            model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    if model.scheduler is not None:
        state["scheduler"] = model.scheduler.state_dict()
    return state


def save_training_checkpoint(
    out_dir: str, step: int, models: list[ModelState], trainer_state: dict[str, Any], keep: int = 2,
    rank_state: Optional[dict[str, Any]] = None,
) -> str:
    """Save a complete training checkpoint (collective).

    Args:
        out_dir: the run's ``checkpoints/`` folder.
        step: the number of finished steps.
        models: the models to save, each with its optimizer and schedule, each into the folder
            named by its ``name``, with its ``cooper_model.json`` and its source's tokenizer files.
        trainer_state: JSON-able loop state (data position, ...).
        keep: newest complete checkpoints to keep (older ones are deleted).
        rank_state: this rank's own JSON-able loop state (None: none).

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointWriteError: on every rank, when any rank failed to write its part (a full disk,
            a file-size limit, an I/O error); ``step_<n>.tmp`` is left behind, ignored by resume.
        KeyboardInterrupt: a second Ctrl-C (see :mod:`cooper_mcore.rl.loop`); megatron-core's
            writer processes this write started are killed first, so the exit does not wait on them.
    """
    rank = dist.get_rank()
    final = os.path.join(out_dir, f"step_{step}")
    tmp = final + ".tmp"
    writers_before = set(multiprocessing.active_children())
    try:
        with _agreed(final, "its folder"):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                for m in models:
                    os.makedirs(os.path.join(tmp, m.name))
                os.makedirs(os.path.join(tmp, "rng"))
                os.makedirs(os.path.join(tmp, "ranks"))
        for m in models:
            with _agreed(final, f"the {m.name} model's files"):
                try:
                    dist_checkpointing.save(_sharded_state(m), os.path.join(tmp, m.name))
                except CheckpointException as e:  # a BaseException: made an ordinary error here
                    raise _WriterFailed(_checkpoint_exception_text(e)) from e
            fault_point(f"ckpt_{m.name}", step)
        with _agreed(final, "the RNG states and trainer state"):
            torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
            if rank_state is not None:
                with open(os.path.join(tmp, "ranks", f"rank{rank}.json"), "w") as f:
                    json.dump(rank_state, f)
            if rank == 0:
                for m in models:
                    write_meta(os.path.join(tmp, m.name), m.arch, m.hf_config, m.dtype)
                    extra = os.path.join(m.source_ckpt, EXTRA_DIR)
                    if os.path.isdir(extra):  # tokenizer files: the folder exports as a full HF model
                        shutil.copytree(extra, os.path.join(tmp, m.name, EXTRA_DIR))
                adam = {m.name: adam_step(m.optimizer) for m in models if m.optimizer is not None}
                with open(os.path.join(tmp, "trainer.json"), "w") as f:
                    json.dump({"step": step, "world_size": dist.get_world_size(), "adam_steps": adam,
                               **trainer_state}, f)
        with _agreed(final, "the manifest"):
            if rank == 0:
                fault_point("ckpt_files", step)
                write_manifest(tmp)
                fault_point("ckpt_manifest", step)
                if os.path.exists(final):  # a corrupt or stale checkpoint of a step this run has redone
                    logger.warning("replacing the existing %s", final)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_path(out_dir)
                fault_point("ckpt_renamed", step)
                _prune(out_dir, keep, step)
    except KeyboardInterrupt:
        _kill_new_children(writers_before)
        raise
    logger.info("checkpoint: %s", final)
    return final


class CheckpointWriteError(RuntimeError):
    """A training checkpoint could not be written (raised on every rank; the message names the
    checkpoint, the part and, on the rank that failed, the cause)."""


class _WriterFailed(RuntimeError):
    """megatron-core's writer failed (its message is the cause's, type included)."""


@contextlib.contextmanager
def _agreed(final: str, part: str) -> Iterator[None]:
    """Run the block, then learn whether it failed on any rank (collective, in place of a
    barrier): a rank whose write failed does not leave the others waiting in the next barrier
    until the collective timeout, and every rank raises."""
    error: Optional[BaseException] = None
    try:
        yield
    except Exception as e:
        error = e
    if any_rank(error is not None):
        if error is None:
            cause = " on another rank (its log names the cause)"
        else:
            said = str(error) if isinstance(error, _WriterFailed) else f"{type(error).__name__}: {_first_line(error)}"
            cause = f": {said}"
            if is_no_space(error):
                free = free_bytes(final)
                cause = (f": no space left on the device (or a quota or file-size limit; "
                         f"{'unknown' if free is None else f'{free / 2**20:.1f} MiB'} free there; the writer said: "
                         f"{said})")
        raise CheckpointWriteError(f"could not write checkpoint {final} ({part}){cause}") from error


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__


def _checkpoint_exception_text(e: BaseException) -> str:
    """The innermost cause of megatron-core's ``CheckpointException`` (its ``failures`` by rank)."""
    failures = getattr(e, "failures", None) or {}
    for failure in failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        while exc.__cause__ is not None:
            exc = exc.__cause__
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return _first_line(e)


def _kill_new_children(before: set) -> None:
    """SIGKILL the processes started since ``before`` (megatron-core's forked shard writers), so
    an interrupted run neither waits for them nor leaves them writing."""
    for p in set(multiprocessing.active_children()) - before:
        with contextlib.suppress(Exception):
            p.kill()
            p.join(timeout=5)


def _prune(out_dir: str, keep: int, current: int) -> None:
    """Keep the ``keep`` newest checkpoints with a manifest; drop ``*.tmp`` leftovers of older steps."""
    steps = sorted(complete_checkpoints(out_dir))
    for s in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(out_dir, f"step_{s}"), ignore_errors=True)
    for name in os.listdir(out_dir):
        m = _TMP_RE.match(name)
        if m and int(m.group(1)) < current:
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def find_resume(out_dir: str, resume: str) -> Optional[str]:
    """The checkpoint to resume from: ``none``, ``auto`` (the newest that verifies) or a path.

    ``auto`` verifies ``step_<n>`` folders newest first (:func:`verify_checkpoint`), warns with the
    path and the reason for each one that fails, and returns the first whole one; None when
    ``out_dir`` holds no ``step_<n>`` folder at all.

    Raises:
        ValueError: ``auto`` found checkpoint folders but none verifies, or the given path is not a
            whole checkpoint.
    """
    if resume == "none":
        return None
    if resume == "auto":
        rejected = []
        for s in reversed(step_folders(out_dir)):
            path = os.path.join(out_dir, f"step_{s}")
            problem = verify_checkpoint(path)
            if problem is None:
                if rejected:
                    logger.warning("resuming from %s, the newest whole checkpoint", path)
                return path
            logger.warning("skipping checkpoint %s: %s", path, problem)
            rejected.append(f"{path} ({problem})")
        if rejected:
            raise ValueError(f"no whole checkpoint to resume from in {out_dir}: " + "; ".join(rejected)
                             + ". Move them aside or set checkpoint.resume=none to start over")
        return None
    problem = verify_checkpoint(resume)
    if problem is not None:
        raise ValueError(f"{resume!r} is not a whole training checkpoint: {problem}")
    return resume


def load_training_checkpoint(path: str, models: list[ModelState]) -> dict[str, Any]:
    """Restore models, optimizers, schedulers and this rank's RNG; return the trainer state, with this
    rank's own state under ``rank_state`` (None when it kept none)."""
    with open(os.path.join(path, "trainer.json")) as f:
        trainer_state = json.load(f)
    if trainer_state["world_size"] != dist.get_world_size():
        raise ValueError(f"{path} was written by {trainer_state['world_size']} processes, this run has "
                         f"{dist.get_world_size()} (exact resume needs the same layout): for a separate run give "
                         f"another --out; to start over in this folder (its metrics and checkpoints are deleted) "
                         f"give --resume none with checkpoint.overwrite=true; to continue it, launch "
                         f"{trainer_state['world_size']} processes with its parallel.* settings")
    for m in models:
        with torch.no_grad():
            folder = os.path.join(path, m.name)
            check_checkpoint_format(folder)  # a clear error, not megatron's traceback, for a foreign or damaged one
            state = dist_checkpointing.load(drop_absent_extra_state(_sharded_state(m), folder), folder)
            missing, _ = m.module.load_state_dict(state["model"], strict=False)
            assert not [k for k in missing if not k.endswith("_extra_state")], missing
            if m.optimizer is not None:
                m.optimizer.load_state_dict(state["optimizer"])
                restore_adam_step(m.optimizer, trainer_state["adam_steps"][m.name])
            if m.scheduler is not None:
                m.scheduler.load_state_dict(state["scheduler"])
    rng = torch.load(os.path.join(path, "rng", f"rank{dist.get_rank()}.pt"), weights_only=True)
    _set_rng_state(rng)
    own = os.path.join(path, "ranks", f"rank{dist.get_rank()}.json")
    trainer_state["rank_state"] = None
    if os.path.isfile(own):
        with open(own) as f:
            trainer_state["rank_state"] = json.load(f)
    logger.info("resumed from %s (step %d)", path, trainer_state["step"])
    return trainer_state
