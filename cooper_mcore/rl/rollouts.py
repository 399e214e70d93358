"""Rollouts and held-out evaluation on the rollout engine.

Completions are generated and verified on the first rank of each model-parallel group (where its
engine and rule verifier live) and broadcast to the group's other ranks, so every rank then runs
the same collective Megatron passes on the same data. Evaluation splits the held-out prompts
across the data-parallel replicas and sums the verdicts over the world.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state

from cooper_mcore.collectives import all_reduce, broadcast_object_in_model_parallel_group, is_group_leader
from cooper_mcore.reward.protocols import BatchVerifier
from cooper_mcore.rollout.base import RolloutEngine, SamplingParams
from cooper_mcore.types import Prompt, RolloutGroup, Sample


def generate_groups(engine: Optional[RolloutEngine], verifier: Optional[BatchVerifier], prompts: Sequence[Prompt],
                    group_size: int, params: SamplingParams, version: int) -> list[RolloutGroup]:
    """G completions per prompt, verified against the gold answers (gold first) on the group
    leader, then shared with the model-parallel group (collective over that group)."""
    groups = None
    if is_group_leader():
        assert engine is not None and verifier is not None, "the group leader owns the engine and verifier"
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
    return broadcast_object_in_model_parallel_group(groups)


@dataclass
class EvalResult:
    """Held-out avg@k accuracy over the world.

    Attributes:
        correct: completions the rule verifier marked correct.
        total: completions evaluated.
    """

    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        """correct / total (NaN with nothing evaluated)."""
        return self.correct / self.total if self.total else float("nan")


def eval_share(prompts: Sequence[Prompt]) -> list[Prompt]:
    """This data-parallel replica's contiguous share of the held-out prompts."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per = -(-len(prompts) // dp)
    return list(prompts[rank * per:(rank + 1) * per])


def evaluate(engine: Optional[RolloutEngine], verifier: Optional[BatchVerifier], prompts: Sequence[Prompt],
             k: int, params: SamplingParams) -> EvalResult:
    """avg@k accuracy of the engine's current weights on this replica's share of ``prompts``,
    summed over all replicas (collective over the world)."""
    counts = torch.zeros(2, dtype=torch.float64)
    mine = eval_share(prompts)
    if is_group_leader() and mine:
        assert engine is not None and verifier is not None
        outs = engine.generate([p.token_ids for p in mine for _ in range(k)], params)
        verdicts = verifier.verify_batch([p.answer for p in mine for _ in range(k)], [o.text for o in outs])
        counts = torch.tensor([sum(1.0 for v in verdicts if v.correct), float(len(verdicts))], dtype=torch.float64)
    correct, total = all_reduce(counts).tolist()
    return EvalResult(int(correct), int(total))
