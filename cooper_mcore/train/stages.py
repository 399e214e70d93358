"""The stages of a Cooper step outside the optimizer updates: rollouts, verification, rewards,
reward-model inputs and evaluation.

Rollouts are generated and verified on the first rank of each model-parallel group (where its
rollout engine lives) and broadcast to the group's other ranks, so every rank then runs the
same collective Megatron passes on the same data.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from cooper_mcore.data.templates import rm_input
from cooper_mcore.models.forward import forward_only
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.types import Prompt, RolloutGroup, Sample

logger = logging.getLogger(__name__)


def model_parallel_group_and_src():
    """The model-parallel group of this rank and its first (global) rank."""
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    return group, dist.get_process_group_ranks(group)[0]


def is_group_leader() -> bool:
    """Whether this rank is the first of its model-parallel group (it owns the engine)."""
    _, src = model_parallel_group_and_src()
    return dist.get_rank() == src


def broadcast_in_model_parallel_group(obj):
    """Send a picklable object from the group's first rank to the others."""
    group, src = model_parallel_group_and_src()
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def generate_groups(engine, verifier, prompts: Sequence[Prompt], group_size: int, params: SamplingParams,
                    version: int) -> list[RolloutGroup]:
    """G completions per prompt, verified against the gold answers (on the group leader), then
    shared with the model-parallel group."""
    groups = None
    if is_group_leader():
        outs = engine.generate([p.token_ids for p in prompts for _ in range(group_size)], params)
        outcomes = verifier.verify_batch([p.answer for p in prompts for _ in range(group_size)],
                                         [o.text for o in outs])
        groups = []
        for i, p in enumerate(prompts):
            samples = []
            for j in range(group_size):
                o, v = outs[i * group_size + j], outcomes[i * group_size + j]
                samples.append(Sample(prompt_id=p.id, token_ids=o.token_ids, text=o.text, logprobs=o.logprobs,
                                      finish_reason=o.finish_reason, rule_correct=v.correct,
                                      weight_version=version))
            groups.append(RolloutGroup(p, samples))
    return broadcast_in_model_parallel_group(groups)


def rm_token_batch(tokenizer, triples: Sequence[tuple[str, str, str]], pad_id: int, max_len: int,
                   pad_to_multiple: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded VerifyRM inputs ``[n, s]`` and their lengths, tokenized exactly as
    ``cooper train-rm`` does (:func:`cooper_mcore.train.reward_model.tokenize_texts`)."""
    from cooper_mcore.train.reward_model import tokenize_texts

    ids = tokenize_texts(tokenizer, [rm_input(q, ref, c) for q, ref, c in triples], max_length=max_len)
    ids = [x or [pad_id] for x in ids]
    width = -(-max(len(x) for x in ids) // pad_to_multiple) * pad_to_multiple
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, :len(x)] = torch.tensor(x)
    return out, torch.tensor([len(x) for x in ids])


def rm_scores(rm_model, ids: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Raw VerifyRM logits ``[n]`` on every rank of the model-parallel group."""
    from megatron.core import parallel_state as ps

    n = ids.shape[0]
    mbs = min(micro_batch_size, n)
    pad = -n % mbs
    if pad:  # the pipeline schedule needs equal micro-batches
        ids = torch.cat([ids, ids[:pad]])
        lengths = torch.cat([lengths, lengths[:pad]])
    out = forward_only(rm_model, ids, sequence_lengths=lengths, micro_batch_size=mbs)
    scores = torch.zeros(ids.shape[0], dtype=torch.float32)
    if out is not None:
        scores = out.float().cpu()
    pp = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1:
        dist.broadcast(scores, src=dist.get_process_group_ranks(pp)[-1], group=pp)
    return scores[:n]


def evaluate(engine, verifier, prompts: Sequence[Prompt], k: int, params: SamplingParams) -> Optional[float]:
    """avg@k accuracy of the engine's current weights on held-out prompts (group leader only)."""
    if not is_group_leader() or not prompts:
        return None
    outs = engine.generate([p.token_ids for p in prompts for _ in range(k)], params)
    verdicts = verifier.verify_batch([p.answer for p in prompts for _ in range(k)], [o.text for o in outs])
    return sum(1.0 for v in verdicts if v.correct) / len(verdicts)
