"""Forward passes through a TP/PP-parallel model with megatron-core's pipeline schedules.

Right-padded rows ``[b, s]`` (:func:`forward_only`, :func:`position_ids_for`). Packed rows
(megatron's ``thd`` layout) are micro-batching's: :mod:`cooper_mcore.micro_batching.runner` calls
the model with ``PackedSeqParams``; this module knows nothing of packs.

:func:`run_schedule` runs a list of micro-batches whose shapes may differ (token-budget
micro-batches, packs of different widths) through megatron's schedule: with pipeline parallelism it
turns on ``config.variable_seq_lengths`` for the call, so stages exchange each activation's shape
first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from cooper_mcore.parallel import device


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``0..s-1`` for right-padded rows."""
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module of DDP-style wrappers (``.module`` chains)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def valid_tokens(shape: tuple[int, int], lengths: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` True on the real tokens of right-padded rows of ``lengths`` (one packed row: ``b = 1``
    and one length, the pack's real tokens)."""
    return torch.arange(shape[1]).unsqueeze(0) < lengths.reshape(-1, 1).cpu()


def moe_padding_kwargs(model: torch.nn.Module, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's keyword that leaves padding out of a mixture-of-experts router's load balancing.

    megatron's ``GPTModel.forward(padding_mask=)`` (True = padding) reaches each MoE layer's router,
    which then counts only real tokens in the load-balancing loss's expert shares and mean
    probabilities (``compute_routing_scores_for_aux_loss``) and weighs it by them; the padding is
    still routed and computed. The first pipeline stage cuts the mask to this rank's sequence
    slice under sequence parallelism; on later stages it is cut here, as their hidden states are.

    Args:
        model: this rank's stage (DDP-wrapped or not).
        valid: ``[b, s]`` True on real tokens (:func:`valid_tokens`).

    Returns:
        ``{"padding_mask": ...}`` for a mixture-of-experts model, ``{}`` for a dense one.
    """
    inner = unwrap(model)
    config = inner.config
    if getattr(config, "num_moe_experts", None) is None:
        return {}
    mask = ~valid
    if config.sequence_parallel and not inner.pre_process:
        tp, rank = inner.pg_collection.tp.size(), inner.pg_collection.tp.rank()
        mask = mask.chunk(tp, dim=1)[rank]
    return {"padding_mask": mask.contiguous().to(next(inner.parameters()).device)}


def sequence_multiple(model: torch.nn.Module) -> int:
    """What a row length must be a multiple of: the TP size with sequence parallelism, else 1."""
    config = unwrap(model).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


@contextlib.contextmanager
def variable_seq_lengths(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Let pipeline stages exchange activation shapes for the duration of one schedule call.

    megatron's p2p communication receives activations of one fixed shape
    ``(seq_length, micro_batch_size, hidden)`` unless ``config.variable_seq_lengths`` is set; then
    it sends each shape first. Nothing changes without pipeline parallelism.
    """
    config = unwrap(model).config
    old = config.variable_seq_lengths
    config.variable_seq_lengths = old or (enabled and config.pipeline_model_parallel_size > 1)
    try:
        yield
    finally:
        config.variable_seq_lengths = old


def run_schedule(
    model: torch.nn.Module,
    forward_step: Callable,
    micro_batches: Sequence[Any],
    shapes: Sequence[tuple[int, int]],
    forward_only: bool,
) -> list:
    """megatron's forward(-backward) schedule over micro-batches of any shapes.

    Args:
        model: this rank's stage (DDP-wrapped for training).
        forward_step: megatron's ``forward_step_func(data_iterator, model)``.
        micro_batches: the items ``forward_step`` takes from its iterator, in order.
        shapes: ``(rows, columns)`` of each micro-batch's token ids (``(1, T)`` for a pack).
        forward_only: no backward pass.

    Returns:
        The schedule's per-micro-batch outputs (the last pipeline stage; ``[]`` elsewhere).
    """
    if len(shapes) != len(micro_batches) or not micro_batches:
        raise ValueError(f"run_schedule: {len(micro_batches)} micro-batches and {len(shapes)} shapes")
    varying = len(set(shapes)) > 1
    with variable_seq_lengths(model, varying):
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=len(micro_batches), seq_length=max(s for _, s in shapes),
            micro_batch_size=max(b for b, _ in shapes), forward_only=forward_only,
        ) or []


@torch.no_grad()
def forward_only(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    sequence_lengths: Optional[torch.Tensor] = None,
    micro_batch_size: Optional[int] = None,
    gather_vocab: bool = True,
) -> Optional[torch.Tensor]:
    """Run the whole (pipelined) model forward on a batch of right-padded token ids.

    Every rank of the model's TP/PP groups passes the same ``input_ids``.

    Args:
        model: this rank's stage.
        input_ids: ``[b, s]`` token ids.
        sequence_lengths: ``[b]`` lengths, for reward models (score at the last token).
        micro_batch_size: split the batch into micro-batches of this size (default: whole).
        gather_vocab: gather TP-sharded logits to the full vocabulary.

    Returns:
        On the last pipeline stage: logits ``[b, s, vocab]`` (policy) or scores ``[b]``
        (reward model, with ``sequence_lengths``); ``None`` on other stages.
    """
    model.eval()
    b, s = input_ids.shape
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch size {b} is not divisible by micro_batch_size {mbs}")
    dev = device()
    chunks = []
    for i in range(0, b, mbs):
        chunk = {"input_ids": input_ids[i:i + mbs].to(dev)}
        if sequence_lengths is not None:
            chunk["sequence_lengths"] = sequence_lengths[i:i + mbs].to(dev)
        chunks.append(chunk)
    it = iter(chunks)

    def step(data_iterator, m):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        kwargs = {}
        if "sequence_lengths" in batch:
            kwargs["sequence_lengths"] = batch["sequence_lengths"]
        out = m(ids, position_ids_for(ids), None, **kwargs)

        def collect(output):
            if gather_vocab and output.dim() == 3:
                output = tensor_parallel.gather_from_tensor_model_parallel_region(
                    output, group=m.pg_collection.tp
                )
            return torch.zeros((), device=output.device), {"out": output}

        return out, collect

    results = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=it,
        model=model,
        num_microbatches=len(chunks),
        seq_length=s,
        micro_batch_size=mbs,
        forward_only=True,
    )
    if not results:
        return None
    return torch.cat([r["out"] for r in results], dim=0)


def shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels aligned to positions: token ``t + 1`` at ``t`` (the last column repeats itself)."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
