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
it counts only its real rows). ``out_dir`` receives ``metrics.jsonl`` (one JSON object per
training step, ``"kind": "train"``, and per evaluation, ``"kind": "eval"``), checkpoints
(``checkpoints/step_NNNNNN`` every ``save_every`` steps and ``final``; each written under a
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
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.atomic import atomic_open, check_output_path
from cooper_mcore.checkpoint.model import load_checkpoint_model, read_meta, save_new_model_checkpoint
from cooper_mcore.checkpoint.tokenizer import load_checkpoint_tokenizer
from cooper_mcore.collectives import all_gather
from cooper_mcore.data.rm_data import RMExample, read_eval_examples, read_rm_examples
from cooper_mcore.data.tokenizer import check_tokenizer_fits, pad_id_of
from cooper_mcore.mcore.reward_model import (
    bce_train_step,
    pad_token_lists,
    rm_scores,
    tokenize_texts,
    wrap_reward_model,
)
from cooper_mcore.mcore.training import OptimConfig
from cooper_mcore.metrics import JsonlWriter, write_json_atomic
from cooper_mcore.parallel import ParallelConfig, job_world

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
FINAL_DIR = "final"
CHECKPOINTS_DIR = "checkpoints"


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


def train_rm(
    ckpt_in: str,
    train_path: str,
    out_dir: str,
    eval_path: Optional[str] = None,
    epochs: int = 3,
    lr: float = 2e-5,
    weight_decay: float = 0.01,
    micro_batch_size: int = 4,
    global_batch_size: int = 32,
    eval_every: int = 0,
    save_every: int = 0,
    seed: int = 1234,
    parallel: Optional[ParallelConfig] = None,
    max_length: Optional[int] = None,
    clip_grad: float = 1.0,
    threshold: float = 0.5,
    eval_at_start: bool = True,
    skip_malformed: bool = False,
    question_key: str = "question",
    reference_key: str = "reference",
    completion_key: str = "completion",
    label_key: str = "label",
    eval_format: str = "auto",
) -> dict[str, Any]:
    """Train a reward model with binary cross-entropy on labeled triples (module docstring).

    Args:
        ckpt_in: the initial reward-model checkpoint (``hf-to-mcore --model-type reward``).
        train_path: labeled training data (JSONL/Parquet).
        out_dir: output folder; must not exist or be empty.
        eval_path: optional evaluation data (labeled or VerifyBench format), evaluated before
            training (``eval_at_start``), every ``eval_every`` steps and after each epoch.
        epochs: passes over the training data.
        lr / weight_decay / clip_grad: AdamW at a constant learning rate, gradient-norm clipping.
        micro_batch_size: rows per forward/backward micro-batch.
        global_batch_size: rows per optimizer step over all data-parallel ranks; a multiple of
            ``micro_batch_size * data-parallel size``.
        eval_every: evaluate every this many steps (0: only after each epoch).
        save_every: also keep a checkpoint every this many steps (0: only ``final``).
        seed: data order and megatron RNG seed.
        parallel: TP/PP layout (default TP=PP=1).
        max_length: token limit per row (default: the model's ``max_position_embeddings``).
        threshold: probability threshold of the evaluation accuracy.
        eval_at_start: evaluate the initial model too (step 0).
        skip_malformed: skip and count malformed rows instead of raising.
        question_key / reference_key / completion_key / label_key: training-data field names.
        eval_format: ``"auto"``, ``"labeled"`` or ``"verifybench"``.

    Returns:
        ``{"steps", "epochs", "num_train", "skipped", "final_checkpoint", "checkpoints",
        "train_loss" (mean over the last epoch), "train_acc", "eval" (last evaluation or None),
        "metrics_path"}``; also written to ``out_dir/summary.json``.

    Raises:
        ValueError: invalid arguments (named), a non-reward checkpoint, malformed data.
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    parallel = parallel or ParallelConfig()
    for name, value in (("epochs", epochs), ("micro_batch_size", micro_batch_size),
                        ("global_batch_size", global_batch_size)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value}")
    for name, value in (("eval_every", eval_every), ("save_every", save_every)):
        if int(value) != value or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"out_dir {out_dir!r} exists and is not empty")
    train, skipped = read_rm_examples(train_path, question_key, reference_key, completion_key, label_key,
                                      skip_malformed=skip_malformed)
    evals = read_eval_examples(eval_path, eval_format, skip_malformed)[0] if eval_path else None

    with job_world(parallel, seed):
        dp = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        if global_batch_size % (micro_batch_size * dp):
            raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size * "
                             f"data-parallel size = {micro_batch_size} * {dp}")
        rank0 = dist.get_rank() == 0
        torch.manual_seed(seed)
        tokenizer = load_checkpoint_tokenizer(ckpt_in)
        model, arch, hf_config, dtype = _load_rm(ckpt_in, parallel, tokenizer)
        max_len = max_length or arch.max_position_embeddings
        pad = pad_id_of(tokenizer)
        tokens = tokenize_texts(tokenizer, [ex.rm_text() for ex in train], max_len)
        labels = torch.tensor([float(ex.label) for ex in train])
        ddp, optimizer = wrap_reward_model(model, OptimConfig(lr=lr, weight_decay=weight_decay, clip_grad=clip_grad))
        dist.barrier()  # every rank has checked that out_dir is empty before rank 0 writes to it
        if rank0:
            os.makedirs(os.path.join(out_dir, CHECKPOINTS_DIR), exist_ok=True)
        metrics_path = os.path.join(out_dir, METRICS_FILE)
        log = JsonlWriter(metrics_path if rank0 else None)
        local = global_batch_size // dp
        steps_per_epoch = -(-len(train) // global_batch_size)
        logger.info("train-rm: %d rows (%d skipped), %d epochs x %d steps, global batch %d, dp %d",
                    len(train), skipped, epochs, steps_per_epoch, global_batch_size, dp)

        def evaluate(step: int, epoch: float) -> Optional[dict[str, Any]]:
            if evals is None:
                return None
            scores = score_texts(ddp, tokenizer, [ex.rm_text() for ex in evals], micro_batch_size, max_len)
            report = accuracy_report(evals, scores, threshold)
            log.write({"kind": "eval", "step": step, "epoch": epoch, **report})
            logger.info("train-rm step %d: eval accuracy %.4f (%d rows)", step, report["accuracy"], report["n"])
            return report

        last_eval = evaluate(0, 0.0) if eval_at_start else None
        step, checkpoints, epoch_stats = 0, [], []
        for epoch in range(epochs):
            gen = torch.Generator().manual_seed(seed + epoch)
            order = torch.randperm(len(train), generator=gen)
            epoch_stats = []
            for k in range(steps_per_epoch):
                rows = order[k * global_batch_size:(k + 1) * global_batch_size][dp_rank * local:(dp_rank + 1) * local]
                mask = torch.ones(len(rows), dtype=torch.bool)
                if len(rows) == 0:  # the short last batch left nothing for this rank
                    rows, mask = order[:1], torch.zeros(1, dtype=torch.bool)
                ids, lengths = pad_token_lists([tokens[i] for i in rows.tolist()], pad)
                t0 = time.perf_counter()
                m = bce_train_step(ddp, optimizer, (ids, lengths, labels[rows]), micro_batch_size, mask=mask)
                step += 1
                epoch_stats.append(m)
                log.write({"kind": "train", "step": step, "epoch": epoch + (k + 1) / steps_per_epoch, "lr": lr,
                           "seconds": time.perf_counter() - t0, **m})
                if eval_every and step % eval_every == 0 and k + 1 < steps_per_epoch:
                    last_eval = evaluate(step, epoch + (k + 1) / steps_per_epoch)
                if save_every and step % save_every == 0:
                    path = os.path.join(out_dir, CHECKPOINTS_DIR, f"step_{step:06d}")
                    save_new_model_checkpoint(model, path, arch, hf_config, dtype, extra_from=ckpt_in)
                    checkpoints.append(path)
            n_ep = sum(m["num_samples"] for m in epoch_stats)
            logger.info("train-rm epoch %d/%d (step %d): loss %.4f, acc %.4f", epoch + 1, epochs, step,
                        sum(m["loss"] * m["num_samples"] for m in epoch_stats) / n_ep,
                        sum(m["acc"] * m["num_samples"] for m in epoch_stats) / n_ep)
            last_eval = evaluate(step, float(epoch + 1))
        final = os.path.join(out_dir, FINAL_DIR)
        save_new_model_checkpoint(model, final, arch, hf_config, dtype, extra_from=ckpt_in)
        n = sum(m["num_samples"] for m in epoch_stats)
        summary = {
            "steps": step, "epochs": epochs, "num_train": len(train), "skipped": skipped,
            "final_checkpoint": final, "checkpoints": checkpoints,
            "train_loss": sum(m["loss"] * m["num_samples"] for m in epoch_stats) / n,
            "train_acc": sum(m["acc"] * m["num_samples"] for m in epoch_stats) / n,
            "eval": last_eval, "metrics_path": metrics_path,
        }
        if rank0:
            write_json_atomic(os.path.join(out_dir, SUMMARY_FILE), summary)
        log.close()
    return summary
