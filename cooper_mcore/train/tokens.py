"""Token batches of ``prompt + response`` sequences and their per-token log-probabilities.

Sequences are right-padded. Everything is aligned to labels: position ``t`` holds the
log-probability of token ``t + 1``, and the loss mask is 1 where token ``t + 1`` belongs to the
response. Log-probabilities (and the entropy) are computed over the vocabulary split across the
tensor-parallel ranks, exact at any TP size without gathering it, a chunk of positions at a time
(:mod:`cooper_mcore.algo.vocab`). Used by the GRPO update (RL) and by SFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.algo.vocab import DEFAULT_CHUNK_TOKENS, EntropyMode, VocabShard, chunked_logprobs_entropy
from cooper_mcore.collectives import all_reduce, broadcast_from_last_stage
from cooper_mcore.micro_batching.packing import round_up
from cooper_mcore.micro_batching.runner import MicroBatch, MicroBatching, split_micro_batches
from cooper_mcore.models.forward import run_schedule, sequence_multiple, shifted_labels
from cooper_mcore.parallel import device


@dataclass
class TokenBatch:
    """Sequences for the policy.

    Attributes:
        input_ids: ``[n, s]`` prompt + response, right-padded (a micro-batch may be one packed row).
        loss_mask: ``[n, s]`` 1 where the label (token ``t + 1``) is a response token.
        advantages: ``[n]`` one per sequence (``[1, T]`` per token in a packed micro-batch).
        old_logp / ref_logp: ``[n, s]`` label-aligned log-probabilities (filled by the trainer).
        lengths: ``[n]`` real lengths (prompt + response).
        label_ids: ``[n, s]`` the labels, when they are not the shifted ids (packed rows).
        micro: the micro-batch this batch is (its forward pass), for micro-batches.
        engine_logp: ``[n, s]`` label-aligned log-probabilities of the response tokens under the
            rollout engine that sampled them (0 elsewhere); None when the engine gave none.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None
    label_ids: Optional[torch.Tensor] = None
    micro: Optional[MicroBatch] = None
    engine_logp: Optional[torch.Tensor] = None

    @property
    def labels(self) -> torch.Tensor:
        """``[n, s]`` the next token of every position (the last column repeats the last token)."""
        return self.label_ids if self.label_ids is not None else shifted_labels(self.input_ids)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, end: int) -> TokenBatch:
        """Rows ``start:end``."""
        def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[start:end]

        return TokenBatch(self.input_ids[start:end], self.loss_mask[start:end], cut(self.advantages),
                          cut(self.old_logp), cut(self.ref_logp), cut(self.lengths), cut(self.label_ids),
                          engine_logp=cut(self.engine_logp))

    def micro_batches(self, batching: MicroBatching, multiple: int = 1,
                      dp_group: Optional[Any] = None) -> list[TokenBatch]:
        """This rank's micro-batches (fixed, by tokens, or packed), every tensor on the device."""
        assert self.lengths is not None, "a TokenBatch from build_token_batch knows its lengths"
        dev = device()
        labels = self.labels
        out = []
        for mb in split_micro_batches(self.input_ids, self.lengths, batching, multiple, dp_group):
            old, ref, engine = (None if t is None else mb.layout(t).to(dev)
                                for t in (self.old_logp, self.ref_logp, self.engine_logp))
            adv = None if self.advantages is None else mb.per_row(self.advantages).to(dev)
            out.append(TokenBatch(mb.input_ids.to(dev), mb.layout(self.loss_mask).to(dev), adv, old, ref,
                                  mb.lengths, mb.layout(labels).to(dev), mb, engine))
        return out


def build_token_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                      pad_to_multiple: int = 8,
                      response_logprobs: Optional[Sequence[Sequence[float]]] = None) -> TokenBatch:
    """Right-pad ``prompt + response`` sequences into a :class:`TokenBatch`; with
    ``response_logprobs`` (one per response token, the rollout engine's) also its ``engine_logp``.

    Raises:
        ValueError: no sequences, a sequence with an empty prompt, or log-probabilities that do not
            match their response's tokens.
    """
    if not prompts or len(prompts) != len(responses):
        raise ValueError(f"build_token_batch: {len(prompts)} prompts and {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("build_token_batch: a prompt has no tokens")
    if response_logprobs is not None and [len(x) for x in response_logprobs] != [len(r) for r in responses]:
        raise ValueError("build_token_batch: the engine's log-probabilities do not match the responses' tokens "
                         f"({[len(x) for x in response_logprobs]} vs {[len(r) for r in responses]})")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = round_up(max(lengths), pad_to_multiple)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.float32)
    engine = None if response_logprobs is None else torch.zeros((len(prompts), width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[i, len(p) - 1:len(p) + len(r) - 1] = 1.0  # labels p..p+r-1 are the response
        if engine is not None:
            engine[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(response_logprobs[i], dtype=torch.float32)
    return TokenBatch(ids, mask, lengths=torch.tensor(lengths), engine_logp=engine)


def tp_vocab_shard(partition: int) -> VocabShard:
    """This tensor-parallel rank's slice of the vocabulary (``partition`` logits wide) and the TP
    group's all-reduces."""
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return VocabShard(start=rank * partition, all_reduce_max=lambda t: all_reduce(t, dist.ReduceOp.MAX, group),
                      all_reduce_sum=lambda t: all_reduce(t, dist.ReduceOp.SUM, group))


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Log-probabilities of ``labels`` under vocab-parallel ``logits`` ``[b, s, v/tp]`` (float32).

    Computed ``chunk_tokens`` positions at a time (:func:`~cooper_mcore.algo.vocab.chunked_logprobs_entropy`):
    no fp32 copy of the whole logits is made, and ``logits`` is never written.
    """
    return token_logprobs_and_entropy(logits, labels, "none", chunk_tokens)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, entropy: EntropyMode,
                               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probabilities of ``labels`` and the entropy at each position of vocab-parallel ``logits``
    ``[b, s, v/tp]``, exact over the whole vocabulary (the TP group's all-reduces), in chunks of
    ``chunk_tokens`` positions; the entropy as ``entropy`` says (``none``, ``metric``: no
    gradient, ``grad``: differentiable)."""
    return chunked_logprobs_entropy(logits, labels, tp_vocab_shard(logits.shape[-1]), chunk_tokens, entropy)


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, batch: TokenBatch, batching: MicroBatching,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Label-aligned log-probabilities ``[n, s]`` (forward only), on every rank of the model, the
    logits read ``chunk_tokens`` positions at a time.

    Collective over the model's TP and PP groups: the last pipeline stage computes them and
    broadcasts them to the other stages. Returned on the host; 0 past each row's length.
    """
    model.eval()
    mbs = batch.micro_batches(batching, sequence_multiple(model))

    def step(data_iterator, m):
        mb = next(data_iterator)
        logits = mb.micro.forward(m)

        def collect(output):
            return torch.zeros((), device=output.device), {"logp": token_logprobs(output, mb.labels, chunk_tokens)}

        return logits, collect

    results = run_schedule(model, step, mbs, [mb.micro.shape for mb in mbs], forward_only=True)
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for mb, r in zip(mbs, results):
        mb.micro.scatter(out, r["logp"].float().cpu())
    return broadcast_from_last_stage(out).cpu()
