"""Reward-model (VerifyRM) jobs: supervised training on labeled triples and accuracy evaluation.

These are the bodies of ``cooper train-rm`` and ``cooper eval-rm``. Both run in one process or
under ``torchrun`` (any TP/PP layout; data parallelism is what is left of the world size).

Labeled training data (JSONL or Parquet, one row per judged completion; field names configurable):

=========== ======================= ==========================================================
field       type                    meaning
=========== ======================= ==========================================================
question    non-empty string        the problem statement
reference   string or number        the reference answer
completion  non-empty string        the completion to judge
label       bool, or 0/1            whether the completion is correct
id          string or integer       optional; defaults to ``<basename>:<line>``
answer_type string                  optional; evaluation reports accuracy per type
=========== ======================= ==========================================================

Malformed rows raise ``ValueError`` naming the file and line (or row), or are skipped and counted
with ``skip_malformed``. Evaluation data is either this format or VerifyBench's
(:mod:`cooper_mcore.data.verifybench`: ``answer``/``gold_correct``), told apart by the first row.

Each row becomes :func:`~cooper_mcore.data.templates.rm_input` (with the paper's completion
truncation) tokenised by the reward model's tokenizer (the checkpoint's ``hf_extra/``).
A completion is judged correct when ``sigmoid(score) >= threshold`` (0.5).

Training (:func:`train_rm`) minimises the mean binary cross-entropy with AdamW at a constant
learning rate (paper: lr 2e-5, weight decay 0.01, 3 epochs). Each epoch visits the rows in a
seeded random order, in global batches of ``global_batch_size`` rows (the last one may be short;
it counts only its real rows). With ``train.gate`` it stops after the first epoch whose evaluation
reaches the gate in every answer type; with ``train.keep_best`` the final model is the epoch whose
evaluation was best (:func:`gate_score`), not the last. The job
(:class:`~cooper_mcore.config.schema.VerifyRMConfig`) runs in the job skeleton
(:func:`cooper_mcore.job.job`); its ``out`` receives ``metrics.jsonl`` (one line per
training step, the ``rm_train/*`` keys, and one per evaluation, the ``rm_eval/*`` keys, of
:mod:`cooper_mcore.metric_names`), ``config.yaml`` (its settings), model checkpoints
(``checkpoints/step_NNNNNN`` every ``train.save_every`` steps and ``final``; each written under a
temporary name and renamed when complete, with the tokenizer in ``hf_extra/``) and
``summary.json``. Optimizer states are not saved: a checkpoint is a model, not a resumable run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.atomic import atomic_open, check_output_path
from cooper_mcore.checkpoint.model import load_checkpoint_model, read_meta, save_new_model_checkpoint
from cooper_mcore.checkpoint.tokenizer import load_checkpoint_tokenizer
from cooper_mcore.collectives import all_gather
from cooper_mcore.config.checks import validate
from cooper_mcore.config.schema import VerifyRMConfig, to_dict
from cooper_mcore.data.rm_data import RMExample, read_eval_examples, read_rm_examples
from cooper_mcore.data.tokenizer import check_tokenizer_fits, pad_id_of
from cooper_mcore.job import JobRoom, job
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.metrics import write_json_atomic
from cooper_mcore.parallel import ParallelConfig, job_world, launched_world_size
from cooper_mcore.run_lock import LOCK_FILE
from cooper_mcore.train.reward_model import (
    bce_train_step,
    pad_token_lists,
    rm_scores,
    tokenize_texts,
    wrap_reward_model,
)
from cooper_mcore.train.step import OptimConfig

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
FINAL_DIR = "final"


# --------------------------------------------------------------------------- evaluation


def _acc(correct: int, n: int) -> dict[str, Any]:
    return {"n": n, "accuracy": correct / n if n else None}


def accuracy_report(examples: Sequence[RMExample], scores: torch.Tensor, threshold: float = 0.5) -> dict[str, Any]:
    """Accuracy of the verdicts ``sigmoid(score) >= threshold`` against the labels.

    Args:
        examples: the labeled triples.
        scores: ``[n]`` reward-model logits, aligned with ``examples``.
        threshold: probability threshold for "correct".

    Returns:
        ``{"n", "accuracy", "threshold", "mean_prob", "per_label": {"correct"|"incorrect": {"n",
        "accuracy"}}, "per_answer_type": {type: {"n", "accuracy"}}}``; ``per_answer_type`` is empty
        when no example has a type (examples without one count as ``"unknown"`` otherwise).
        Accuracies of empty groups are None.
    """
    if len(examples) != scores.numel():
        raise ValueError(f"accuracy_report: {len(examples)} examples but {scores.numel()} scores")
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    probs = torch.sigmoid(scores.detach().double().flatten().cpu())
    hits = [bool(p >= threshold) == ex.label for p, ex in zip(probs.tolist(), examples)]
    labels = {"correct": [h for h, ex in zip(hits, examples) if ex.label],
              "incorrect": [h for h, ex in zip(hits, examples) if not ex.label]}
    types: dict[str, list[bool]] = {}
    if any(ex.answer_type is not None for ex in examples):
        for h, ex in zip(hits, examples):
            types.setdefault(ex.answer_type or "unknown", []).append(h)
    return {
        **_acc(sum(hits), len(hits)),
        "threshold": threshold,
        "mean_prob": float(probs.mean()) if len(hits) else None,
        "per_label": {k: _acc(sum(v), len(v)) for k, v in labels.items()},
        "per_answer_type": {k: _acc(sum(types[k]), len(types[k])) for k in sorted(types)},
    }


@dataclass(frozen=True)
class GateScore:
    """How an evaluation (:func:`accuracy_report`) stands against a gate.

    Attributes:
        score: its lowest accuracy over the answer types (the overall accuracy without types): the
            epoch that maximises it is the best.
        accuracy: the accuracy of each answer type (``{"all": accuracy}`` without types).
    """

    score: float
    accuracy: dict[str, float]


def gate_score(report: dict[str, Any]) -> GateScore:
    """The gate's view of an evaluation: every answer type must reach the gate, so the worst decides.

    Types without rows are left out; an evaluation without rows scores NaN (never best, never met).
    """
    types = {k: v["accuracy"] for k, v in report.get("per_answer_type", {}).items() if v["accuracy"] is not None}
    if not types:
        types = {"all": report["accuracy"] if report.get("accuracy") is not None else float("nan")}
    return GateScore(min(types.values()), types)


def score_texts(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    micro_batch_size: int = 8,
    max_length: Optional[int] = None,
    rows_per_forward: Optional[int] = None,
) -> torch.Tensor:
    """Reward-model logits of many input texts, split across data-parallel ranks.

    Collective over the whole world: every rank passes the same ``texts``. Rows are sorted by
    length and scored in chunks of ``rows_per_forward`` (default ``8 * micro_batch_size``), each
    padded to its own longest row; each data-parallel rank scores a share and the scores are
    all-gathered.

    Returns:
        ``[len(texts)]`` float32 logits on the CPU, on every rank.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    n = len(texts)
    dp_group = parallel_state.get_data_parallel_group()
    dp, rank = dp_group.size(), dp_group.rank()
    share = -(-n // dp)
    mine = [i % n for i in range(rank * share, (rank + 1) * share)] if n else []
    local = torch.zeros(share, dtype=torch.float32)
    if mine:
        tokens = tokenize_texts(tokenizer, [texts[i] for i in mine], max_length)
        order = sorted(range(len(tokens)), key=lambda j: len(tokens[j]))
        chunk = rows_per_forward or 8 * micro_batch_size
        pad = pad_id_of(tokenizer)
        for start in range(0, len(order), chunk):
            rows = order[start:start + chunk]
            ids, lengths = pad_token_lists([tokens[j] for j in rows], pad)
            local[rows] = rm_scores(model, ids, lengths, micro_batch_size)
    return all_gather(local, dp_group).cpu()[:n]


# --------------------------------------------------------------------------- checkpoints


def _load_rm(ckpt: str, parallel: ParallelConfig, tokenizer: Any):
    """Load a reward-model checkpoint after checking its type and that ``tokenizer`` fits its vocabulary."""
    arch, hf_config, dtype = read_meta(ckpt)
    if arch.model_type != "reward":
        raise ValueError(f"checkpoint {ckpt!r} is a {arch.model_type} model, not a reward model "
                         "(convert with --model-type reward)")
    check_tokenizer_fits(tokenizer, arch.vocab_size, ckpt)
    model, arch = load_checkpoint_model(ckpt, parallel)
    return model, arch, hf_config, dtype


# --------------------------------------------------------------------------- jobs


def eval_rm(
    ckpt: str,
    data_path: str,
    parallel: Optional[ParallelConfig] = None,
    micro_batch_size: int = 8,
    threshold: float = 0.5,
    data_format: str = "auto",
    max_length: Optional[int] = None,
    predictions_path: Optional[str] = None,
    skip_malformed: bool = False,
    seed: int = 1234,
) -> dict[str, Any]:
    """Accuracy of a reward-model checkpoint on labeled or VerifyBench-format data.

    Args:
        ckpt: a cooper_mcore reward-model checkpoint (with its tokenizer in ``hf_extra/``).
        data_path: the evaluation file (see :func:`read_eval_examples`).
        parallel: TP/PP layout (default TP=PP=1).
        micro_batch_size: rows per forward micro-batch.
        threshold: probability threshold for "correct".
        data_format: ``"auto"``, ``"labeled"`` or ``"verifybench"``.
        max_length: token limit per row (default: the model's ``max_position_embeddings``).
        predictions_path: if set, rank 0 writes one JSON line per row
            (``id, label, score, prob, pred, answer_type``).
        skip_malformed: skip and count malformed rows.
        seed: megatron's RNG seed.

    Returns:
        :func:`accuracy_report` plus ``ckpt``, ``data``, ``skipped``.
    """
    parallel = parallel or ParallelConfig()
    if predictions_path:
        check_output_path(predictions_path)  # a device or FIFO there is refused before any work
    examples, skipped = read_eval_examples(data_path, data_format, skip_malformed)
    with job_world(parallel, seed):
        tokenizer = load_checkpoint_tokenizer(ckpt)
        model, arch, _, _ = _load_rm(ckpt, parallel, tokenizer)
        scores = score_texts(model, tokenizer, [ex.rm_text() for ex in examples], micro_batch_size,
                             max_length or arch.max_position_embeddings)
        rank0 = dist.get_rank() == 0
    report = {"ckpt": ckpt, "data": data_path, "skipped": skipped, **accuracy_report(examples, scores, threshold)}
    if predictions_path and rank0:
        _write_predictions(predictions_path, examples, scores, threshold)
    logger.info("eval-rm %s on %s: accuracy %.4f over %d rows", ckpt, data_path, report["accuracy"], report["n"])
    return report


def _write_predictions(path: str, examples: Sequence[RMExample], scores: torch.Tensor, threshold: float) -> None:
    with atomic_open(path) as f:
        for ex, s in zip(examples, scores.tolist()):
            p = 1.0 / (1.0 + math.exp(-s)) if s >= 0 else math.exp(s) / (1.0 + math.exp(s))
            f.write(json.dumps({"id": ex.id, "label": ex.label, "score": s, "prob": p, "pred": p >= threshold,
                                "answer_type": ex.answer_type}) + "\n")


def train_rm(cfg: VerifyRMConfig) -> dict[str, Any]:
    """Train a reward model with binary cross-entropy on labeled triples (module docstring).

    Runs in the job skeleton (:func:`cooper_mcore.job.job`): the world, ``metrics.jsonl`` (the
    ``rm_train/*`` and ``rm_eval/*`` keys of :mod:`cooper_mcore.metric_names`), the progress bar and
    the stop signal (SIGTERM, SIGUSR1, Ctrl-C: the job ends after the current step with
    :class:`~cooper_mcore.job.TrainingStopped`).

    Args:
        cfg: the job (:class:`~cooper_mcore.config.schema.VerifyRMConfig`): ``ckpt`` the initial reward-model
            checkpoint, ``out`` the output folder (must not exist or be empty), ``data`` the training
            and evaluation data (evaluated before training with ``train.eval_at_start``, every
            ``train.eval_every`` steps and after each epoch), ``optim`` AdamW at a constant learning
            rate, ``train`` the epochs, batch sizes, checkpoints every ``save_every`` steps and seed.

    Returns:
        ``{"steps", "epochs" (run), "num_train", "skipped", "final_checkpoint", "checkpoints",
        "train_loss" (mean over the last epoch), "train_acc", "eval" (last evaluation or None),
        "metrics_path", "gate"}``; ``gate`` (None without an evaluation): ``threshold``, ``met``,
        ``epoch`` (of the final model) and ``accuracy`` (its per-type evaluation accuracy,
        :func:`gate_score`). Also written to ``out/summary.json``.

    Raises:
        ValueError: invalid settings (named), a non-reward checkpoint, malformed data.
        FileExistsError: ``out`` exists and is not empty.
    """
    check_train_rm(cfg)
    d, t = cfg.data, cfg.train
    train, skipped = read_rm_examples(d.train_path, d.question_key, d.reference_key, d.completion_key, d.label_key,
                                      skip_malformed=d.skip_malformed)
    evals = read_eval_examples(d.eval_path, d.eval_format, d.skip_malformed)[0] if d.eval_path else None
    steps_per_epoch = -(-len(train) // t.global_batch_size)
    with job(cfg.out, t.epochs * steps_per_epoch, parallel=cfg.parallel, seed=t.seed, config=to_dict(cfg),
             check=lambda: _check_out_empty(cfg.out)) as room:  # checked again holding the folder's lock
        run = _setup_rm_run(cfg, room, train, evals)
        logger.info("train-rm: %d rows (%d skipped), %d epochs x %d steps, global batch %d, dp %d",
                    len(train), skipped, t.epochs, steps_per_epoch, t.global_batch_size, run.dp)
        if t.eval_at_start:
            _evaluate(run, 0.0)
        epoch_stats: list[dict[str, Any]] = []
        best, epochs_run = _Best(), 0
        for epoch in range(t.epochs):
            epochs_run = epoch + 1
            epoch_stats = _train_epoch(run, epoch, steps_per_epoch)
            logger.info("train-rm epoch %d/%d (step %d): loss %.4f, acc %.4f", epoch + 1, t.epochs, run.step,
                        _row_mean(epoch_stats, "loss"), _row_mean(epoch_stats, "acc"))
            _evaluate(run, float(epoch + 1))
            if _gate_reached(run, best, epoch + 1):
                break
        final = os.path.join(cfg.out, FINAL_DIR)
        if t.keep_best and best.state is not None:
            run.model.load_state_dict(best.state)
        save_new_model_checkpoint(run.model, final, run.arch, run.hf_config, run.dtype, extra_from=cfg.ckpt)
        summary = {
            "steps": run.step, "epochs": epochs_run, "num_train": len(train), "skipped": skipped,
            "final_checkpoint": final, "checkpoints": run.checkpoints,
            "train_loss": _row_mean(epoch_stats, "loss"), "train_acc": _row_mean(epoch_stats, "acc"),
            "eval": run.last_eval, "metrics_path": room.metrics.path, "gate": best.summary(t.gate) if evals else None,
        }
        if room.main:
            write_json_atomic(os.path.join(cfg.out, SUMMARY_FILE), summary)
    return summary


@dataclass
class _Best:
    """The best epoch so far by :func:`gate_score` (its weights kept on the CPU with ``train.keep_best``)
    and the last epoch's score."""

    epoch: int = 0
    score: Optional[GateScore] = None
    state: Optional[dict[str, Any]] = None
    last: Optional[GateScore] = None
    last_epoch: int = 0

    def summary(self, threshold: float) -> dict[str, Any]:
        """The summary's ``gate``: the kept epoch's per-type accuracy (the best one, or the last when
        weights were not kept), the threshold and whether it was met."""
        epoch, kept = (self.epoch, self.score) if self.state is not None else (self.last_epoch, self.last)
        accuracy = kept.accuracy if kept is not None else {}
        met = kept is not None and bool(threshold) and kept.score >= threshold
        return {"threshold": threshold, "met": met, "epoch": epoch, "accuracy": accuracy}


def _gate_reached(run: _RMRun, best: _Best, epoch: int) -> bool:
    """Note this epoch's evaluation in ``best`` (keeping its weights when it is the best so far and
    ``train.keep_best``); True when it reaches ``train.gate`` (training stops)."""
    t = run.cfg.train
    if run.last_eval is None:
        return False
    score = gate_score(run.last_eval)
    best.last, best.last_epoch = score, epoch
    if best.score is None or score.score > best.score.score:
        best.epoch, best.score = epoch, score
        if t.keep_best:
            best.state = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                          for k, v in run.model.state_dict().items()}
    reached = bool(t.gate) and score.score >= t.gate
    if t.gate:
        logger.info("train-rm epoch %d: gate %.3f %s (%s)", epoch, t.gate, "reached" if reached else "not reached",
                    ", ".join(f"{k} {v:.3f}" for k, v in score.accuracy.items()))
    return reached


def check_train_rm(cfg: VerifyRMConfig) -> None:
    """Check the job's config (:func:`cooper_mcore.config.checks.validate`, as ``cooper train``'s) and
    output folder before any work.

    Raises:
        ValueError: every problem of the config, one per line.
        FileExistsError: ``cfg.out`` exists and is not empty.
    """
    validate(cfg, launched_world_size())
    _check_out_empty(cfg.out)


def _check_out_empty(out: str) -> None:
    """Raise FileExistsError when the folder ``out`` holds anything but a run's lock file."""
    if os.path.isdir(out) and set(os.listdir(out)) - {LOCK_FILE}:
        raise FileExistsError(f"out_dir {out!r} exists and is not empty")


@dataclass
class _RMRun:
    """A VerifyRM training job's state inside its world."""

    cfg: VerifyRMConfig
    room: JobRoom
    tokenizer: Any
    model: Any
    ddp: Any
    optimizer: Any
    arch: Any
    hf_config: dict[str, Any]
    dtype: Any
    tokens: list[list[int]]
    labels: torch.Tensor
    evals: Optional[list[RMExample]]
    max_len: int
    dp: int
    dp_rank: int
    step: int = 0
    checkpoints: list[str] = field(default_factory=list)
    last_eval: Optional[dict[str, Any]] = None


def _setup_rm_run(cfg: VerifyRMConfig, room: JobRoom, train: Sequence[RMExample],
                  evals: Optional[list[RMExample]]) -> _RMRun:
    """Load the model, tokenize the training rows and wrap the model for training (collective)."""
    t, o = cfg.train, cfg.optim
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    assert t.global_batch_size % (t.micro_batch_size * dp) == 0, "validate() checks the batch against dp"
    torch.manual_seed(t.seed)
    tokenizer = load_checkpoint_tokenizer(cfg.ckpt)
    model, arch, hf_config, dtype = _load_rm(cfg.ckpt, cfg.parallel, tokenizer)
    max_len = cfg.data.max_length or arch.max_position_embeddings
    tokens = tokenize_texts(tokenizer, [ex.rm_text() for ex in train], max_len)
    labels = torch.tensor([float(ex.label) for ex in train])
    ddp, optimizer = wrap_reward_model(model, OptimConfig(lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad))
    if room.main:
        os.makedirs(room.ckpt_dir, exist_ok=True)
    return _RMRun(cfg, room, tokenizer, model, ddp, optimizer, arch, hf_config, dtype, tokens, labels, evals,
                  max_len, dp, dp_rank)


def _train_epoch(run: _RMRun, epoch: int, steps_per_epoch: int) -> list[dict[str, Any]]:
    """One seeded pass over the training rows; return each step's metrics (as ``bce_train_step``'s)."""
    t, gbs = run.cfg.train, run.cfg.train.global_batch_size
    local = gbs // run.dp
    order = torch.randperm(len(run.labels), generator=torch.Generator().manual_seed(t.seed + epoch))
    stats = []
    for k in range(steps_per_epoch):
        rows = order[k * gbs:(k + 1) * gbs][run.dp_rank * local:(run.dp_rank + 1) * local]
        mask = torch.ones(len(rows), dtype=torch.bool)
        if len(rows) == 0:  # the short last batch left nothing for this rank
            rows, mask = order[:1], torch.zeros(1, dtype=torch.bool)
        ids, lengths = pad_token_lists([run.tokens[i] for i in rows.tolist()], pad_id_of(run.tokenizer))
        t0 = time.perf_counter()
        m = bce_train_step(run.ddp, run.optimizer, (ids, lengths, run.labels[rows]), t.micro_batch_size, mask=mask)
        run.step += 1
        stats.append(m)
        at = epoch + (k + 1) / steps_per_epoch
        run.room.log(run.step, _train_line(m, at, run.cfg.optim.lr, time.perf_counter() - t0))
        if t.eval_every and run.step % t.eval_every == 0 and k + 1 < steps_per_epoch:
            _evaluate(run, at)
        if t.save_every and run.step % t.save_every == 0:
            path = os.path.join(run.room.ckpt_dir, f"step_{run.step:06d}")
            save_new_model_checkpoint(run.model, path, run.arch, run.hf_config, run.dtype, extra_from=run.cfg.ckpt)
            run.checkpoints.append(path)
        if run.room.stop_requested():
            raise run.room.stopped(run.step, run.checkpoints[-1] if run.checkpoints else None, resumable=False)
    return stats


def _train_line(m: dict[str, Any], epoch: float, lr: float, seconds: float) -> dict[str, float]:
    """A training step's ``metrics.jsonl`` line."""
    line = {K.RM_TRAIN_LOSS: m["loss"], K.RM_TRAIN_ACC: m["acc"], K.RM_TRAIN_MEAN_SCORE: m["mean_score"],
            K.RM_TRAIN_NUM_SAMPLES: m["num_samples"], K.RM_TRAIN_GRAD_NORM: m["grad_norm"],
            K.RM_TRAIN_NONFINITE: float(m["nonfinite"]), K.RM_TRAIN_LR: lr, K.RM_TRAIN_SECONDS: seconds,
            K.RM_EPOCH: epoch}
    if m.get("moe_aux_loss") is not None:
        line[K.RM_TRAIN_MOE_AUX_LOSS] = m["moe_aux_loss"]
    return line


def _evaluate(run: _RMRun, epoch: float) -> None:
    """Evaluate the current model on the evaluation rows (collective), log it and keep it as the last."""
    if run.evals is None:
        return
    t = run.cfg.train
    scores = score_texts(run.ddp, run.tokenizer, [ex.rm_text() for ex in run.evals], t.micro_batch_size, run.max_len)
    report = accuracy_report(run.evals, scores, t.threshold)
    run.room.metrics.log(run.step, {
        K.RM_EVAL_ACCURACY: report["accuracy"], K.RM_EVAL_N: report["n"], K.RM_EVAL_MEAN_PROB: report["mean_prob"],
        K.RM_EVAL_ACC_CORRECT: report["per_label"]["correct"]["accuracy"],
        K.RM_EVAL_ACC_INCORRECT: report["per_label"]["incorrect"]["accuracy"], K.RM_EPOCH: epoch})
    logger.info("train-rm step %d: eval accuracy %.4f (%d rows)", run.step, report["accuracy"], report["n"])
    run.last_eval = report


def _row_mean(stats: Sequence[dict[str, Any]], key: str) -> float:
    """The row-weighted mean of ``key`` over steps' metrics."""
    return sum(m[key] * m["num_samples"] for m in stats) / sum(m["num_samples"] for m in stats)
