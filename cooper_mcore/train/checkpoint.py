"""Training checkpoints: both models, both optimizers, schedulers, RNG, data position, step.

Layout of ``<out>/checkpoints/step_<n>/``:

* ``policy/`` and ``rm/``: megatron-core distributed checkpoints of each model with its
  optimizer state (``dp_reshardable``), scheduler state in the common part;
* ``trainer.json``: step, data-iterator state and anything JSON-able the loop keeps;
* ``rng/rank<r>.pt``: every rank's RNG states (tensors only; loaded with ``weights_only``);
* ``cooper_model.json`` in ``policy/`` and ``rm/``, so each is also a model checkpoint that
  ``cooper convert mcore-to-hf`` exports.

A checkpoint is written under ``step_<n>.tmp`` and renamed when every rank has finished, so a
folder named ``step_<n>`` is always complete; ``resume: auto`` picks the newest one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from cooper_mcore.convert.checkpoint import EXTRA_DIR, _write_meta
from cooper_mcore.models.arch import ArchSpec

logger = logging.getLogger(__name__)
_STEP_RE = re.compile(r"^step_(\d+)$")


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

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
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    np_state = json.loads(bytes(state["numpy"].numpy()).decode())
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    py = json.loads(bytes(state["python"].numpy()).decode())
    random.setstate((py[0], tuple(py[1]), py[2]))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _inner_optimizers(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def adam_step(optimizer) -> float:
    """Adam's step count (the same for every parameter)."""
    steps = {float(st["step"]) for inner in _inner_optimizers(optimizer) for st in inner.state.values()
             if "step" in st}
    assert len(steps) <= 1, steps
    return steps.pop() if steps else 0.0


def _restore_adam_step(optimizer, step: float) -> None:
    """Give every parameter's Adam state its own ``step`` tensor.

    megatron-core's DistributedOptimizer.load_state_dict (torch Adam path) puts one shared step
    tensor into every parameter's state; torch Adam increments each state's step in place, so
    the shared tensor would advance once per parameter per update and bias-correct wrongly.
    """
    for inner in _inner_optimizers(optimizer):
        for st in inner.state.values():
            st["step"] = torch.tensor(float(step))


def _model_state(ddp, optimizer, scheduler) -> dict:
    model_sd = ddp.module.sharded_state_dict() if hasattr(ddp, "module") else ddp.sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def save_training_checkpoint(
    out_dir: str, step: int, models: dict[str, tuple], trainer_state: dict[str, Any],
    archs: dict[str, tuple[ArchSpec, dict, torch.dtype]], keep: int = 2,
    extra_dirs: Optional[dict[str, str]] = None,
) -> str:
    """Save a complete training checkpoint (collective).

    Args:
        out_dir: the run's ``checkpoints/`` folder.
        step: the number of finished steps.
        models: ``{"policy": (ddp, optimizer, scheduler), "rm": (...)}``.
        trainer_state: JSON-able loop state (data position, ...).
        archs: ``{name: (arch, hf_config, dtype)}`` for each model's ``cooper_model.json``.
        keep: newest complete checkpoints to keep (older ones are deleted).
        extra_dirs: ``{name: folder}`` of tokenizer files to copy into each model's ``hf_extra/``.

    Returns:
        The checkpoint folder.
    """
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(out_dir, f"step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for name in models:
            os.makedirs(os.path.join(tmp, name))
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    for name, (ddp, opt, sched) in models.items():
        dist_checkpointing.save(_model_state(ddp, opt, sched), os.path.join(tmp, name))
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    if rank == 0:
        for name, (arch, cfg, dtype) in archs.items():
            _write_meta(os.path.join(tmp, name), arch, cfg, dtype)
            src = (extra_dirs or {}).get(name)
            if src and os.path.isdir(src):  # tokenizer files: the folder exports as a full HF model
                shutil.copytree(src, os.path.join(tmp, name, EXTRA_DIR))
        adam = {name: adam_step(opt) for name, (_, opt, _) in models.items() if opt is not None}
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size(), "adam_steps": adam, **trainer_state}, f)
    dist.barrier()
    if rank == 0:
        os.replace(tmp, final)
        _prune(out_dir, keep)
    dist.barrier()
    logger.info("checkpoint: %s", final)
    return final


def _prune(out_dir: str, keep: int) -> None:
    steps = sorted(complete_checkpoints(out_dir))
    for s in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(out_dir, f"step_{s}"), ignore_errors=True)


def complete_checkpoints(out_dir: str) -> list[int]:
    """Steps of the complete checkpoints in ``out_dir`` (``*.tmp`` folders are ignored)."""
    if not os.path.isdir(out_dir):
        return []
    steps = []
    for name in os.listdir(out_dir):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(out_dir, name, "trainer.json")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_resume(out_dir: str, resume: str) -> Optional[str]:
    """The checkpoint to resume from: ``none``, ``auto`` (the newest complete one) or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        steps = complete_checkpoints(out_dir)
        return os.path.join(out_dir, f"step_{steps[-1]}") if steps else None
    if not os.path.isfile(os.path.join(resume, "trainer.json")):
        raise ValueError(f"{resume!r} is not a complete training checkpoint (no trainer.json)")
    return resume


def load_training_checkpoint(path: str, models: dict[str, tuple]) -> dict[str, Any]:
    """Restore models, optimizers, schedulers and this rank's RNG; return the trainer state."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, "trainer.json")) as f:
        trainer_state = json.load(f)
    if trainer_state["world_size"] != dist.get_world_size():
        raise ValueError(f"{path} was written by {trainer_state['world_size']} processes, this run has "
                         f"{dist.get_world_size()} (exact resume needs the same layout)")
    for name, (ddp, opt, sched) in models.items():
        with torch.no_grad():
            state = dist_checkpointing.load(_model_state(ddp, opt, sched), os.path.join(path, name))
            module = ddp.module if hasattr(ddp, "module") else ddp
            missing, _ = module.load_state_dict(state["model"], strict=False)
            assert not [k for k in missing if not k.endswith("_extra_state")], missing
            if opt is not None:
                opt.load_state_dict(state["optimizer"])
                _restore_adam_step(opt, trainer_state["adam_steps"][name])
            if sched is not None:
                sched.load_state_dict(state["scheduler"])
    rng = torch.load(os.path.join(path, "rng", f"rank{dist.get_rank()}.pt"), weights_only=True)
    _set_rng_state(rng)
    logger.info("resumed from %s (step %d)", path, trainer_state["step"])
    return trainer_state
