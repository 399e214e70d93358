"""VerifyRM on Megatron: tokenised batches, forward-only scores and the two training losses.

The reward model is a :class:`~cooper_mcore.models.builder.RewardGPTModel` reading the VerifyRM
input (:func:`cooper_mcore.data.templates.rm_input`); its score is the logit at the last non-pad
token of a right-padded row, and ``sigmoid(score)`` is the probability that the completion is
correct.

Two losses, both computed in float32 on the last pipeline stage:

* **BCE** on labeled triples: ``mean_i BCEWithLogits(s_i, y_i)``.
* **Pairwise** (Cooper): ``sum_{valid i} -log sigmoid(s(chosen_i) - s(rejected_i)) / n_valid``
  (0 when no pair is valid).

Both are exact means over the *global* batch, whatever the micro-batching, pipeline or data
parallelism: every micro-batch returns ``(loss sum, number of counted rows, metrics)`` with
``config.calculate_per_token_loss = True``, so megatron sums the gradients of all micro-batches
and data-parallel ranks and divides them once by the total count (``finalize_model_grads``).
The flag must be set *before* the model is wrapped (megatron's DDP reads it then to drop its own
``1/dp`` scaling): wrap reward models with :func:`wrap_reward_model`, not ``wrap_for_training``.

Every micro-batch has exactly ``micro_batch_size`` rows and all micro-batches of a step share one
sequence length (the pipeline exchanges fixed-shape activations): the last micro-batch is filled
with masked copies of a real row, which count for nothing.

A pairwise step in which no pair is valid on any data-parallel rank runs no forward, no backward
and no optimizer step, so the weights and the optimizer state (Adam moments, step count) stay
bitwise unchanged; it returns ``skipped=True``. All ranks agree on this (the count is all-reduced
over the data-parallel group first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core import parallel_state

from cooper_mcore.algo import rm_bce_loss, rm_pair_losses
from cooper_mcore.collectives import all_reduce, broadcast_from_last_stage
from cooper_mcore.data.tokenizer import pad_id_of
from cooper_mcore.micro_batching.packing import round_up
from cooper_mcore.micro_batching.runner import (
    MicroBatching,
    build_micro_batch,
    fit_width,
    micro_batch_plan,
    split_micro_batches,
)
from cooper_mcore.models.builder import RewardGPTModel
from cooper_mcore.models.forward import (
    forward_only,
    moe_padding_kwargs,
    position_ids_for,
    run_schedule,
    sequence_multiple,
    unwrap,
    valid_tokens,
)
from cooper_mcore.parallel import device
from cooper_mcore.train.moe_aux import AuxLossCounts
from cooper_mcore.train.step import OptimConfig, train_step, wrap_for_training

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- tokenised batches


@dataclass
class RMBatch:
    """Right-padded reward-model inputs.

    Attributes:
        input_ids: ``[b, s]`` token ids (int64), padded on the right.
        lengths: ``[b]`` number of real tokens per row (the score is read at ``lengths - 1``); rows
            that are scored or trained on need at least one token (0 is allowed for placeholder
            rows of invalid pairs).
        labels: ``[b]`` 1.0 (correct) / 0.0 (incorrect) for BCE training; None otherwise.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    labels: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"RMBatch.input_ids must be [batch, seq], got shape {tuple(self.input_ids.shape)}")
        b, s = self.input_ids.shape
        if tuple(self.lengths.shape) != (b,):
            raise ValueError(f"RMBatch.lengths must have shape ({b},), got {tuple(self.lengths.shape)}")
        if b and (int(self.lengths.min()) < 0 or int(self.lengths.max()) > s):
            raise ValueError(f"RMBatch.lengths must lie in [0, {s}], got {self.lengths.tolist()}")
        if self.labels is not None and tuple(self.labels.shape) != (b,):
            raise ValueError(f"RMBatch.labels must have shape ({b},), got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def tokenize_texts(
    tokenizer: Any, texts: Sequence[str], max_length: Optional[int] = None, add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each text (with the tokenizer's default special tokens, e.g. a BOS, unless
    ``add_special_tokens=False``; Qwen tokenizers add none).

    A row longer than ``max_length`` tokens is cut in the middle: its first third and its last
    two thirds are kept (the question and the end of the completion, like the paper's character
    truncation of completions).

    Raises:
        ValueError: ``max_length`` < 2, or a text that tokenises to nothing.
    """
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    out = []
    cut = 0
    for i, ids in enumerate(tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]):
        ids = list(ids)
        if not ids:
            raise ValueError(f"text {i} tokenises to no token: {texts[i]!r}")
        if max_length is not None and len(ids) > max_length:
            head = max_length // 3
            ids = ids[:head] + ids[len(ids) - (max_length - head):]
            cut += 1
        out.append(ids)
    if cut:
        logger.warning("%d of %d reward-model inputs were longer than %d tokens and cut in the middle",
                       cut, len(out), max_length)
    return out


def pad_token_lists(
    token_lists: Sequence[Sequence[int]], pad_id: int, length: Optional[int] = None, multiple_of: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``([b, s] ids, [b] lengths)``.

    Args:
        token_lists: non-empty token id lists.
        pad_id: padding id.
        length: pad to this many columns (default: the longest row).
        multiple_of: round the column count up to a multiple of this (sequence parallelism
            needs a multiple of the TP size).
    """
    lengths = [len(t) for t in token_lists]
    if any(n == 0 for n in lengths):
        raise ValueError("pad_token_lists: empty token list")
    s = max(lengths, default=1) if length is None else length
    if lengths and max(lengths) > s:
        raise ValueError(f"pad_token_lists: a row has {max(lengths)} tokens, more than length={s}")
    s = -(-s // multiple_of) * multiple_of
    ids = torch.full((len(token_lists), s), pad_id, dtype=torch.long)
    for i, t in enumerate(token_lists):
        ids[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return ids, torch.tensor(lengths, dtype=torch.long)


def make_batch(
    tokenizer: Any,
    texts: Sequence[str],
    labels: Optional[Sequence[float]] = None,
    max_length: Optional[int] = None,
    multiple_of: int = 1,
) -> RMBatch:
    """Tokenise reward-model input texts (e.g. :func:`~cooper_mcore.data.templates.rm_input`) into a
    right-padded batch whose width is a multiple of ``multiple_of``."""
    ids, lengths = pad_token_lists(tokenize_texts(tokenizer, texts, max_length), pad_id_of(tokenizer),
                                   multiple_of=multiple_of)
    lab = None if labels is None else torch.tensor([float(x) for x in labels], dtype=torch.float32)
    return RMBatch(ids, lengths, lab)


# --------------------------------------------------------------------------- helpers


def _groups(model: torch.nn.Module):
    """(tp, pp, dp) process groups of a (possibly DDP-wrapped) model."""
    pgs = unwrap(model).pg_collection
    dp = getattr(pgs, "dp", None) or parallel_state.get_data_parallel_group()
    return pgs.tp, pgs.pp, dp


def _fill_rows(n: int, mbs: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices and 0/1 weights for a step over the rows where ``valid`` is True.

    Keeps the valid rows, then appends masked copies of the first kept row (or of row 0 when
    none is kept) until the count is a positive multiple of ``mbs``.
    """
    rows = torch.nonzero(valid, as_tuple=False).flatten()
    k = rows.numel()
    total = max(mbs, -(-k // mbs) * mbs)
    filler = rows[:1] if k else torch.zeros(1, dtype=torch.long)
    index = torch.cat([rows, filler.repeat(total - k)])
    weight = torch.cat([torch.ones(k), torch.zeros(total - k)])
    return index, weight


def _as_batch(x: Any, what: str) -> RMBatch:
    """An :class:`RMBatch` from itself or an ``(input_ids, lengths[, labels])`` tuple."""
    if isinstance(x, RMBatch):
        return x
    if isinstance(x, (tuple, list)) and len(x) in (2, 3):
        return RMBatch(*x)
    raise ValueError(f"{what} must be an RMBatch or an (input_ids, lengths[, labels]) tuple, got {type(x).__name__}")


def _check_wrapped(ddp: torch.nn.Module) -> None:
    if not getattr(unwrap(ddp).config, "calculate_per_token_loss", False):
        raise ValueError("the reward model was not wrapped with wrap_reward_model (its config needs "
                         "calculate_per_token_loss=True before the DDP wrapper is built)")


def _check_nonempty(lengths: torch.Tensor, what: str) -> None:
    if lengths.numel() and int(lengths.min()) < 1:
        raise ValueError(f"{what}: rows of length 0 cannot be scored (lengths {lengths.tolist()})")


def _global_sums(ddp: torch.nn.Module, per_micro: list[dict], keys: Sequence[str]) -> dict[str, float]:
    """Sum metric tensors over micro-batches (last stage), pipeline stages and data-parallel ranks."""
    _, pp, dp = _groups(ddp)
    t = torch.zeros(len(keys), dtype=torch.float64, device=device())
    for m in per_micro:
        t += torch.stack([m[k].to(t) for k in keys])
    t = all_reduce(broadcast_from_last_stage(t, pp), group=dp)
    return dict(zip(keys, t.tolist()))


def _global_count(ddp: torch.nn.Module, n: int) -> int:
    return int(all_reduce(torch.tensor(n, dtype=torch.long), group=_groups(ddp)[2]).item())


# --------------------------------------------------------------------------- scores and training


def wrap_reward_model(model: torch.nn.Module, optim: OptimConfig):
    """Wrap a reward model for :func:`bce_train_step` / :func:`pairwise_train_step`.

    The same as :func:`~cooper_mcore.train.step.wrap_for_training` with
    ``per_token_loss=True`` (``config.calculate_per_token_loss``, see the module docstring), after
    checking that ``model`` is a reward model.

    Returns:
        ``(ddp, optimizer)``.
    """
    if not isinstance(unwrap(model), RewardGPTModel):
        raise ValueError("wrap_reward_model needs a reward model (RewardGPTModel), got a policy model")
    return wrap_for_training(model, optim, per_token_loss=True)


def rm_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    micro_batch_size: Optional[int] = None,
    batching: Optional[MicroBatching] = None,
) -> torch.Tensor:
    """Forward-only reward scores (logits) of right-padded rows, at any TP/PP layout.

    Collective over the model's TP and PP groups: their ranks pass the same rows. Each
    data-parallel rank scores its own rows.

    Args:
        model: the reward model (this rank's stage; may be DDP-wrapped).
        input_ids: ``[b, s]`` token ids.
        lengths: ``[b]`` real lengths.
        micro_batch_size: rows per forward micro-batch (default: all at once); a batch that is
            not a multiple is filled up with copies of its first row, dropped afterwards.
        batching: micro-batches by a token budget, padded or packed (instead of ``micro_batch_size``).

    Returns:
        ``[b]`` float32 scores on the CPU, on every rank (broadcast from the last stage).
    """
    b = input_ids.shape[0]
    if b == 0:
        return torch.zeros(0, dtype=torch.float32)
    if batching is not None and batching.by_tokens:
        return _scores_by_tokens(model, input_ids, lengths, batching)
    mbs = min(micro_batch_size or b, b)
    if mbs < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    RMBatch(input_ids, lengths)  # validates the shapes and lengths
    _check_nonempty(lengths, "rm_scores")
    fill = -b % mbs
    ids = torch.cat([input_ids, input_ids[:1].expand(fill, -1)]) if fill else input_ids
    lens = torch.cat([lengths, lengths[:1].expand(fill)]) if fill else lengths
    ids = fit_width(ids, round_up(ids.shape[1], sequence_multiple(model)))
    out = forward_only(model, ids, sequence_lengths=lens, micro_batch_size=mbs)
    scores = torch.zeros(ids.shape[0], dtype=torch.float32, device=device())
    if out is not None:
        scores.copy_(out.float())
    return broadcast_from_last_stage(scores, _groups(model)[1])[:b].cpu()


@torch.no_grad()
def _scores_by_tokens(model: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor,
                      batching: MicroBatching) -> torch.Tensor:
    """:func:`rm_scores` over micro-batches by a token budget (padded or packed)."""
    RMBatch(input_ids, lengths)
    _check_nonempty(lengths, "rm_scores")
    model.eval()
    mbs = split_micro_batches(input_ids, lengths, batching, sequence_multiple(model))

    def step(data_iterator, m):
        mb = next(data_iterator)
        out = mb.forward(m, **mb.score_kwargs())

        def collect(scores):
            return torch.zeros((), device=scores.device), {"scores": scores.float()}

        return out, collect

    results = run_schedule(model, step, mbs, [mb.shape for mb in mbs], forward_only=True)
    scores = torch.zeros(input_ids.shape[0], dtype=torch.float32)
    for mb, r in zip(mbs, results):
        scores[mb.rows] = r["scores"].cpu()
    return broadcast_from_last_stage(scores, _groups(model)[1]).cpu()


def bce_train_step(
    ddp, optimizer, batch: RMBatch | tuple, micro_batch_size: int, mask: Optional[torch.Tensor] = None
) -> dict[str, Any]:
    """One optimizer step of binary cross-entropy on labeled rows.

    The loss is ``BCEWithLogits`` averaged over all counted rows of all data-parallel ranks.

    Args:
        ddp, optimizer: from :func:`wrap_reward_model`.
        batch: this data-parallel rank's rows, with ``labels`` (0/1): an :class:`RMBatch` or an
            ``(input_ids, lengths, labels)`` tuple.
        micro_batch_size: rows per micro-batch (gradient accumulation over the rest).
        mask: ``[b]`` bool, the rows to count (default: all). A rank may count no row (e.g. the
            short last batch of an epoch), but some rank must count one.

    Returns:
        Global metrics, the same on every rank: ``loss`` (mean BCE before the step), ``acc``
        (share of rows with ``(sigmoid(s) >= 0.5) == label``), ``mean_score``, ``num_samples``,
        ``grad_norm``, ``nonfinite``, ``moe_aux_loss`` (mixture-of-experts RMs, else None).
    """
    batch = _as_batch(batch, "batch")
    if batch.labels is None:
        raise ValueError("bce_train_step: the batch has no labels")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not bool(((batch.labels == 0) | (batch.labels == 1)).all()):
        raise ValueError(f"bce_train_step: labels must be 0 or 1, got {batch.labels.tolist()}")
    if len(batch) == 0:
        raise ValueError("bce_train_step: empty batch")
    keep = torch.ones(len(batch), dtype=torch.bool) if mask is None else mask.to(torch.bool).cpu()
    if tuple(keep.shape) != (len(batch),):
        raise ValueError(f"bce_train_step: mask of shape {tuple(keep.shape)} for {len(batch)} rows")
    _check_nonempty(batch.lengths, "bce_train_step")
    _check_wrapped(ddp)
    if _global_count(ddp, int(keep.sum())) == 0:
        raise ValueError("bce_train_step: no counted row on any rank")
    index, weight = _fill_rows(len(batch), micro_batch_size, keep)
    s = round_up(batch.input_ids.shape[1], sequence_multiple(ddp))
    ids = fit_width(batch.input_ids, s)[index]
    lens, labels = batch.lengths[index], batch.labels[index].float()
    dev = device()
    micro = [
        {"ids": ids[i:i + micro_batch_size].to(dev), "lens": lens[i:i + micro_batch_size].to(dev),
         "labels": labels[i:i + micro_batch_size].to(dev), "weight": weight[i:i + micro_batch_size].to(dev)}
        for i in range(0, index.numel(), micro_batch_size)
    ]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["ids"], position_ids_for(mb["ids"]), None, sequence_lengths=mb["lens"],
                    **moe_padding_kwargs(model, valid_tokens(tuple(mb["ids"].shape), mb["lens"])))

        def loss_fn(scores):
            scores = scores.float()
            w = mb["weight"]
            per_row, _ = rm_bce_loss(scores, mb["labels"], reduction="none")
            loss_sum = (per_row * w).sum()
            count = w.sum().to(torch.int)
            with torch.no_grad():
                correct = (((scores >= 0).float() == mb["labels"]).float() * w).sum()
                metrics = {"loss": loss_sum.detach(), "correct": correct, "count": w.sum(),
                           "score": (scores.detach() * w).sum()}
            return loss_sum, count, metrics

        return out, loss_fn

    counts = AuxLossCounts(float(keep.sum()), int(lens.sum()))
    result = train_step(ddp, optimizer, forward_step, iter(micro), len(micro), s, micro_batch_size, aux_counts=counts)
    sums = _global_sums(ddp, result.metrics, ("loss", "correct", "count", "score"))
    n = sums["count"]
    return {"loss": sums["loss"] / n, "acc": sums["correct"] / n, "mean_score": sums["score"] / n,
            "num_samples": int(n), "grad_norm": result.grad_norm, "nonfinite": not result.updated,
            "moe_aux_loss": result.moe_aux_loss}


def _pair_forward_step(anchor_weight: float) -> Callable:
    """megatron's ``forward_step`` for one micro-batch of pairs: chosen rows first, then rejected,
    scored together; the loss is Cooper's pairwise loss summed over the valid pairs."""

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = mb["micro"].forward(model, **mb["micro"].score_kwargs())

        def loss_fn(scores):
            scores, k = scores.float(), mb["pairs"]
            per_pair, sums = rm_pair_losses(scores[:k], scores[k:], mb["weight"] > 0, anchor_weight)
            loss_sum = per_pair.sum()
            metrics = {"loss": loss_sum.detach(), "correct": sums["correct_sum"], "count": sums["num_valid"],
                       "chosen": sums["chosen_sum"], "rejected": sums["rejected_sum"],
                       "pairwise": sums["pairwise_sum"], "anchor": sums["anchor_sum"],
                       "threshold_correct": sums["threshold_correct_sum"]}
            return loss_sum, sums["num_valid"].to(torch.int), metrics

        return out, loss_fn

    return forward_step


def _pair_micro_batches(chosen: RMBatch, rejected: RMBatch, valid: torch.Tensor, micro_batch_size: int,
                        batching: MicroBatching, mult: int, dp_group: Any) -> list[dict[str, Any]]:
    """Micro-batches of pairs, each ``{"micro": rows [chosen..., rejected...], "pairs": k, "weight": [k]}``.

    A pair never splits: its two rows are in one micro-batch. Fixed: ``micro_batch_size`` pairs each,
    the last filled up with weight-0 copies (the pipeline's fixed shapes). By tokens: the valid pairs
    binned by ``len(chosen) + len(rejected)``, as many micro-batches as the data-parallel rank with
    the most; a rank's spare micro-batch holds one weight-0 pair.
    """
    b = len(chosen)
    s = round_up(max(chosen.input_ids.shape[1], rejected.input_ids.shape[1]), mult)
    ids = torch.cat([fit_width(chosen.input_ids, s), fit_width(rejected.input_ids, s)])
    lens = torch.cat([chosen.lengths, rejected.lengths]).clamp(1, s)
    if not batching.by_tokens:
        index, weight = _fill_rows(b, micro_batch_size, valid)
        groups = [(index[i:i + micro_batch_size], weight[i:i + micro_batch_size])
                  for i in range(0, index.numel(), micro_batch_size)]
    else:
        kept = torch.nonzero(valid, as_tuple=False).flatten()
        plan = micro_batch_plan((lens[kept] + lens[kept + b]).tolist(), batching, dp_group, allow_empty=True)
        filler = kept[:1] if kept.numel() else torch.zeros(1, dtype=torch.long)
        groups = [(kept[p], torch.ones(len(p))) if p else (filler, torch.zeros(1)) for p in plan]
    out = []
    for idx, w in groups:
        rows = torch.cat([idx, idx + b])
        out.append({"micro": build_micro_batch(ids, lens, rows, batching, mult), "pairs": idx.numel(),
                    "weight": w.to(device())})
    return out


def pairwise_train_step(
    ddp, optimizer, chosen: RMBatch | tuple, rejected: RMBatch | tuple, valid_mask: torch.Tensor,
    micro_batch_size: int, anchor_weight: float = 0.0, batching: Optional[MicroBatching] = None,
) -> dict[str, Any]:
    """One optimizer step of Cooper's pairwise loss (:func:`cooper_mcore.algo.rm_pair_losses`).

    ``loss = sum_{valid i} [-log sigmoid(s(chosen_i) - s(rejected_i)) + anchor_weight * anchor_i] / n_valid``
    over the valid pairs of all data-parallel ranks, where ``anchor_i`` is the mean BCE of the pair's
    two rows against their own labels (chosen 1, rejected 0; ``anchor_weight=0`` is the paper's loss).
    megatron divides by the integer global count; the reference code's ``n_valid + 1e-6`` differs by
    a factor ``1 - 1e-6 / n_valid``. Only valid rows are run through the model; invalid rows may
    hold anything of the right shape. With no valid pair anywhere the step is skipped (see the
    module docstring): no weight or optimizer-state change.

    Args:
        ddp, optimizer: from :func:`wrap_reward_model`.
        chosen: this rank's preferred completions (one row per pair): an :class:`RMBatch` or an
            ``(input_ids, lengths)`` tuple.
        rejected: the rejected completions, aligned with ``chosen``.
        valid_mask: ``[b]`` bool, the pairs to train on.
        micro_batch_size: pairs per micro-batch (each micro-batch forwards ``2 * micro_batch_size`` rows).
        anchor_weight: weight of the calibration anchor (0: the paper's loss).
        batching: micro-batches by a token budget (a pair's two rows count together), padded or
            packed; default: ``micro_batch_size`` pairs each.

    Returns:
        Global metrics, the same on every rank: ``loss`` (before the step), ``pairwise_loss`` and
        ``anchor_loss`` (its two terms, the anchor unweighted), ``pair_acc`` (share of valid pairs with
        ``s(chosen) > s(rejected)``), ``threshold_acc`` (share of the pairs' rows on the right side of
        logit 0), ``num_valid``, ``mean_chosen``, ``mean_rejected``, ``grad_norm``, ``skipped`` and
        ``nonfinite`` (the update was skipped because the loss or the gradient norm was not finite;
        ``grad_norm`` is then NaN), ``moe_aux_loss`` (the routers' load-balancing loss of a
        mixture-of-experts RM, else None). Without valid pairs: ``loss`` 0.0, the others NaN / None,
        ``num_valid`` 0, ``skipped`` True, ``nonfinite`` False.
    """
    chosen, rejected = _as_batch(chosen, "chosen"), _as_batch(rejected, "rejected")
    b = len(chosen)
    if len(rejected) != b or tuple(valid_mask.shape) != (b,):
        raise ValueError(f"pairwise_train_step: {b} chosen rows, {len(rejected)} rejected rows and a "
                         f"valid_mask of shape {tuple(valid_mask.shape)} do not align")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    _check_wrapped(ddp)
    valid = valid_mask.to(torch.bool).cpu()
    _check_nonempty(chosen.lengths[valid], "pairwise_train_step (chosen)")
    _check_nonempty(rejected.lengths[valid], "pairwise_train_step (rejected)")
    n_global = _global_count(ddp, int(valid.sum()))
    if n_global == 0:
        logger.info("pairwise_train_step: no valid pair on any rank; step skipped")
        nan = float("nan")
        return {"loss": 0.0, "pairwise_loss": 0.0, "anchor_loss": 0.0, "pair_acc": nan, "threshold_acc": nan,
                "num_valid": 0, "mean_chosen": nan, "mean_rejected": nan, "grad_norm": None, "skipped": True,
                "nonfinite": False, "moe_aux_loss": None}
    micro = _pair_micro_batches(chosen, rejected, valid, micro_batch_size, batching or MicroBatching(micro_batch_size),
                                sequence_multiple(ddp), _groups(ddp)[2])

    shapes = [mb["micro"].shape for mb in micro]
    result = train_step(ddp, optimizer, _pair_forward_step(anchor_weight), iter(micro), len(micro),
                        max(c for _, c in shapes), max(r for r, _ in shapes), variable_shapes=len(set(shapes)) > 1,
                        aux_counts=AuxLossCounts(float(valid.sum()), sum(mb["micro"].num_tokens for mb in micro)))
    sums = _global_sums(ddp, result.metrics, ("loss", "correct", "count", "chosen", "rejected", "pairwise", "anchor",
                                              "threshold_correct"))
    n = sums["count"]
    assert int(n) == n_global, (n, n_global)
    return {"loss": sums["loss"] / n, "pair_acc": sums["correct"] / n, "num_valid": int(n),
            "mean_chosen": sums["chosen"] / n, "mean_rejected": sums["rejected"] / n,
            "pairwise_loss": sums["pairwise"] / n, "anchor_loss": sums["anchor"] / n,
            "threshold_acc": sums["threshold_correct"] / (2 * n),
            "grad_norm": result.grad_norm, "skipped": False, "nonfinite": not result.updated,
            "moe_aux_loss": result.moe_aux_loss}
