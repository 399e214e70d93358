"""Forward passes through a TP/PP-parallel model with megatron-core's pipeline schedules."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from cooper_mcore.parallel import device


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``0..s-1`` for right-padded rows."""
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


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
