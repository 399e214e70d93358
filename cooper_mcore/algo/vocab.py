"""Log-probabilities of the sampled tokens and the token entropy from (vocab-parallel) logits, in
chunks of tokens.

A policy's logits are ``[tokens, vocabulary]``: at a 150k vocabulary one fp32 copy of a micro-batch
of 8 x 1024 tokens is 4.6 GiB. Computing ``log_softmax`` or the entropy on the whole tensor keeps
several such copies alive (the fp32 upcast, the exponentials, their product, the softmax saved for
backward). :func:`chunked_logprobs_entropy` reads the logits in their own dtype and never holds more
than one chunk of fp32 temporaries: the forward saves only the logits themselves and two fp32
numbers per token, and the backward recomputes each chunk's softmax into the gradient.

The vocabulary may be split over tensor-parallel ranks (each rank holds ``[tokens, V / tp]``); the
ranks' maxima and sums are combined with the reductions a :class:`VocabShard` carries (the
tensor-parallel group's all-reduces, as megatron's ``vocab_parallel_cross_entropy`` does), two per
call whatever the number of chunks. The backward needs no communication: each rank's gradient is
that of its own slice.

Torch only: the reductions are passed in, so this module knows nothing of process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_TOKENS", "ENTROPY_MODES", "VocabShard", "chunked_logprobs_entropy"]

#: tokens per chunk: at a 150k vocabulary one fp32 chunk is 0.58 GiB, small beside the micro-batch's
#: own logits, and large enough that each kernel still streams hundreds of MB
DEFAULT_CHUNK_TOKENS = 1024
#: ``none``: no entropy; ``metric``: the entropy, without gradient; ``grad``: the entropy, differentiable
ENTROPY_MODES = ("none", "metric", "grad")
EntropyMode = Literal["none", "metric", "grad"]


def _unchanged(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary and how to combine per-token values over all slices.

    Attributes:
        start: the vocabulary index of this rank's first logit (``tp_rank * V / tp``).
        all_reduce_max: the element-wise maximum over the slices' ranks (returns the result).
        all_reduce_sum: the element-wise sum over the slices' ranks (returns the result).
    """

    start: int = 0
    all_reduce_max: Callable[[Tensor], Tensor] = _unchanged
    all_reduce_sum: Callable[[Tensor], Tensor] = _unchanged


def chunked_logprobs_entropy(logits: Tensor, labels: Tensor, shard: Optional[VocabShard] = None,
                             chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                             entropy: EntropyMode = "none") -> tuple[Tensor, Optional[Tensor]]:
    """Log-probability of each label and (optionally) the entropy at each position, in float32.

    ``logp = l[label] - logsumexp(l)`` and ``H = -sum_v p_v log p_v`` over the whole vocabulary
    (all slices), computed ``chunk_tokens`` positions at a time; exact at any split of the
    vocabulary. Differentiable in ``logits`` (the log-probabilities always, the entropy with
    ``entropy="grad"``); the gradient has the logits' dtype, computed in float32 and rounded once.

    Args:
        logits: ``[..., V_local]`` this rank's slice of the logits (any float dtype; finite).
        labels: ``[...]`` token ids in the whole vocabulary (those outside this slice are another
            rank's).
        shard: where the slice starts and the reductions over the slices (None: the whole vocabulary).
        chunk_tokens: positions per chunk (the fp32 temporaries are a few ``chunk_tokens x V_local``).
        entropy: one of :data:`ENTROPY_MODES`.

    Returns:
        ``(logp, entropy)``: float32 tensors shaped like ``labels``; ``entropy`` is None with
        ``entropy="none"``, and detached with ``"metric"``.

    Raises:
        ValueError: shapes that do not fit, ``chunk_tokens < 1`` or an unknown ``entropy`` mode.
    """
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits [..., V] and labels [...] must agree, got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    logp, ent = _ChunkedLogprobs.apply(logits, labels, shard or VocabShard(), chunk_tokens, entropy)
    return logp, (None if entropy == "none" else ent)


def _spans(n: int, chunk: int) -> list[slice]:
    return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _local_labels(labels: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """``[T]`` indices into this slice (clamped) and whether the label lies in it."""
    idx = labels - start
    inside = (idx >= 0) & (idx < width)
    return idx.clamp(0, width - 1), inside


class _ChunkedLogprobs(torch.autograd.Function):
    """:func:`chunked_logprobs_entropy`'s forward and backward (see the module doc)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, shard: VocabShard, chunk: int,
                entropy: str) -> tuple[Tensor, Tensor]:
        width = logits.shape[-1]
        flat = logits.reshape(-1, width)
        idx, inside = _local_labels(labels.reshape(-1).to(flat.device), shard.start, width)
        spans = _spans(flat.shape[0], chunk)
        # pass 1: the global maximum per position (the max of a bf16 slice is exact in fp32)
        m = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        for s in spans:
            m[s] = flat[s].amax(dim=-1).float()
        m = shard.all_reduce_max(m)
        # pass 2: per position sum_v exp(l - m), the label's l - m and sum_v exp(l - m)(l - m), then
        # one reduction for all three
        sums = torch.zeros(3, flat.shape[0], dtype=torch.float32, device=flat.device)
        for s in spans:
            # one new fp32 tensor, shifted in place: the logits are never written (a mixed-dtype
            # subtraction would also cast the bf16 operand to a temporary copy on CPU)
            x = flat[s].to(torch.float32, copy=True).sub_(m[s, None])
            target = x.gather(1, idx[s, None]).squeeze(1)
            sums[1, s] = torch.where(inside[s], target, 0.0)
            if entropy == "none":
                sums[0, s] = x.exp_().sum(dim=-1)
            else:
                e = x.exp()
                sums[0, s] = e.sum(dim=-1)
                sums[2, s] = e.mul_(x).sum(dim=-1)
                del e
            del x
        sums = shard.all_reduce_sum(sums)
        log_z = torch.log(sums[0])
        logp = (sums[1] - log_z).view(labels.shape)
        ent = (log_z - sums[2] / sums[0]).view(labels.shape)
        ctx.save_for_backward(logits, labels, m + log_z, ent)
        ctx.shard, ctx.chunk, ctx.entropy = shard, chunk, entropy
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        logits, labels, lse, ent = ctx.saved_tensors
        ent = ent.reshape(-1)
        width = logits.shape[-1]
        flat = logits.reshape(-1, width)
        idx, inside = _local_labels(labels.reshape(-1).to(flat.device), ctx.shard.start, width)
        n = flat.shape[0]
        g_logp = torch.zeros(n, device=flat.device) if g_logp is None else g_logp.reshape(-1).float()
        with_ent = ctx.entropy == "grad" and g_ent is not None
        g_ent = g_ent.reshape(-1).float() if with_ent else None
        grad = torch.empty_like(flat)
        for s in _spans(n, ctx.chunk):
            # dlogp/dl_v = [v = label] - p_v;  dH/dl_v = -p_v (log p_v + H)
            log_p = flat[s].to(torch.float32, copy=True).sub_(lse[s, None])
            if with_ent:
                p = log_p.exp()
                p.mul_(log_p.add_(ent[s, None]).mul_(-g_ent[s, None]).sub_(g_logp[s, None]))
            else:
                p = log_p.exp_().mul_(-g_logp[s, None])
            rows = torch.arange(p.shape[0], device=p.device)
            p[rows, idx[s]] += torch.where(inside[s], g_logp[s], 0.0)
            grad[s].copy_(p)
            del p, log_p
        return grad.view(logits.shape), None, None, None, None
