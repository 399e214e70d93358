"""Wrap a Megatron model for training (DDP grad buffers, the distributed optimizer), its
learning-rate schedule, and the one guarded optimizer step every job uses.

Used for the policy (RL and SFT) and for the reward model (Cooper's pairwise step and VerifyRM's
BCE training); each model gets its own wrapper and optimizer. :func:`train_step` is the only place
that runs megatron's forward-backward schedule for training and steps an optimizer, and it never
writes a non-finite update (:func:`guarded_step`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import Router

from cooper_mcore.collectives import any_rank
from cooper_mcore.models.forward import variable_seq_lengths
from cooper_mcore.parallel import ParallelConfig
from cooper_mcore.train.moe_aux import AuxLossCounts, AuxLossScope, is_moe

#: the process groups megatron's DDP and optimizer read from an explicit collection (dense and expert)
_TRAINING_GROUPS = ("dp", "dp_cp", "tp", "pp", "ep", "mp", "expt_dp", "tp_ep_pp", "intra_dist_opt")


@dataclass
class OptimConfig:
    """Optimizer settings of one model.

    Attributes:
        lr: learning rate.
        weight_decay: decoupled weight decay (AdamW).
        adam_beta1 / adam_beta2 / adam_eps: Adam parameters.
        clip_grad: global gradient-norm clip (0 disables).
        distributed_optimizer: shard optimizer states across data-parallel ranks.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = True


def wrap_for_training(
    model: torch.nn.Module, optim: OptimConfig, per_token_loss: bool = False
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Wrap ``model`` in megatron DDP and build its optimizer (fp32 main params for bf16).

    The optimizer uses the process groups as :func:`cooper_mcore.parallel.init_distributed`
    creates them on every machine: no gloo twins of the data-parallel groups (NCCL runs have
    none, so megatron's default ``use_gloo_process_groups=True`` would assert on a GPU).

    DDP and the optimizer get the model's own process groups (``model.pg_collection``, the ones it
    was built with). For mixture-of-experts models they hold the expert groups: megatron puts the
    expert weights (``allreduce=False``) in their own gradient buffers reduced over ``expt_dp``
    and gives them their own optimizer (model-parallel group ``tp_ep_pp``), so their gradients are
    summed once per expert, not once per data-parallel replica, and the gradient norm counts each
    expert once.

    Args:
        per_token_loss: megatron-core's per-token loss mode: loss functions return
            ``(loss_sum, count, metrics)`` and gradients are divided by the total count over
            micro-batches and data-parallel ranks (a global token / pair mean). Must be set here,
            before the DDP wrapper is built (it reads the flag to drop its own ``1/dp`` scaling).
            MoE routers keep a copy of the flag (it multiplies their aux loss by their token
            count); theirs is set too.

    Raises:
        ValueError: a mixture-of-experts model at a layout whose expert copies would drift apart
            (:meth:`~cooper_mcore.parallel.ParallelConfig.expert_drift_problem`).
    """
    config = model.config
    if is_moe(model):
        drift = ParallelConfig(tp=config.tensor_model_parallel_size, ep=config.expert_model_parallel_size,
                               etp=config.expert_tensor_parallel_size).expert_drift_problem()
        if drift:
            raise ValueError(drift)
    pgs = _training_groups(model)
    config.calculate_per_token_loss = per_token_loss
    for module in model.modules():  # megatron's MoE routers copy the flag when built, before this
        if isinstance(module, Router):
            module.calculate_per_token_loss = per_token_loss
    bf16 = config.params_dtype == torch.bfloat16
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, pg_collection=pgs)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=optim.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False, pg_collection=pgs)
    _init_adam_states(optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer


def _training_groups(model: torch.nn.Module) -> ProcessGroupCollection:
    """The process groups DDP and the optimizer need, from the ones ``model`` was built with.

    megatron's DDP, given a collection without ``expt_dp``, makes a one-rank group on its own (a
    collective every rank must join, and wrong under expert parallelism), and its optimizer needs
    ``mp``, ``tp_ep_pp``, ``expt_dp`` and ``intra_dist_opt``; a model built by
    :func:`cooper_mcore.models.builder.build_model` has them all.
    """
    pgs = getattr(model, "pg_collection", None)
    if pgs is None:
        raise ValueError(f"wrap_for_training: {type(model).__name__} has no pg_collection (build it with "
                         "cooper_mcore.models.builder.build_model)")
    missing = [n for n in _TRAINING_GROUPS if not hasattr(pgs, n)]
    if missing:
        raise ValueError(f"wrap_for_training: the model's pg_collection lacks the process groups {missing}")
    return pgs


def inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a (chained) megatron optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer]) if o.optimizer is not None]


def _per_parameter_step(inner: torch.optim.Optimizer) -> bool:
    """torch's Adam/AdamW keep a ``step`` in every parameter's state; TE's and apex's FusedAdam keep
    one in each param group (and their ``state_dict`` rejects any other per-parameter entry)."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _init_adam_states(optimizer: MegatronOptimizer) -> None:
    """Create Adam's state (zero moments, step 0: the same as a fresh Adam) before any step.

    Optimizers create it lazily at the first step, and megatron-core's optimizer ``state_dict``
    needs it: without this, a model whose first update has not happened yet (a reward model that
    has seen no valid pair) could not be checkpointed.
    """
    for inner in inner_optimizers(optimizer):
        per_param = _per_parameter_step(inner)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    if per_param:
                        state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adam_step(optimizer: MegatronOptimizer) -> float:
    """Adam's step count (the same for every parameter), wherever the optimizer keeps it."""
    steps = set()
    for inner in inner_optimizers(optimizer):
        if _per_parameter_step(inner):
            steps |= {float(st["step"]) for st in inner.state.values() if "step" in st}
        else:
            steps |= {float(g.get("step", 0)) for g in inner.param_groups}
    assert len(steps) <= 1, steps
    return steps.pop() if steps else 0.0


