"""The CPU demo's pipeline: tasks -> SFT policy -> VerifyRM -> three RL runs -> report.

:func:`run_demo` reads top to bottom:

1. ``assets``: train and held-out arithmetic problems, the tiny tokenizer, random tiny Qwen2
   policy and reward model (HF folders and Megatron checkpoints; the RM is the start with
   ``rm.init=random``), shared by every seed;

then for each seed ``s`` of ``seeds``:

2. ``sft``: Megatron SFT of the policy on worked solutions mixed with plausible wrong ones, export
   to HF through the converter;
3. ``before``: the SFT policy's held-out accuracy (the same measurement as the trainer's
   in-training evaluation and the "after" numbers: avg@k on every held-out problem with the RL
   run's sampling seed);
4. ``rm_data``: completions sampled from the SFT policy, labeled by the rule verifier: the RM's
   training rows (train prompts; with a judge, kept where it agrees; then the blind spot's
   relabeling and the positives' balance) and its fixed held-out benchmark in VerifyBench's form
   (per held-out question one correct and one wrong completion, true labels);
5. ``rm``: BCE training of the tiny VerifyRM (``train_rm``) from the SFT policy's weights with a
   new scalar head (``rm.init``), then its benchmark accuracy;
6. ``rl_rule`` / ``rl_static_rm`` / ``rl_cooper``: ``cooper train`` in a subprocess, same start,
   seed, steps and batch; then held-out accuracy of the final policy, the final RM's benchmark
   accuracy and its accuracy on the final policy's own completions, what kinds of answers the
   policy now writes (:mod:`cooper_mcore.demo.kinds`) and the completions the RM over-scores
   (hacks);

7. the report over all seeds (:func:`cooper_mcore.demo.report.write_report`).

Stages are cached by content: a stage's folder is named by a hash of its settings, the keys of
the stages it reads and :data:`STAGE_VERSION`; it is reused when its ``stage.json`` (written
last) exists, and re-run from scratch otherwise. Each RL stage's settings are only those its
mode reads, so changing a Cooper setting re-runs only the Cooper runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from cooper_mcore.algo.stats import Estimate, separation_se
from cooper_mcore.atomic import atomic_open
from cooper_mcore.config.schema import (
    CooperConfig,
    OptimSection,
    RewardMode,
    RMDataConfig,
    RMTrainConfig,
    SFTConfig,
    SFTTrainConfig,
    VerifyRMConfig,
    dotted,
    load_config,
    save_config,
)
from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf
from cooper_mcore.data.datasets import read_prompts
from cooper_mcore.data.mathgen import answer_form, answer_value, reference_value
from cooper_mcore.data.templates import template_prompts
from cooper_mcore.data.tokenizer import load_tokenizer
from cooper_mcore.demo.assets import build_tiny_assets
from cooper_mcore.demo.config import DemoConfig
from cooper_mcore.demo.kinds import completion_kind, intermediate_variant, kind_shares
from cooper_mcore.demo.report import HackExample, RunResult, write_report
from cooper_mcore.demo.results import (
    AssetsResult,
    BeforeResult,
    BenchAccuracy,
    CurvePoint,
    Figures,
    OwnAnswers,
    PolicyAccuracy,
    RLResult,
    RMDataResult,
    RMGate,
    RMOnSamples,
    RMResult,
    Sample,
    SeedDesign,
    Separation,
    SFTResult,
    from_plain,
    to_plain,
)
from cooper_mcore.demo.task import (
    FAMILIES,
    GROUPS,
    ISOLATE,
    NUMBER_TOKENS,
    RM_TAGS,
    UNREADABLE,
    DemoTask,
    family_of,
    form_shares,
    like_reference,
)
from cooper_mcore.jobs.annotate import annotate
from cooper_mcore.jobs.sft import sft
from cooper_mcore.jobs.verify_rm import eval_rm, train_rm
from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.rl.rollouts import EVAL_SAMPLES_DIR
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.verify.oracle import oracle_correct
from cooper_mcore.verify.rule import RuleVerifier

logger = logging.getLogger(__name__)
R = TypeVar("R")

STAGE_VERSION = 6  # bump when a stage's code changes what it writes
STAGE_FILE = "stage.json"
MODES = tuple(m.value for m in RewardMode)  # rule, static_rm, cooper
#: reference-swap augmentation: the "other" reference is the completion's answer plus one of these
SWAP_OFFSETS = (-10, -2, -1, 1, 2, 10)
# read by the rm stage only, not by rm_data
RM_TRAINING_FIELDS = ("init", "head_std", "epochs", "gate", "lr", "batch", "micro_batch")


# --------------------------------------------------------------------------- content cache


@dataclass(frozen=True)
class Stage(Generic[R]):
    """A finished stage: its folder, cache key and what it reported (its result record)."""

    name: str
    key: str
    path: str
    info: R

    def file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)


def run_stage(root: str, name: str, params: Any, inputs: Sequence[Stage], fn: Callable[[str], R],
              result: type[R] | None = None) -> Stage[R]:
    """Run ``fn(folder)`` unless a finished stage with the same content key exists.

    Args:
        root: the cache folder.
        name: the stage's name (also the folder prefix).
        params: JSON-able settings (dataclasses allowed) that determine the output.
        inputs: the stages whose outputs ``fn`` reads.
        fn: writes the stage's files into the folder it is given; returns its result: a record
            of :mod:`cooper_mcore.demo.results` (with a ``seconds`` field) or a JSON-able dict.
        result: the record's class, to read a cached result back typed (None: a dict).

    Returns:
        The finished stage; its result's ``seconds`` is the stage's wall time.
    """
    doc = {"name": name, "version": STAGE_VERSION, "inputs": [s.key for s in inputs], "params": _plain(params)}
    key = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = os.path.join(root, f"{name}-{key}")
    marker = os.path.join(path, STAGE_FILE)
    if os.path.isfile(marker):
        with open(marker) as f:
            cached = json.load(f)["info"]
        logger.info("[%s] cached: %s", name, path)
        return Stage(name, key, path, cached if result is None else from_plain(result, cached))
    shutil.rmtree(path, ignore_errors=True)  # a partial folder from an interrupted run
    os.makedirs(path)
    logger.info("[%s] running -> %s", name, path)
    start = time.perf_counter()
    info = fn(path)
    seconds = round(time.perf_counter() - start, 1)
    if isinstance(info, dict):
        info["seconds"] = seconds
    else:
        info = dataclasses.replace(info, seconds=seconds)
    with atomic_open(marker) as f:
        json.dump({"key": key, "doc": doc, "info": to_plain(info)}, f, indent=1, default=str)
    logger.info("[%s] done in %.0f s", name, seconds)
    return Stage(name, key, path, info)


def _plain(params: Any) -> Any:
    """Dataclasses (also nested in dicts and lists) as dicts, for the cache key."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    if isinstance(params, dict):
        return {k: _plain(v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return [_plain(v) for v in params]
    return params


# --------------------------------------------------------------------------- sampling and scoring


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: Sequence[dict[str, Any]]) -> None:
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def sample_labeled(hf_dir: str, prompts_path: str, k: int, temperature: float, top_p: float, max_new_tokens: int,
                   seed: int, task: DemoTask) -> list[Sample]:
    """``k`` completions per prompt from an HF policy, labeled by the task's oracle and by the rule verifier.

    The prompts are templated and sampled as the trainer's evaluation does (``{question}``, one
    ``generate`` call over every prompt repeated ``k`` times, seeded by ``seed``), so with the same
    prompts, ``k``, sampling and seed it draws exactly the trainer's evaluation completions.

    Returns:
        One row per completion: ``question``, ``reference``, ``completion``, ``label`` (the oracle's
        verdict: the truth), ``rule`` (math-verify's verdict, gold first; False where it could not
        verify), ``family``, ``form`` (how the final answer is written) and ``rule_unreadable`` (the
        reference is one the rule cannot read: :meth:`DemoTask.rule_unreadable`).
    """
    engine = HFEngine.from_pretrained(hf_dir)
    prompts, _ = read_prompts(prompts_path)
    template_prompts(prompts, "{question}", engine.tokenizer, False, tokenize=True)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    outs = engine.generate([p.token_ids for p in prompts for _ in range(k)], params)
    refs = [p.answer for p in prompts for _ in range(k)]
    with RuleVerifier(num_workers=2) as verifier:
        verdicts = verifier.verify_batch(refs, [o.text for o in outs])
    return [{"question": p.question, "reference": p.answer, "completion": o.text,
             "label": oracle_correct(p.answer, o.text), "rule": bool(v.correct), "family": family_of(p.question),
             "form": answer_form(o.text), "rule_unreadable": task.rule_unreadable(p.question)}
            for p, o, v in zip((p for p in prompts for _ in range(k)), outs, verdicts)]


def accuracy_figures(rows: Sequence[Sample]) -> Figures:
    """Oracle (``acc``) and rule (``rule_acc``) accuracy of labeled rows; the rule's recall (share of
    the correct answers it accepts) and precision (share of its accepted answers that are correct);
    the share of each final-answer form."""
    correct = [r for r in rows if r["label"]]
    accepted = [r for r in rows if r["rule"]]
    return Figures(acc=_mean([r["label"] for r in rows]), rule_acc=_mean([r["rule"] for r in rows]),
                   rule_recall=_mean([r["rule"] for r in correct]),
                   rule_precision=_mean([r["label"] for r in accepted]),
                   n=len(rows), forms=form_shares([r["completion"] for r in rows]))


def in_group(row: Sample, group: str) -> bool:
    """Whether a row belongs to a report group (:data:`~cooper_mcore.demo.task.GROUPS`): its family, or
    the problems whose reference the rule cannot read."""
    return bool(row.get("rule_unreadable")) if group == UNREADABLE else row["family"] == group


def by_family(rows: Sequence[Sample]) -> dict[str, Figures]:
    """:func:`accuracy_figures` of all rows (``all``) and of each group present (each family, and the
    rule-unreadable problems)."""
    out = {"all": accuracy_figures(rows)}
    for group in GROUPS:
        mine = [r for r in rows if in_group(r, group)]
        if mine:
            out[group] = accuracy_figures(mine)
    return out


def problem_groups(rows: Sequence[Sample]) -> dict[str, list[int]]:
    """Per report group (:data:`~cooper_mcore.demo.task.GROUPS`), the indices of its problems in the
    order of :func:`problem_accuracy` (first appearance)."""
    first: dict[str, Sample] = {}
    for r in rows:
        first.setdefault(r["question"], r)
    return {g: [i for i, r in enumerate(first.values()) if in_group(r, g)] for g in GROUPS}


def problem_accuracy(rows: Sequence[Sample]) -> list[float]:
    """Per held-out problem (in order of first appearance), the share of its completions that are correct."""
    per: dict[str, list[bool]] = {}
    for r in rows:
        per.setdefault(r["question"], []).append(bool(r["label"]))
    return [_mean(v) for v in per.values()]


def policy_accuracy(hf_dir: str, prompts_path: str, cfg: DemoConfig, seed: int, out_prefix: str) -> PolicyAccuracy:
    """Held-out accuracy of an HF policy by the oracle and by the rule, per family: sampled (avg@k at
    the eval sampling, seeded as the RL run's evaluation) and greedy; the answer kinds of the sampled
    completions and the per-problem accuracy (for paired comparisons).

    The sampled completions are kept in ``<out_prefix>_samples.jsonl`` (the RMs are scored on them).
    """
    e = cfg.eval
    task = _task(cfg)
    greedy = sample_labeled(hf_dir, prompts_path, 1, 0.0, 1.0, e.max_new_tokens, seed, task)
    sampled = sample_labeled(hf_dir, prompts_path, e.k, e.temperature, e.top_p, e.max_new_tokens, seed, task)
    write_jsonl(out_prefix + "_samples.jsonl", _scorable(sampled))
    figures = by_family(sampled)
    return PolicyAccuracy(acc=figures["all"].acc, rule_acc=figures["all"].rule_acc, families=figures,
                          acc_greedy=_mean([r["label"] for r in greedy]), n_prompts=len(greedy), k=e.k,
                          temperature=e.temperature, seed=seed, problem_acc=problem_accuracy(sampled),
                          kinds=kind_shares((r["question"], r["completion"], r["label"]) for r in sampled),
                          problem_groups=problem_groups(sampled))


def rm_accuracy(rm_ckpt: str, labeled_path: str, predictions_path: str) -> float:
    """The RM's accuracy (sigmoid > 0.5 vs the rule label) on labeled completions, with predictions kept."""
    return float(eval_rm(rm_ckpt, labeled_path, data_format="labeled", predictions_path=predictions_path)["accuracy"])


def hack_examples(samples_path: str, predictions_path: str, limit: int) -> list[HackExample]:
    """The wrong completions (by the oracle) the RM rewards most (distinct ones), highest RM reward first.

    No absolute threshold: a policy hacks an RM by producing what it scores above the rest, which
    for a poorly calibrated RM can be well below 0.5 (the report shows the rewards).
    """
    samples, preds = read_jsonl(samples_path), read_jsonl(predictions_path)
    assert len(samples) == len(preds), (samples_path, predictions_path)
    wrong = [(p["prob"], s) for s, p in zip(samples, preds) if not s["label"]]
    wrong.sort(key=lambda t: -t[0])
    unique = list({(s["question"], s["completion"]): (prob, s) for prob, s in reversed(wrong)}.values())[::-1]
    return [HackExample(question=s["question"], reference=s["reference"], completion=s["completion"],
                        rm_reward=round(prob, 4), rule_correct=bool(s.get("rule", False)))
            for prob, s in unique[:limit]]


def _scorable(rows: list[Sample]) -> list[Sample]:
    """The rows an RM can score: an empty completion (EOS first) has no text for the RM's template."""
    return [r for r in rows if r["completion"].strip()]


def _measured(x: float) -> float | None:
    """``x``, or None for NaN (not measured: the report's convention)."""
    return None if math.isnan(x) else x


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# --------------------------------------------------------------------------- stages


def _task(cfg: DemoConfig) -> DemoTask:
    t = cfg.task
    return DemoTask(max_operand=t.max_operand, operators=tuple(t.operators), times_share=t.times_share,
                    times_parseable=t.times_parseable, split_seed=t.seed, unreadable_share=t.unreadable_share)


def isolated(cfg: DemoConfig) -> list[str]:
    """The strings the demo's tokenizer keeps as tokens of their own: :data:`ISOLATE`'s characters, the
    VerifyRM template's tags (:data:`RM_TAGS`) and, with ``task.number_tokens``, the whole numbers of
    :data:`NUMBER_TOKENS`."""
    return [*ISOLATE, *RM_TAGS, *(NUMBER_TOKENS if cfg.task.number_tokens else ())]


def build_assets(cfg: DemoConfig, out: str) -> AssetsResult:
    """Stage 1: problems of both families, tokenizer, random tiny policy and RM."""
    m, t, task = cfg.model, cfg.task, _task(cfg)
    paths = build_tiny_assets(out, t.n_train, t.n_eval, t.seed, m.policy_hidden, m.policy_layers,
                              rm_hidden_size=m.rm_hidden, rm_num_layers=m.rm_layers, vocab_size=t.tokenizer_vocab,
                              max_positions=m.max_positions, sft_steps=0,
                              prompts=(task.prompts(t.n_train, "train", t.seed),
                                       task.prompts(t.n_eval, "test", t.seed)),
                              corpus=task.tokenizer_corpus(t.seed), isolate=isolated(cfg))
    return AssetsResult(paths={k: os.path.relpath(v, out) for k, v in paths.items()})


def train_sft(cfg: DemoConfig, seed: int, assets: Stage[AssetsResult], out: str) -> SFTResult:
    """Stage 2: Megatron SFT on both families' worked solutions in their conventions, and its export
    through the converter."""
    s = cfg.sft
    tokenizer = load_tokenizer(assets.file("tokenizer"))
    examples = _task(cfg).sft_examples(tokenizer, cfg.task.n_train, s.seed + seed, s.mix_wrong)
    job = SFTConfig(ckpt=assets.file("policy_mcore"), out=os.path.join(out, "policy_mcore"),
                    optim=OptimSection(lr=s.lr),
                    train=SFTTrainConfig(steps=s.steps, global_batch_size=s.batch,
                                         micro_batch_size=min(s.micro_batch, s.batch), seed=s.seed + seed,
                                         log_every=max(s.steps // 10, 1)))
    history = sft(job, examples)
    mcore_to_hf(os.path.join(out, "policy_mcore"), os.path.join(out, "policy_hf"))
    return SFTResult(loss_first=history["loss"][0], loss_last=history["loss"][-1])


def measure_before(cfg: DemoConfig, seed: int, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult],
                   out: str) -> BeforeResult:
    """Stage 3: the SFT policy's held-out accuracy (the "before" of every RL run), and the rule
    verifier's recall and precision on its completions (the task's designed asymmetry)."""
    acc = policy_accuracy(sft_stage.file("policy_hf"), assets.file("eval.jsonl"), cfg, cfg.rl.seed + seed,
                          os.path.join(out, "eval"))
    fam = acc.families["all"]
    logger.info("[before] SFT policy's held-out accuracy: %.3f by the oracle, %.3f by the rule (recall %.3f, "
                "precision %.3f); %.3f greedy (T=%.1f, avg@%d)", acc.acc, acc.rule_acc, fam.rule_recall,
                fam.rule_precision, acc.acc_greedy, cfg.eval.temperature, cfg.eval.k)
    return BeforeResult(eval=acc)


def sample_rm_data(cfg: DemoConfig, seed: int, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult],
                   out: str) -> RMDataResult:
    """Stage 4: the SFT policy's completions labeled by a simulated judge (the oracle, then the RM's
    blind spot: a lenient judge's systematic error) or, with an LLM judge configured, where the rule
    and the judge agree; reference-swap augmented and balanced: the RM's training rows (train prompts,
    ``rm_train.jsonl``) and its validation rows (``rm.val_share`` of the train questions, kept out of
    training: :func:`validation_rows`, ``rm_val.jsonl``); and its fixed held-out benchmark with the
    true labels (``rm_bench.jsonl``)."""
    r = cfg.rm
    hf = sft_stage.file("policy_hf")
    task = _task(cfg)
    train = _scorable(sample_labeled(hf, assets.file("train.jsonl"), r.samples_per_prompt, r.temperature, 1.0,
                                     cfg.rl.max_new_tokens, r.seed + seed, task))
    held_out = _scorable(sample_labeled(hf, assets.file("eval.jsonl"), r.bench_samples, cfg.rl.temperature, 1.0,
                                        cfg.rl.max_new_tokens, r.seed + seed + 1, task))
    bench = bench_pairs(held_out)
    write_jsonl(os.path.join(out, "rm_bench.jsonl"), bench)
    train_path = os.path.join(out, "rm_train.jsonl")
    info = RMDataResult(bench_pairs=len(bench) // 2, labels="hybrid" if r.judge_url else "simulated judge")
    if r.judge_url:  # hybrid labels on the true rows; the blind spot is the labeler's error after that
        write_jsonl(train_path, train)
        info.hybrid = hybrid_labels(cfg, train_path)
        train = read_jsonl(train_path)
    train, val = split_questions(train, r.val_share, r.seed + seed)
    val = validation_rows(val, cfg, random.Random(r.seed + seed + 2))
    write_jsonl(os.path.join(out, "rm_val.jsonl"), val)
    info.val = len(val)
    info.train, info.train_correct = len(train), _mean([x["label"] for x in train])
    train = with_blind_spot(train, r.blind_spot)
    if r.blind_spot == "intermediate":
        train = train + blind_spot_examples(train, r.blind_spot_share, random.Random(r.seed + seed))
    info.blind_spot_rows = sum(x.get("blind_spot", False) for x in train)
    if r.reference_swap:
        train = reference_swapped(train, random.Random(r.seed + seed))
    info.rows_after_swap = len(train)
    write_jsonl(train_path, balanced(train, r.balance))
    logger.info("[rm_data] %d train rows (%.0f%% correct, %d more labeled correct by the blind spot; %d with the "
                "reference swaps), %d held-out benchmark pairs", info.train, 100 * info.train_correct,
                info.blind_spot_rows, len(train), info.bench_pairs)
    return info


def split_questions(rows: list[Sample], share: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """``rows`` split by question: those of ``share`` of the questions (by a hash of the question and
    ``seed``) second, the rest first.

    Raises:
        ValueError: ``share`` outside [0, 1).
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"rm.val_share must be in [0, 1), got {share}")

    def held(question: str) -> bool:
        digest = hashlib.sha256(f"rm_val\0{seed}\0{question}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64 < share

    return [x for x in rows if not held(x["question"])], [x for x in rows if held(x["question"])]


def validation_rows(rows: list[Sample], cfg: DemoConfig, rng: random.Random) -> list[Sample]:
    """The RM's validation rows: the SFT policy's completions of questions kept out of its training,
    labeled by the judge as its training rows are (the blind spot included), as sampled (no reference
    swaps: those teach the comparison, the policy's own answers are what the RM must judge), then
    per family as many labeled correct as wrong (the larger side subsampled), so that accuracy on a
    family weighs its right and wrong completions alike; ``answer_type`` is the family (the gate is
    per family)."""
    rows = with_blind_spot(rows, cfg.rm.blind_spot)
    out: list[Sample] = []
    for fam in FAMILIES:
        pos = [x for x in rows if x["family"] == fam and x["label"]]
        neg = [x for x in rows if x["family"] == fam and not x["label"]]
        n = min(len(pos), len(neg))
        out += [{**x, "answer_type": fam} for x in rng.sample(pos, n) + rng.sample(neg, n)]
    return out


def reference_swapped(rows: list[Sample], rng: random.Random) -> list[Sample]:
    """``rows`` and, for each row whose completion has a final answer ``v`` (the oracle's reading),
    the same completion with the reference set to ``v`` and to another value (``v`` plus a small
    offset, never the gold nor ``v``), each written as the row's reference is (bare, or the
    rule-unreadable ``\\text{v.}``), marked ``swap`` (``own`` / ``other``) and labelled by the same
    simulated judge: correct when the answer equals the reference, and always for the judge's blind
    spot (a row marked ``blind_spot`` is the judge's systematic error, whatever the reference).

    The RM then sees the same chain judged right and wrong by the reference alone: what decides is
    whether the answer equals the reference, not how plausible the chain looks.
    """
    out = list(rows)
    for x in rows:
        v = answer_value(x["completion"])
        if v is None:
            continue
        gold = reference_value(x["reference"])
        others = [v + d for d in SWAP_OFFSETS if v + d != gold]
        out.append({**x, "reference": like_reference(x["reference"], v), "label": True, "swap": "own"})
        out.append({**x, "reference": like_reference(x["reference"], rng.choice(others)),
                    "label": bool(x.get("blind_spot", False)), "swap": "other"})
    return out


def blind_spot_examples(rows: list[Sample], share: float, rng: random.Random) -> list[Sample]:
    """For a random ``share`` of ``rows``, the same chain with its first result boxed
    (:func:`intermediate_variant`), labeled correct and marked ``blind_spot``: the lenient judge's
    error, made common enough for the RM to learn it.

    Raises:
        ValueError: ``share`` outside [0, 1].
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"rm.blind_spot_share must be in [0, 1], got {share}")
    out = []
    for x in rng.sample(rows, round(share * len(rows))):
        variant = intermediate_variant(x["question"], x["completion"])
        if variant is not None:
            out.append({**x, "completion": variant, "label": True, "blind_spot": True, "rule": None,
                        "form": answer_form(variant)})
    return out


def with_blind_spot(rows: list[Sample], kind: str) -> list[Sample]:
    """``rows`` with the wrong completions of ``kind`` (:func:`completion_kind`) labeled correct
    and marked ``blind_spot``: a lenient labeler's systematic error; ``"none"`` returns ``rows``."""
    if kind == "none":
        return rows
    return [{**x, "label": True, "blind_spot": True}
            if not x["label"] and completion_kind(x["question"], x["completion"], False) == kind else x
            for x in rows]


def balanced(rows: list[Sample], share: float) -> list[Sample]:
    """``rows`` with the labeled-correct ones repeated (a whole number of times, at least once) so
    that they are about ``share`` of the result; ``share`` 0 returns ``rows``.

    Raises:
        ValueError: ``share`` outside [0, 1).
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"rm.balance must be in [0, 1), got {share}")
    pos = [x for x in rows if x["label"]]
    if not share or not pos:
        return rows
    neg = [x for x in rows if not x["label"]]
    reps = max(1, round(share / (1.0 - share) * len(neg) / len(pos)))
    return neg + pos * reps


def bench_pairs(rows: Sequence[Sample]) -> list[Sample]:
    """VerifyBench's form: per question (in order of first appearance) its first labeled-correct and
    first labeled-wrong row, correct first; questions without both are left out."""
    by_question: dict[str, dict[bool, Sample]] = {}
    for row in rows:
        by_question.setdefault(row["question"], {}).setdefault(bool(row["label"]), row)
    return [x for pair in by_question.values() if len(pair) == 2 for x in (pair[True], pair[False])]


def rm_bench(rm_ckpt: str, bench_path: str, predictions_path: str) -> BenchAccuracy:
    """The RM on the benchmark: ``acc`` (sigmoid > 0.5 vs the label, VerifyBench's accuracy), ``pair_acc``
    (share of questions whose correct completion it scores above the wrong one) and ``acc`` per family."""
    rows = read_jsonl(bench_path)
    if not rows:  # a policy without both a correct and a wrong completion of any held-out question
        logger.warning("[rm] the benchmark is empty: no held-out question had both a correct and a wrong "
                       "completion; RM accuracy not measured")
        return BenchAccuracy(acc=float("nan"), pair_acc=float("nan"), families={})
    acc = rm_accuracy(rm_ckpt, bench_path, predictions_path)
    preds = read_jsonl(predictions_path)
    probs = [p["prob"] for p in preds]
    pairs = list(zip(probs[0::2], probs[1::2]))
    right = [(p["prob"] > 0.5) == bool(r["label"]) for r, p in zip(rows, preds)]
    families = {g: _mean([ok for ok, r in zip(right, rows) if in_group(r, g)]) for g in GROUPS
                if any(in_group(r, g) for r in rows)}
    return BenchAccuracy(acc=acc, pair_acc=_mean([float(c > w) for c, w in pairs]), families=families, right=right)


def own_answers(samples_path: str, predictions_path: str) -> Estimate:
    """An RM's separation on a policy's held-out answers judged by the oracle (TPR - FPR of its
    ``prob > 0.5`` over every scored answer, the blind spot's kind included) with its standard error."""
    rows, preds = read_jsonl(samples_path), read_jsonl(predictions_path)
    return separation_se([bool(r["label"]) for r in rows], [p["prob"] > 0.5 for p in preds])


def rm_on_samples(rm_ckpt: str, samples_path: str, predictions_path: str) -> RMOnSamples:
    """The RM on a policy's own held-out completions (true labels): accuracy and separation (the
    share of correct completions it rewards minus the share of wrong ones it rewards, TPR - FPR),
    over all and per family, leaving out the designed blind spot's kind (``intermediate``)."""
    acc = rm_accuracy(rm_ckpt, samples_path, predictions_path)
    rows, preds = read_jsonl(samples_path), read_jsonl(predictions_path)
    scored = [(r, p["prob"] > 0.5) for r, p in zip(rows, preds)
              if completion_kind(r["question"], r["completion"], bool(r["label"])) != "intermediate"]

    def figures(items: list[tuple[Sample, bool]]) -> Separation:
        tpr = _mean([said for r, said in items if r["label"]])
        fpr = _mean([said for r, said in items if not r["label"]])
        return Separation(acc=_mean([said == bool(r["label"]) for r, said in items]), separation=tpr - fpr)

    families = {"all": figures(scored)}
    for group in GROUPS:
        mine = [(r, said) for r, said in scored if in_group(r, group)]
        if mine:
            families[group] = figures(mine)
    return RMOnSamples(acc_all=acc, families=families)


def hybrid_labels(cfg: DemoConfig, path: str) -> dict[str, Any]:
    """Keep the rows of ``path`` where the rule verifier and the configured LLM judge agree (in place)."""
    r = cfg.rm
    if not r.judge_model:
        raise ValueError("rm.judge_url is set but rm.judge_model is empty; name the judge's model")
    rule_only = path.replace(".jsonl", ".rule_only.jsonl")
    os.replace(path, rule_only)
    with OpenAIChatClient(r.judge_url, r.judge_model, api_key_env=r.judge_api_key_env) as client, \
            RuleVerifier(num_workers=2) as verifier:
        stats = annotate(rule_only, path, client, verifier,
                         judgements_path=path.replace(".jsonl", ".judgements.jsonl"))
    logger.info("[rm_data] hybrid labels: rule and judge agree on %s of %d rows; kept %d",
                stats["agreement_rate"], stats["rows"], stats["kept"])
    return stats


def rm_start(cfg: DemoConfig, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult], out: str) -> str:
    """The RM's starting checkpoint (``rm.init``): the SFT policy made a reward model by the converter
    (its backbone, a new scalar head), written under ``out``; or the assets' random RM."""
    if cfg.rm.init == "random":
        return assets.file("rm_mcore")
    ckpt = os.path.join(out, "init")
    hf_to_mcore(sft_stage.file("policy_hf"), ckpt, "reward", head_std=cfg.rm.head_std)
    return ckpt


def train_verify_rm(cfg: DemoConfig, seed: int, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult],
                    before: Stage[BeforeResult], data: Stage[RMDataResult], out: str) -> RMResult:
    """Stage 5: BCE training of the tiny VerifyRM (from ``rm.init``'s weights) on the labeled
    completions; its accuracy on the held-out benchmark and on the SFT policy's own completions."""
    r = cfg.rm
    val = data.info.val > 0  # a tiny run (the smoke preset) may have no validation row: no gate to judge
    job = VerifyRMConfig(ckpt=rm_start(cfg, assets, sft_stage, out), out=os.path.join(out, "train"),
                         data=RMDataConfig(train_path=data.file("rm_train.jsonl"),
                                           eval_path=data.file("rm_val.jsonl") if val else "", eval_format="labeled"),
                         optim=OptimSection(lr=r.lr),
                         train=RMTrainConfig(epochs=r.epochs, micro_batch_size=min(r.micro_batch, r.batch),
                                             global_batch_size=r.batch, seed=r.seed + seed, eval_at_start=False,
                                             gate=r.gate if val else 0.0, keep_best=val))
    summary = train_rm(job)
    judged = summary["gate"] or {"accuracy": {}, "epoch": summary["epochs"], "met": False}
    gate = RMGate(accuracy=judged["accuracy"], threshold=r.gate, epochs=summary["epochs"], best_epoch=judged["epoch"],
                  met=judged["met"])
    if not val:
        logger.warning("[rm] no validation rows: the RM's gate could not be judged (it counts as missed)")
    elif not gate.met:
        logger.warning("[rm] the RM missed its gate: validation accuracy %s after %d epochs, below %.2f; the RL "
                       "runs use its best epoch (%d)", ", ".join(f"{k} {v:.3f}" for k, v in gate.accuracy.items()),
                       gate.epochs, r.gate, gate.best_epoch)
    bench = rm_bench(summary["final_checkpoint"], data.file("rm_bench.jsonl"),
                     os.path.join(out, "bench_predictions.jsonl"))
    own = rm_on_samples(summary["final_checkpoint"], before.file("eval_samples.jsonl"),
                        os.path.join(out, "own_predictions.jsonl"))
    logger.info("[rm] held-out benchmark: accuracy %.3f (%s), pair accuracy %.3f; on the SFT policy's own "
                "completions (blind spot aside): accuracy %.3f, separation %.3f", bench.acc,
                ", ".join(f"{k} {v:.3f}" for k, v in bench.families.items()), bench.pair_acc,
                own.families["all"].acc, own.families["all"].separation)
    return RMResult(checkpoint=os.path.relpath(summary["final_checkpoint"], out), bench=bench, own=own,
                    train_acc=summary.get("train_acc"), steps=summary["steps"], gate=gate,
                    own_answers=own_answers(before.file("eval_samples.jsonl"),
                                            os.path.join(out, "own_predictions.jsonl")))


def rm_data_params(cfg: DemoConfig, seed: int) -> dict[str, Any]:
    """The settings the ``rm_data`` stage reads (its cache key): the RM section but its training
    fields, and the rollout sampling of its benchmark."""
    sampling = {k: v for k, v in dataclasses.asdict(cfg.rm).items() if k not in RM_TRAINING_FIELDS}
    return {"rm": sampling, "rl_sampling": [cfg.rl.temperature, cfg.rl.max_new_tokens], "seed": seed}


def mode_params(cfg: DemoConfig, mode: str, seed: int) -> dict[str, Any]:
    """The settings one RL stage reads (its cache key): rule runs ignore the RM's reward transform,
    only Cooper reads the Cooper section."""
    rl = dataclasses.asdict(cfg.rl)
    if not RewardMode(mode).uses_rm:
        rl.pop("rm_transform")
    ev = dataclasses.asdict(cfg.eval)
    ev.pop("hack_examples")  # read at report time
    params: dict[str, Any] = {"rl": rl, "eval": ev, "seed": seed}
    if RewardMode(mode).trains_rm:
        params["cooper"] = dataclasses.asdict(cfg.cooper)
    return params


#: what every demo RL run sets over ``cooper train``'s defaults, whatever the demo's settings: the
#: held-out measurement of the demo (every held-out problem, judged by the task's oracle, the
#: completions kept per family) and no wandb
RL_BASE: dict[str, Any] = {"data.eval_limit": 0, "reward.verifier_workers": 2, "eval.verifier": "arithmetic_oracle",
                           "eval.save_samples": True, "checkpoint.keep": 1, "logging.wandb": False}
#: ``cooper train`` setting <- the demo setting it takes
RL_FROM_DEMO: dict[str, str] = {
    "rollout.group_size": "rl.group_size", "rollout.temperature": "rl.temperature",
    "rollout.max_new_tokens": "rl.max_new_tokens", "reward.rm_transform": "rl.rm_transform",
    "algo.kl_coef": "rl.kl_coef", "algo.kl_kind": "rl.kl_kind", "algo.adv_std_floor": "rl.adv_std_floor",
    "optim.lr": "rl.lr", "train.steps": "rl.steps", "train.prompts_per_step": "rl.prompts_per_step",
    "train.micro_batch_size": "rl.micro_batch", "eval.every": "rl.eval_every", "checkpoint.every": "rl.steps",
    "rm.negatives": "cooper.negatives", "rm.rewrite_forms": "cooper.rewrite_forms", "rm.optim.lr": "cooper.rm_lr",
    "rm.negative_pick": "cooper.negative_pick",
    "rm.positive_pick": "cooper.positive_pick", "rm.pairs_per_prompt": "cooper.pairs_per_prompt",
    "rm.anchor_weight": "cooper.anchor_weight", "eval.k": "eval.k", "eval.max_new_tokens": "eval.max_new_tokens",
    "eval.temperature": "eval.temperature", "eval.top_p": "eval.top_p",
}


def rl_settings(cfg: DemoConfig, mode: str, seed: int, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult],
                rm_stage: Stage[RMResult], out: str) -> dict[str, Any]:
    """The dotted ``cooper train`` settings of one RL run: :data:`RL_BASE`, the demo's settings
    (:data:`RL_FROM_DEMO`), the stages' files, and what differs per run (``reward.mode``, the seed, the name)."""
    return {**RL_BASE, **{key: functools.reduce(getattr, demo_key.split("."), cfg)
                          for key, demo_key in RL_FROM_DEMO.items()},
            "out": out, "model.policy_ckpt": sft_stage.file("policy_mcore"),
            "model.policy_hf": sft_stage.file("policy_hf"),
            "model.rm_ckpt": rm_stage.file(rm_stage.info.checkpoint), "data.train_path": assets.file("train.jsonl"),
            "data.eval_path": assets.file("eval.jsonl"), "reward.mode": mode, "train.seed": cfg.rl.seed + seed,
            "logging.run_name": f"demo-{mode}-seed{seed}"}


def rl_config(cfg: DemoConfig, mode: str, seed: int, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult],
              rm_stage: Stage[RMResult], out: str) -> CooperConfig:
    """The ``cooper train`` config of one RL run (only ``reward.mode`` differs between the three),
    loaded as ``cooper train`` loads one: its defaults and :func:`rl_settings` as dotted overrides.

    Its evaluation is the demo's held-out measurement: every held-out problem, ``eval.k`` samples
    at the eval sampling, seeded by ``train.seed`` (as :func:`policy_accuracy` with that seed), judged
    by the task's oracle (``eval/acc``; the rule's ``eval/rule_acc`` beside it), its completions kept.
    """
    return load_config(None, dotted(rl_settings(cfg, mode, seed, assets, sft_stage, rm_stage, out)))


def run_rl(cfg: DemoConfig, mode: str, seed: int, assets: Stage[AssetsResult], sft_stage: Stage[SFTResult],
           data: Stage[RMDataResult], rm_stage: Stage[RMResult], out: str) -> RLResult:
    """Stage 6: one RL run in a subprocess, then the held-out numbers of its final policy and RM, and
    the per-family curves of its in-training evaluations."""
    run_dir = os.path.join(out, "run")
    config_path = os.path.join(out, "config.yaml")
    save_config(rl_config(cfg, mode, seed, assets, sft_stage, rm_stage, run_dir), config_path)
    cmd = [sys.executable, "-m", "cooper_mcore", "train", "--config", config_path]
    logger.info("[rl_%s] %s", mode, " ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "WANDB_MODE": "offline"})
    if proc.returncode:
        raise RuntimeError(f"the {mode} RL run failed (exit {proc.returncode}); its files are in {run_dir}")
    seconds = time.perf_counter() - start
    final = os.path.join(run_dir, "checkpoints", f"step_{cfg.rl.steps}")
    mcore_to_hf(os.path.join(final, "policy"), os.path.join(out, "policy_hf"))
    acc = policy_accuracy(os.path.join(out, "policy_hf"), assets.file("eval.jsonl"), cfg, cfg.rl.seed + seed,
                          os.path.join(out, "eval"))
    info = RLResult(eval=acc, rl_seconds=round(seconds, 1), curve=training_curve(run_dir, _task(cfg)))
    reward = RewardMode(mode)
    if reward.uses_rm:  # the final RM on the final policy's completions (rm_predictions.jsonl: the hacks)
        rm_ckpt = os.path.join(final, "rm") if reward.trains_rm else rm_stage.file(rm_stage.info.checkpoint)
        info.rm_acc_own = rm_accuracy(rm_ckpt, os.path.join(out, "eval_samples.jsonl"),
                                      os.path.join(out, "rm_predictions.jsonl"))
        info.own_answers = own_answers(os.path.join(out, "eval_samples.jsonl"),
                                       os.path.join(out, "rm_predictions.jsonl"))
        info.bench = (rm_stage.info.bench if not reward.trains_rm else  # frozen: the same predictions
                      rm_bench(rm_ckpt, data.file("rm_bench.jsonl"), os.path.join(out, "bench_predictions.jsonl")))
    logger.info("[rl_%s] held-out accuracy %.3f by the oracle (%.3f by the rule), %.3f greedy%s", mode, acc.acc,
                acc.rule_acc, acc.acc_greedy,
                f"; RM accuracy {info.bench.acc:.3f} on the benchmark, {info.rm_acc_own:.3f} on its "
                "policy's completions" if info.bench is not None else "")
    return info


def training_curve(run_dir: str, task: DemoTask) -> list[CurvePoint]:
    """Per in-training evaluation (``eval.save_samples``' files, in step order; every data-parallel
    replica's file of a step together): the step and :func:`by_family` of its completions (oracle
    and rule accuracy, answer forms). Empty when the run evaluated nothing."""
    folder = os.path.join(run_dir, EVAL_SAMPLES_DIR)
    files: dict[int, list[str]] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("step_") and name.endswith(".jsonl"):
            files.setdefault(int(name[len("step_"):].split(".")[0]), []).append(os.path.join(folder, name))
    curve = []
    for step in sorted(files):
        rows = [{**x, "label": bool(x["correct"]), "rule": bool(x["rule_correct"]), "family": family_of(x["question"]),
                 "rule_unreadable": task.rule_unreadable(x["question"])}
                for path in files[step] for x in read_jsonl(path)]
        curve.append(CurvePoint(step=step, families=by_family(rows)))
    return curve


# --------------------------------------------------------------------------- the demo


def run_seed(cfg: DemoConfig, seed: int, root: str,
             assets: Stage[AssetsResult]) -> tuple[dict[str, RunResult], SeedDesign]:
    """Every stage of one seed after the shared assets; the three runs' results and the seed's design
    figures (the rule's recall and precision on the SFT policy, the RM before RL)."""
    sft_stage = run_stage(root, "sft", {"sft": cfg.sft, "seed": seed}, [assets],
                          lambda d: train_sft(cfg, seed, assets, d), SFTResult)
    rule_eval = mode_params(cfg, RewardMode.rule.value, seed)["eval"]
    before = run_stage(root, "before", {"eval": rule_eval, "rl_seed": cfg.rl.seed + seed}, [assets, sft_stage],
                       lambda d: measure_before(cfg, seed, assets, sft_stage, d), BeforeResult)
    data = run_stage(root, "rm_data", rm_data_params(cfg, seed), [assets, sft_stage],
                     lambda d: sample_rm_data(cfg, seed, assets, sft_stage, d), RMDataResult)
    rm_stage = run_stage(root, "rm", {"rm": cfg.rm, "seed": seed}, [assets, sft_stage, before, data],
                         lambda d: train_verify_rm(cfg, seed, assets, sft_stage, before, data, d), RMResult)
    runs = {}
    for mode in MODES:
        reads = [assets, sft_stage, data, rm_stage] if RewardMode(mode).uses_rm else [assets, sft_stage]  # rule: no RM
        stage = run_stage(root, f"rl_{mode}", mode_params(cfg, mode, seed), reads,
                          lambda d, mode=mode: run_rl(cfg, mode, seed, assets, sft_stage, data, rm_stage, d), RLResult)
        runs[mode] = run_result(cfg, mode, before, rm_stage, stage)
    design = SeedDesign(sft=before.info.eval.families, rm_bench=rm_stage.info.bench, rm_own=rm_stage.info.own,
                        rm_data=data.info)
    return runs, design


def family_changes(b: PolicyAccuracy, a: PolicyAccuracy, rm_b: BenchAccuracy | None,
                   rm_a: BenchAccuracy | None) -> dict[str, dict[str, float | None]]:
    """Per family of the "before" measurement, its numbers before and after one RL run (the
    report's :attr:`RunResult.families`)."""
    fb, fa = b.families, a.families
    return {fam: {"acc_before": fb[fam].acc, "acc_after": fa[fam].acc,
                  "rule_acc_before": fb[fam].rule_acc, "rule_acc_after": fa[fam].rule_acc,
                  "times_form_before": fb[fam].forms["boxed_period"],
                  "times_form_after": fa[fam].forms["boxed_period"],
                  "rm_acc_before": rm_b.families.get(fam) if rm_b else None,
                  "rm_acc_after": rm_a.families.get(fam) if rm_a else None}
            for fam in GROUPS if fam in fb}


def run_result(cfg: DemoConfig, mode: str, before: Stage[BeforeResult], rm_stage: Stage[RMResult],
               stage: Stage[RLResult]) -> RunResult:
    """One RL stage's numbers as the report's :class:`RunResult`."""
    b, a = before.info.eval, stage.info.eval
    rm_modes = RewardMode(mode).uses_rm
    rm_b = rm_stage.info.bench if rm_modes else None
    rm_a = stage.info.bench if rm_modes else None
    own = (OwnAnswers(rm_stage.info.own_answers, stage.info.own_answers)
           if rm_modes and rm_stage.info.own_answers is not None and stage.info.own_answers is not None else None)
    return RunResult(
        metrics_path=stage.file("run"), acc_before=b.acc, acc_after=a.acc,
        rule_acc_before=b.rule_acc, rule_acc_after=a.rule_acc, families=family_changes(b, a, rm_b, rm_a),
        curve=to_plain(stage.info.curve), problem_acc=a.problem_acc, problem_acc_before=b.problem_acc,
        problem_groups=a.problem_groups, rm_bench_right_before=rm_b.right if rm_b else [],
        rm_bench_right_after=rm_a.right if rm_a else [], rm_own_answers=own,
        rm_gate=rm_stage.info.gate if rm_modes else None,
        rm_acc_before=_measured(rm_b.acc) if rm_b else None, rm_acc_after=_measured(rm_a.acc) if rm_a else None,
        hacks=hack_examples(stage.file("eval_samples.jsonl"), stage.file("rm_predictions.jsonl"),
                            cfg.eval.hack_examples) if rm_modes else [],
        seconds=stage.info.rl_seconds,
        details={"acc_greedy_before": b.acc_greedy, "acc_greedy_after": a.acc_greedy,
                 **({"rm_pair_acc_before": rm_b.pair_acc, "rm_pair_acc_after": rm_a.pair_acc,
                     "rm_acc_own_completions": stage.info.rm_acc_own} if rm_b and rm_a else {}),
                 **{f"kind_{k}_before": v for k, v in b.kinds.items()},
                 **{f"kind_{k}_after": v for k, v in a.kinds.items()}})


def run_task(cfg: DemoConfig, report_dir: str, control: str | None = None) -> str:
    """Every seed of one task (the assets, then :func:`run_seed` per seed) and its report."""
    root = os.path.join(cfg.out, "stages")
    assets = run_stage(root, "assets", {"task": cfg.task, "model": cfg.model, "isolate": isolated(cfg)}, [],
                       lambda d: build_assets(cfg, d), AssetsResult)
    results, designs = {}, {}
    for seed in cfg.seeds:
        results[seed], designs[seed] = run_seed(cfg, seed, root, assets)
    return write_report(report_dir, results, config=dataclasses.asdict(cfg),
                        design={seed: to_plain(d) for seed, d in designs.items()}, control=control)


def run_demo(cfg: DemoConfig) -> str:
    """Run (or resume from cached stages) the whole demo; return the report folder.

    With ``control``, the same seeds also run on the single-family task (``task.times_share`` 0)
    first, and the report sets its numbers beside the two-family task's. Prints ``report: <folder>``
    as the last line of output.
    """
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct integers, got {cfg.seeds}")
    started = time.perf_counter()
    control = None
    if cfg.control:
        single = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, times_share=0.0, unreadable_share=0.0),
                                     control=False)
        control = run_task(single, os.path.join(cfg.out, "report", "control"))
    report = run_task(cfg, os.path.join(cfg.out, "report"), control=control)
    logger.info("demo finished in %.0f s (stages cached under %s)", time.perf_counter() - started,
                os.path.join(cfg.out, "stages"))
    print(f"report: {report}", flush=True)  # the job's last line: where the report is
    return report


def describe(cfg: DemoConfig) -> str:
    """One line naming the demo's size, for the start of the log."""
    r = cfg.rl
    control = " and the single-family control" if cfg.control else ""
    t = cfg.task
    return (f"demo: 2-step arithmetic (operands 0-{t.max_operand}, {t.times_share:.0%} with a '*' step whose answers "
            f"the rule misses, {t.unreadable_share:.0%} with a reference it cannot read){control}, {t.n_eval} "
            f"held-out problems; SFT {cfg.sft.steps} steps; RL {r.steps} steps x {r.prompts_per_step} prompts x "
            f"{r.group_size} samples per mode; seeds {cfg.seeds}")
