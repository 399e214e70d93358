"""Megatron forward/backward for the policy: per-token log-probabilities and the GRPO update.

Sequences are ``prompt + response`` token ids, right-padded. Everything is aligned to labels:
position ``t`` holds the log-probability of token ``t + 1``, and the loss mask is 1 where token
``t + 1`` belongs to the response. Log-probabilities come from megatron's vocab-parallel cross
entropy, so they are exact at any TP size without gathering the vocabulary.

The update uses megatron-core's per-token loss mode: each micro-batch returns the *sum* of its
token losses and its token count, and megatron divides the gradients by the total count over
all micro-batches and data-parallel ranks. The loss is therefore the token mean over the whole
mini-batch, and splitting it into 1x8 or 8x1 micro-batches gives the same update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from cooper_mcore.algo import entropy_from_logits, kl_penalty, policy_loss
from cooper_mcore.models.forward import position_ids_for
from cooper_mcore.parallel import device
from cooper_mcore.train.megatron_setup import guarded_step


@dataclass
class TokenBatch:
    """Sequences for the policy.

    Attributes:
        input_ids: ``[n, s]`` prompt + response, right-padded.
        loss_mask: ``[n, s]`` 1 where the label (token ``t + 1``) is a response token.
        advantages: ``[n]`` one per sequence.
        old_logp / ref_logp: ``[n, s]`` label-aligned log-probabilities (filled by the trainer).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None

    @property
    def labels(self) -> torch.Tensor:
        return torch.cat([self.input_ids[:, 1:], self.input_ids[:, -1:]], dim=1)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, end: int) -> TokenBatch:
        def cut(t):
            return None if t is None else t[start:end]

        return TokenBatch(self.input_ids[start:end], self.loss_mask[start:end], cut(self.advantages),
                          cut(self.old_logp), cut(self.ref_logp))


def build_token_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      pad_to_multiple: int = 8) -> TokenBatch:
    """Right-pad ``prompt + response`` sequences into a :class:`TokenBatch`."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths)
    width = -(-width // pad_to_multiple) * pad_to_multiple
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[i, len(p) - 1:len(p) + len(r) - 1] = 1.0  # labels p..p+r-1 are the response
    return TokenBatch(ids, mask)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``labels`` under vocab-parallel ``logits`` ``[b, s, v/tp]``."""
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)