def restore_adam_step(optimizer: MegatronOptimizer, step: float) -> None:
    """Give every parameter's Adam state its own ``step`` tensor after a checkpoint load.

    megatron-core's DistributedOptimizer.load_state_dict (torch Adam path) puts one shared step
    tensor into every parameter's state; torch Adam increments each state's step in place, so
    the shared tensor would advance once per parameter per update and bias-correct wrongly.
    Optimizers that keep the step in their param groups are restored by megatron already.
    """
    for inner in inner_optimizers(optimizer):
        if _per_parameter_step(inner):
            for st in inner.state.values():
                st["step"] = torch.tensor(float(step))


def build_scheduler(optimizer: MegatronOptimizer, lr: float, warmup_steps: int, total_steps: int,
                    weight_decay: float, min_lr: Optional[float] = None) -> OptimizerParamScheduler:
    """Linear warm-up to ``lr`` over ``warmup_steps`` optimizer steps, then constant (the paper's
    schedule), or, with ``min_lr``, cosine decay from ``lr`` to ``min_lr`` over the remaining steps."""
    if min_lr is not None:  # megatron's param groups carry their own bounds (min_lr None from its config)
        for group in optimizer.param_groups:
            group["max_lr"], group["min_lr"] = lr, min_lr
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=lr if min_lr is None else min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(total_steps, warmup_steps + 1),
        lr_decay_style="constant" if min_lr is None else "cosine", start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")


@dataclass
class StepResult:
    """What one :func:`train_step` did.

    Attributes:
        metrics: the per-micro-batch metric dicts of the last pipeline stage (empty elsewhere).
        grad_norm: the global gradient norm; NaN when the update was skipped.
        updated: whether the optimizer updated the weights.
        moe_aux_loss: the routers' load-balancing loss (mixture-of-experts models, the same on
            every rank; :mod:`cooper_mcore.train.moe_aux`), else None.
    """

    metrics: list[dict[str, Any]]
    grad_norm: float
    updated: bool
    moe_aux_loss: Optional[float] = None


def train_step(
    ddp: DistributedDataParallel,
    optimizer: MegatronOptimizer,
    forward_step: Callable,
    microbatches: Iterator,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    variable_shapes: bool = False,
    aux_counts: Optional[AuxLossCounts] = None,
) -> StepResult:
    """One optimizer step over ``num_microbatches`` micro-batches (gradient accumulation).

    Zeroes the gradient buffers, runs megatron's forward-backward schedule (1F1B under pipeline
    parallelism) and steps the optimizer through :func:`guarded_step`.

    Args:
        forward_step: megatron ``forward_step_func(data_iterator, model) -> (output, loss_fn)``;
            ``loss_fn(output)`` returns ``(loss, metrics)`` or, with per-token loss,
            ``(loss_sum, count, metrics)``. A ``"loss"`` entry of ``metrics`` is checked for
            finiteness before the update.
        seq_length / micro_batch_size: the micro-batches' shape (the largest, with ``variable_shapes``).
        variable_shapes: the micro-batches differ in shape (micro-batches by a token budget):
            pipeline stages then exchange each activation's shape first.
        aux_counts: this rank's loss units and routed tokens, which weigh the routers'
            load-balancing loss of a mixture-of-experts model trained with per-token loss
            (:class:`~cooper_mcore.train.moe_aux.AuxLossScope`); needed there, ignored for dense models.
    """
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    aux = AuxLossScope(ddp, aux_counts, num_microbatches) if is_moe(ddp) else contextlib.nullcontext()
    with aux, variable_seq_lengths(ddp, variable_shapes):
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=microbatches,
            model=[ddp],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
    metrics = list(metrics or [])
    loss_finite = all(bool(torch.isfinite(torch.as_tensor(m["loss"])).all())
                      for m in metrics if isinstance(m, dict) and "loss" in m)
    updated, grad_norm = guarded_step(optimizer, loss_finite)
    return StepResult(metrics, grad_norm, updated, aux.value if isinstance(aux, AuxLossScope) else None)


@torch.no_grad()
def guarded_step(optimizer: MegatronOptimizer, loss_finite: bool = True) -> tuple[bool, float]:
    """``optimizer.step()`` that skips the update when the loss or the gradient norm is not finite.

    megatron-core checks for inf/NaN only with a loss scaler (fp16); in fp32 and bf16 its
    ``step()`` clips with a NaN norm (a no-op) and writes NaN into every weight and Adam moment.
    This does the same work as ``step()`` (prepare the main grads, the global gradient norm,
    clipping, the inner step; bitwise the same result) but first decides, identically on every
    rank, whether to update: when ``loss_finite`` is False on any rank (one all-reduce over the
    world: every rank steps the same optimizer) or the norm is not finite, nothing is updated:
    weights, Adam moments and Adam's step count stay as they were.

    Collective over all ranks.

    Args:
        optimizer: megatron-core optimizer (chained or not).
        loss_finite: whether this rank's loss values were finite (ranks without a loss pass True).

    Returns:
        ``(updated, grad_norm)``; ``grad_norm`` is NaN when the update was skipped.
    """
    if optimizer.prepare_grads():  # fp16: the loss scaler found inf/NaN (and lowered its scale)
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())
    bad = not (loss_finite and math.isfinite(grad_norm))
    if dist.is_initialized():
        bad = any_rank(bad)
    if bad:
        return False, float("nan")
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm,
                                         opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads(), grad_norm
