"""Rollouts and held-out evaluation on the rollout engine.

Completions are generated and verified on the first rank of each model-parallel group (where its
engine and rule verifier live) and broadcast to the group's other ranks, so every rank then runs
the same collective Megatron passes on the same data; their routed experts (rollout routing replay)
follow as one tensor once the engine has released its memory (:func:`share_routes`). Evaluation
splits the held-out prompts across the data-parallel replicas and sums the verdicts over the world:
the rule verifier's, and an oracle's when one is given (``eval.verifier``); each replica's leader
may write its completions with both verdicts to a JSONL file (``eval.save_samples``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.atomic import atomic_open
from cooper_mcore.collectives import (
    all_reduce,
    broadcast_object_in_model_parallel_group,
    broadcast_tensor_in_model_parallel_group,
    is_group_leader,
)
from cooper_mcore.rollout.base import RolloutEngine, SamplingParams
from cooper_mcore.types import Prompt, RolloutGroup, Sample
from cooper_mcore.verify.protocols import BatchVerifier, VerdictLike
from cooper_mcore.verify.rule import GOLD_UNREADABLE


def generate_groups(engine: Optional[RolloutEngine], verifier: Optional[BatchVerifier], prompts: Sequence[Prompt],
                    group_size: int, params: SamplingParams, version: int, share: bool = True) -> list[RolloutGroup]:
    """G completions per prompt, verified against the gold answers (gold first) on the group
    leader (each sample's ``rule_correct`` and ``rule_answered`` from its outcome's ``correct`` and
    ``answered``; the group's ``gold_unreadable`` when the verifier could not read the gold), then
    (``share``) shared with the model-parallel group (:func:`share_groups`; without ``share`` only the
    leader calls it and gets them).

    Called while the engine holds its memory: the group's other ranks wait in the broadcast until the
    leader has generated, and so do not bring their training state back onto GPUs the engine uses.
    """
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
                routes = None if o.routed_experts is None else o.routed_experts.to(torch.int16)
                samples.append(Sample(prompt_id=p.id, token_ids=o.token_ids, text=o.text, logprobs=o.logprobs,
                                      finish_reason=o.finish_reason, rule_correct=v.correct,
                                      rule_answered=getattr(v, "answered", None), weight_version=version,
                                      routed_experts=routes))
            unreadable = any(getattr(v, "status", None) == GOLD_UNREADABLE
                             for v in outcomes[i * group_size:(i + 1) * group_size])
            groups.append(RolloutGroup(p, samples, gold_unreadable=unreadable))
    return share_groups(groups) if share else groups


def share_groups(groups: Optional[list[RolloutGroup]]) -> list[RolloutGroup]:
    """The leader's groups on every rank of its model-parallel group (collective over that group;
    ``groups`` on the leader, None elsewhere), without the samples' routed experts: those stay on the
    leader until :func:`share_routes`."""
    if dist.get_world_size(parallel_state.get_model_parallel_group()) == 1:
        return groups
    bare = None if groups is None else [replace(g, samples=[replace(s, routed_experts=None) for s in g.samples])
                                        for g in groups]
    shared = broadcast_object_in_model_parallel_group(bare)
    return groups if groups is not None else shared


def share_routes(groups: Sequence[RolloutGroup]) -> None:
    """Give the samples of the group's other ranks the leader's routed experts (rollout routing
    replay: int16 ``[positions, layers * top_k]`` per sample), as tensors (collective over the
    model-parallel group; every rank passes the groups :func:`generate_groups` returned it).

    Called after the engine released its memory (NCCL broadcasts go through device memory): the
    samples' row counts (int64, -1 for a sample without routes), then every sample's routes end to
    end as one tensor, each with its shape first. At the Qwen3-30B-A3B preset on 2 nodes that is up
    to 384 rollouts per replica of up to ~700 positions at 48 layers x top-8 x 2 bytes, about 0.2 GB
    (computed), which went pickled through the engine's memory window before.
    """
    if dist.get_world_size(parallel_state.get_model_parallel_group()) == 1:
        return
    samples = [s for g in groups for s in g.samples]
    leader = is_group_leader()
    rows = None
    if leader:
        rows = torch.tensor([-1 if s.routed_experts is None else len(s.routed_experts) for s in samples])
    rows = broadcast_tensor_in_model_parallel_group(rows, torch.int64).cpu().tolist()
    assert len(rows) == len(samples), (len(rows), len(samples))
    if all(n < 0 for n in rows):
        return
    routes = [s.routed_experts for s in samples if s.routed_experts is not None] if leader else None
    flat = broadcast_tensor_in_model_parallel_group(torch.cat(routes) if leader else None, torch.int16)
    if leader:
        return
    parts = iter(torch.split(flat.cpu(), [n for n in rows if n >= 0]))
    for sample, n in zip(samples, rows):
        sample.routed_experts = next(parts) if n >= 0 else None


#: the folder under the run's ``out`` that ``eval.save_samples`` writes to
EVAL_SAMPLES_DIR = "eval_samples"


@dataclass
class EvalResult:
    """Held-out avg@k accuracy over the world.

    Attributes:
        correct: completions the evaluation's checker marked correct (the oracle's count when
            :func:`evaluate` was given one, else the rule verifier's).
        total: completions evaluated.
        rule_correct: completions the rule verifier marked correct (``correct`` without an oracle).
    """

    correct: int
    total: int
    rule_correct: int = 0

    @property
    def accuracy(self) -> float:
        """correct / total (NaN with nothing evaluated)."""
        return self.correct / self.total if self.total else float("nan")

    @property
    def rule_accuracy(self) -> float:
        """rule_correct / total (NaN with nothing evaluated)."""
        return self.rule_correct / self.total if self.total else float("nan")


def eval_share(prompts: Sequence[Prompt]) -> list[Prompt]:
    """This data-parallel replica's contiguous share of the held-out prompts."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per = -(-len(prompts) // dp)
    return list(prompts[rank * per:(rank + 1) * per])


