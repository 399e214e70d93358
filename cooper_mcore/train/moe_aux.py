"""The routers' load-balancing (aux) loss of a mixture-of-experts model's training step: its
gradient weight under the per-token loss mode, and its value, read per model.

megatron-core adds the loss inside each router (``MoEAuxLossAutoScaler``, ``transformer/moe/router.py``)
and records its value in one process-wide tracker (``get_moe_layer_wise_logging_tracker``,
``moe_utils.py``) that the policy and the reward model of a Cooper process share. :class:`AuxLossScope`
wraps one model's step: it clears the tracker, scales the model's aux coefficient by
:func:`cooper_mcore.algo.aux_loss_coeff_scale` for the step (the schedule's
``MoEAuxLossAutoScaler.set_loss_scale`` under ``calculate_per_token_loss`` is the loss scaler's
factor only, 1 in bf16/fp32, so megatron would weigh the aux gradient by routed tokens over the
loss's count: about 1000 times too much for a pairwise RM step of 2 x 512-token rows per pair),
then restores the coefficient and reads and clears the tracker.

The value reported is ``coef * sum over sparse layers of E * sum_i f_i P_i``, the mean over the
step's micro-batches and data-parallel ranks (summed over pipeline stages and the TP group, as
megatron's own logging does).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

from cooper_mcore.algo import aux_loss_coeff_scale
from cooper_mcore.collectives import all_reduce
from cooper_mcore.models.forward import unwrap
from cooper_mcore.parallel import device

#: the tracker's entry of the ``aux_loss`` load-balancing type (megatron's router names it so)
LOAD_BALANCING = "load_balancing_loss"


@dataclass(frozen=True)
class AuxLossCounts:
    """This rank's counts of one training step, for the aux loss's gradient weight.

    Attributes:
        loss_units: what the step's per-token loss counts on this rank, over its micro-batches
            (response tokens, valid pairs, labeled rows).
        routed_tokens: the real tokens of this rank's micro-batches (padding excluded): what the
            routers count in the load balancing (the forward passes give them the padding mask,
            :func:`cooper_mcore.models.forward.moe_padding_kwargs`), before sequence parallelism
            splits them.
    """

    loss_units: float
    routed_tokens: int

    @classmethod
    def of_shapes(cls, loss_units: float, shapes: list[tuple[int, int]]) -> AuxLossCounts:
        """The counts of micro-batches of token-id shapes ``(b, s)`` without padding."""
        return cls(float(loss_units), sum(b * s for b, s in shapes))


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` (possibly DDP-wrapped) has mixture-of-experts layers."""
    return getattr(unwrap(model).config, "num_moe_experts", None) is not None


def clear_tracker() -> None:
    """Drop every entry of megatron's aux-loss tracker (each model's step makes its own, sized to its
    layers; zeroing would leave one model's layer count for the other)."""
    get_moe_layer_wise_logging_tracker().clear()


def set_aux_loss_coef(model: torch.nn.Module, coef: float) -> None:
    """Give a mixture-of-experts model's routers the load-balancing weight ``coef`` (they read it
    from the model's config at every forward; the builder set HF's ``router_aux_loss_coef``).

    Raises:
        ValueError: ``model`` is dense, or ``coef`` is negative.
    """
    if not is_moe(model):
        raise ValueError("model.moe_aux_loss_coef is set but the model has no mixture-of-experts layers")
    if coef < 0:
        raise ValueError(f"model.moe_aux_loss_coef must be >= 0, got {coef}")
    unwrap(model).config.moe_aux_loss_coeff = float(coef)


class AuxLossScope:
    """``with AuxLossScope(ddp, counts, n) as aux: <the step>``; then ``aux.value`` is the step's aux loss.

    Collective over the model's data-parallel, pipeline and TP groups (on exit, and on entry under
    per-token loss): every rank of the model enters it. On an exception the coefficient is restored
    and the tracker cleared, with no collective.
    """

    def __init__(self, ddp: torch.nn.Module, counts: Optional[AuxLossCounts], num_microbatches: int) -> None:
        self._module = unwrap(ddp)
        self._config = self._module.config
        self._counts = counts
        self._num_microbatches = num_microbatches
        coef = self._config.moe_aux_loss_coeff
        assert isinstance(coef, (int, float)), f"one aux-loss coefficient expected, got {coef!r}"
        self._coef = float(coef)
        self.value: Optional[float] = None

    def __enter__(self) -> AuxLossScope:
        clear_tracker()
        if self._config.calculate_per_token_loss and self._coef:
            if self._counts is None:
                raise ValueError("train_step: a mixture-of-experts model trained with per-token loss needs "
                                 "aux_counts (the step's loss units and routed tokens)")
            self._config.moe_aux_loss_coeff = self._coef * self._scale(self._counts)
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._config.moe_aux_loss_coeff = self._coef
        if exc_type is None:
            self.value = self._coef * self._read()
        clear_tracker()

    def _scale(self, counts: AuxLossCounts) -> float:
        """:func:`aux_loss_coeff_scale` of the step's counts over the data-parallel ranks."""
        routed = counts.routed_tokens
        if self._config.sequence_parallel:
            # each TP rank's routers see their slice of the sequence; megatron weighs each rank's part
            # of the loss by its own real tokens, which this mean matches where padding splits evenly
            routed /= self._config.tensor_model_parallel_size
        pgs = self._module.pg_collection
        total = all_reduce(torch.tensor([counts.loss_units, routed], dtype=torch.float64, device=device()),
                           group=pgs.dp)
        return aux_loss_coeff_scale(float(total[0]), float(total[1]))

    def _read(self) -> float:
        """The tracker's load-balancing loss (divided by the coefficient) summed over layers: mean
        over micro-batches and data-parallel ranks."""
        pgs = self._module.pg_collection
        entry = get_moe_layer_wise_logging_tracker().get(LOAD_BALANCING)
        value = torch.zeros((), dtype=torch.float64, device=device())
        if entry is not None:  # a stage without sparse layers records nothing
            value += entry["values"].sum().to(value)
        for group in (pgs.pp, pgs.tp_cp, pgs.dp):  # gloo has no AVG: sum, then divide by dp below
            value = all_reduce(value, group=group)
        return float(value) / (dist.get_world_size(pgs.dp) * max(self._num_microbatches, 1))
