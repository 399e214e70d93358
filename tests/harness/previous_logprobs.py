"""The trainer's log-probabilities and entropy before they were computed in chunks, kept to test the
chunked ones against: megatron's ``vocab_parallel_cross_entropy`` on an fp32 copy of the logits, and
the entropy over the whole fp32 vocabulary with the tensor-parallel group's reductions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from cooper_mcore.collectives import all_reduce


def previous_token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``labels`` under vocab-parallel ``logits`` (the previous trainer's)."""
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), labels)


def previous_vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per position of vocab-parallel logits, differentiable (the previous trainer's)."""
    logits = logits.float()
    m = logits.detach().max(dim=-1).values
    tp_group = parallel_state.get_tensor_model_parallel_group()
    m = all_reduce(m, dist.ReduceOp.MAX, tp_group)
    e = torch.exp(logits - m.unsqueeze(-1))
    z = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1), group=tp_group)
    s = tensor_parallel.reduce_from_tensor_model_parallel_region((e * logits).sum(-1), group=tp_group)
    return torch.log(z) + m - s / z