def eval_samples_path(out: str, step: int) -> str:
    """This replica's file of the evaluation after ``step``: ``<out>/eval_samples/step_<step>.jsonl``,
    ``step_<step>.dp<r>.jsonl`` when there are several data-parallel replicas."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    name = f"step_{step}.jsonl" if dp == 1 else f"step_{step}.dp{rank}.jsonl"
    return os.path.join(out, EVAL_SAMPLES_DIR, name)


def _write_samples(path: str, prompts: Sequence[Prompt], k: int, texts: Sequence[str],
                   rule: Sequence[VerdictLike], truth: Sequence[VerdictLike]) -> None:
    """One JSON line per completion: prompt_id, question, reference, completion, rule_correct, correct
    (the checker's verdict; the rule's without an oracle), written atomically."""
    with atomic_open(path) as f:
        for i, (text, r, t) in enumerate(zip(texts, rule, truth)):
            p = prompts[i // k]
            f.write(json.dumps({"prompt_id": p.id, "question": p.question, "reference": p.answer, "completion": text,
                                "rule_correct": r.correct, "correct": t.correct}, ensure_ascii=False) + "\n")


def evaluate(engine: Optional[RolloutEngine], verifier: Optional[BatchVerifier], prompts: Sequence[Prompt],
             k: int, params: SamplingParams, oracle: Optional[BatchVerifier] = None,
             samples_path: Optional[str] = None) -> EvalResult:
    """avg@k accuracy of the engine's current weights on this replica's share of ``prompts``,
    summed over all replicas (collective over the world).

    Args:
        engine, verifier: the group leader's rollout engine and rule verifier (None elsewhere).
        prompts: all held-out prompts (each replica evaluates its :func:`eval_share`).
        k: completions per prompt.
        params: sampling.
        oracle: a checker whose verdicts count as ``correct`` (the rule's go to ``rule_correct``);
            on the group leader, None elsewhere or to count the rule's verdicts.
        samples_path: where the group leader writes this replica's completions with both verdicts
            (:func:`_write_samples`; an empty file for a replica without a share); None: nowhere.
    """
    counts = torch.zeros(3, dtype=torch.float64)
    mine = eval_share(prompts)
    if is_group_leader():
        texts: list[str] = []
        rule: Sequence[VerdictLike] = []
        truth: Sequence[VerdictLike] = []
        if mine:
            assert engine is not None and verifier is not None
            outs = engine.generate([p.token_ids for p in mine for _ in range(k)], params)
            golds, texts = [p.answer for p in mine for _ in range(k)], [o.text for o in outs]
            rule = verifier.verify_batch(golds, texts)
            truth = oracle.verify_batch(golds, texts) if oracle is not None else rule
            counts = torch.tensor([sum(1.0 for v in truth if v.correct), sum(1.0 for v in rule if v.correct),
                                   float(len(rule))], dtype=torch.float64)
        if samples_path is not None:
            _write_samples(samples_path, mine, k, texts, rule, truth)
    correct, rule_correct, total = all_reduce(counts).tolist()
    return EvalResult(int(correct), int(total), int(rule_correct))