def vocab_parallel_entropy(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Entropy per position of vocab-parallel logits (a metric; no gradient)."""
    if dist.get_world_size(tp_group) == 1:
        return entropy_from_logits(logits.float())
    logits = logits.float()
    m = logits.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp(logits - m.unsqueeze(-1))
    z = e.sum(-1)
    s = (e * logits).sum(-1)
    dist.all_reduce(z, group=tp_group)
    dist.all_reduce(s, group=tp_group)
    return torch.log(z) + m - s / z


def _micro_batches(batch: TokenBatch, mbs: int) -> list[TokenBatch]:
    dev = device()
    out = []
    for i in range(0, len(batch), mbs):
        mb = batch.slice(i, i + mbs)
        out.append(TokenBatch(*(None if t is None else t.to(dev) for t in
                                (mb.input_ids, mb.loss_mask, mb.advantages, mb.old_logp, mb.ref_logp))))
    return out


@torch.no_grad()
def compute_logprobs(model, batch: TokenBatch, micro_batch_size: int) -> torch.Tensor:
    """Label-aligned log-probabilities ``[n, s]`` (forward only), on every rank of the model.

    Collective over the model's TP and PP groups: the last pipeline stage computes them and
    broadcasts to the other stages.
    """
    from megatron.core import parallel_state as ps

    model.eval()
    mbs = _micro_batches(batch, micro_batch_size)
    it = iter(mbs)

    def step(data_iterator, m):
        mb = next(data_iterator)
        logits = m(mb.input_ids, position_ids_for(mb.input_ids), None)

        def collect(output):
            return torch.zeros((), device=output.device), {"logp": token_logprobs(output, mb.labels)}

        return logits, collect

    results = get_forward_backward_func()(
        forward_step_func=step, data_iterator=it, model=model, num_microbatches=len(mbs),
        seq_length=batch.input_ids.shape[1], micro_batch_size=micro_batch_size, forward_only=True)
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device())
    if results:
        out = torch.cat([r["logp"] for r in results], dim=0).float()
    pp = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1:
        last = dist.get_process_group_ranks(pp)[-1]
        dist.broadcast(out, src=last, group=pp)
    return out.cpu()


def policy_update(ddp, optimizer, batch: TokenBatch, micro_batch_size: int, clip_low: float,
                  clip_high: float, kl_coef: float, kl_kind: str) -> dict[str, float]:
    """One optimizer step of GRPO on ``batch`` (token-mean loss over the whole batch).

    Requires ``ddp.config.calculate_per_token_loss`` (set by :func:`wrap_policy_for_training`).

    Returns:
        Metrics (means over this rank's response tokens): ``loss``, ``kl``, ``ratio/mean``,
        ``clip_frac``, ``entropy``, ``grad_norm``, and ``nonfinite``: 1.0 when the update was
        skipped because the loss or the gradient norm was not finite (``grad_norm`` is then NaN;
        see :func:`~cooper_mcore.train.megatron_setup.guarded_step`), else 0.0.
    """
    from megatron.core import parallel_state as ps

    assert ddp.config.calculate_per_token_loss, "wrap the policy with per-token loss"
    assert batch.advantages is not None and batch.old_logp is not None
    if kl_coef and batch.ref_logp is None:
        raise ValueError("kl_coef > 0 needs reference log-probabilities")
    tp_group = ps.get_tensor_model_parallel_group()
    mbs = _micro_batches(batch, micro_batch_size)

    def step(data_iterator, m):
        mb = next(data_iterator)
        logits = m(mb.input_ids, position_ids_for(mb.input_ids), None)

        def loss_fn(output):
            logp = token_logprobs(output, mb.labels)
            adv = mb.advantages[:, None].expand_as(logp)
            tok, stats = policy_loss(logp, mb.old_logp, adv, mb.loss_mask, clip_low=clip_low, clip_high=clip_high)
            kl = torch.zeros_like(logp)
            if kl_coef:
                kl = kl_penalty(logp, mb.ref_logp, kl_kind)
                tok = tok + kl_coef * kl
            mask = mb.loss_mask
            n = mask.sum()
            with torch.no_grad():
                ratio = torch.exp(logp - mb.old_logp)
                clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
                ent = vocab_parallel_entropy(output.detach(), tp_group)
                sums = {k: (v * mask).sum().detach() for k, v in
                        {"loss": tok.detach(), "kl": kl.detach(), "ratio/mean": ratio,
                         "clip_frac": clipped.float(), "entropy": ent}.items()}
            sums["tokens"] = n.detach()
            return (tok * mask).sum(), n.int(), sums

        return logits, loss_fn

    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    results = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(mbs), model=[ddp], num_microbatches=len(mbs),
        seq_length=batch.input_ids.shape[1], micro_batch_size=micro_batch_size, forward_only=False)
    loss_finite = all(math.isfinite(float(r["loss"])) for r in results or [])
    updated, grad_norm = guarded_step(optimizer, loss_finite)
    keys = ("loss", "kl", "ratio/mean", "clip_frac", "entropy")
    values = torch.zeros(len(keys), dtype=torch.float64)
    if results:  # the last pipeline stage
        tokens = float(sum(r["tokens"] for r in results))
        values = torch.tensor([float(sum(r[k] for r in results)) / max(tokens, 1.0) for k in keys],
                              dtype=torch.float64)
    pp = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1:  # every stage reports the same metrics
        values = values.to(device())
        dist.broadcast(values, src=dist.get_process_group_ranks(pp)[-1], group=pp)
    metrics = {"grad_norm": grad_norm, "nonfinite": 0.0 if updated else 1.0}
    metrics.update({k: float(v) for k, v in zip(keys, values.tolist())})
    return metrics
