"""Supervised fine-tuning (SFT) of a policy checkpoint with Megatron, and SFT data for the arithmetic task.

:func:`sft` trains a cooper_mcore model checkpoint on ``(prompt ids, response ids)`` pairs with
the masked token-mean cross-entropy of the response tokens (the prompt is context only). It
uses megatron-core's per-token loss mode: each micro-batch returns the *sum* of its token losses
and its token count, and the gradients are divided by the token count of the whole global batch
(all micro-batches and data-parallel ranks), so the update does not depend on how the batch is
split. The optimizer is megatron's (distributed) Adam with decoupled weight decay and a global
gradient-norm clip. Examples are visited as a seeded stream of shuffled epochs (each epoch a
permutation of the examples, epochs concatenated); every step takes the next
``global_batch_size`` of them and data-parallel rank ``r`` trains on the ``r``-th contiguous slice.
The result is written as a new model checkpoint (``cooper_model.json`` and the input
checkpoint's tokenizer files in ``hf_extra/``), under a temporary name renamed when complete.
The job's settings are an :class:`~cooper_mcore.config.schema.SFTConfig` (``cooper sft --config PRESET``
builds the examples from its ``data`` section); it runs in the job skeleton
(:func:`cooper_mcore.job.job`: world, progress bar, stop signal; no metrics file, its output folder
is the checkpoint, locked through ``<out>.lock`` beside it while the job runs).

:func:`math_sft_examples` builds SFT pairs for :mod:`cooper_mcore.data.mathgen`: the prompt is
the templated question tokenised as the trainer and ``cooper eval`` tokenise prompts, the
response the worked solution (``59-15=44,44-75=-31 \\boxed{-31}``) followed by EOS. With
``mix_wrong > 0`` that share of the responses is a *plausible wrong* worked solution
(:func:`wrong_worked_solution`): one step off by +-1 or +-10 (later steps computed correctly
from the wrong value), or the steps right but an intermediate result boxed as the answer. A
policy pre-trained this way makes mistakes that are modes of its own distribution rather than
missing skill, so the correct mode has non-zero probability on most prompts and RL can select
it within few steps (the demo's design; leave ``mix_wrong`` at 0 for plain SFT).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from megatron.core import parallel_state

from cooper_mcore.checkpoint.model import load_checkpoint_model, read_meta, save_model_checkpoint_atomic
from cooper_mcore.collectives import all_reduce
from cooper_mcore.config.checks import validate
from cooper_mcore.config.schema import SFTConfig
from cooper_mcore.data.iterator import epoch_order
from cooper_mcore.data.mathgen import (
    MathProblem,
    MathTaskConfig,
    format_answer,
    generate_problems,
    to_prompts,
    worked_solution,
)
from cooper_mcore.data.templates import template_prompts
from cooper_mcore.data.tokenizer import check_vocab_fits, pad_id_of
from cooper_mcore.job import JobRoom, job
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.parallel import launched_world_size
from cooper_mcore.train.moe_aux import AuxLossCounts
from cooper_mcore.train.step import OptimConfig, build_scheduler, train_step, wrap_for_training
from cooper_mcore.train.tokens import build_token_batch, token_logprobs

logger = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]
_DELTAS = (-10, -1, 1, 10)


# --------------------------------------------------------------------------- SFT data


def wrong_worked_solution(problem: MathProblem, rng: random.Random, style: str = "boxed") -> str:
    """A plausible but wrong worked solution of ``problem``.

    The kind is drawn first, each with equal probability: *off by* (a random step's result off by
    -10, -1, +1 or +10, the later steps computed correctly from the wrong value,
    ``59-15=45,45-75=-30 \\boxed{-30}``) or, for problems of two or more steps, *intermediate*
    (the steps all right but an intermediate result boxed, ``59-15=44,44-75=-31 \\boxed{44}``).
    Variants whose final answer happens to be right (a later ``*0``, an intermediate equal to the
    answer) are never returned.

    Args:
        problem: the problem.
        rng: the random source.
        style: the final-answer style (see :func:`cooper_mcore.data.mathgen.format_answer`).

    Returns:
        The completion text, in the format of :func:`cooper_mcore.data.mathgen.worked_solution`.
    """
    off_by: list[tuple[list[int], int]] = []  # (results per step, boxed answer)
    for step in range(len(problem.ops)):
        for delta in _DELTAS:
            results = list(problem.results[:step]) + [problem.results[step] + delta]
            for op, b in zip(problem.ops[step + 1:], problem.operands[step + 2:]):
                results.append(MathProblem((results[-1], b), (op,)).answer)
            if results[-1] != problem.answer:  # never empty: an error in the last step always shows
                off_by.append((results, results[-1]))
    intermediate = [(list(problem.results), r) for r in problem.results[:-1] if r != problem.answer]
    results, boxed = rng.choice(rng.choice([k for k in (off_by, intermediate) if k]))
    lhs = [problem.operands[0]] + results[:-1]
    steps = [f"{a}{op}{b}={r}" for a, op, b, r in zip(lhs, problem.ops, problem.operands[1:], results)]
    return ",".join(steps) + " " + format_answer(boxed, style)


def math_sft_examples(
    tokenizer: Any,
    n: int,
    config: Optional[MathTaskConfig] = None,
    seed: int = 0,
    template: str = "{question}",
    mix_wrong: float = 0.0,
    style: Union[str, Callable[[MathProblem, random.Random], str]] = "boxed",
    use_chat_template: bool = False,
    problems: Optional[Sequence[MathProblem]] = None,
) -> list[Example]:
    """SFT pairs for ``n`` distinct train-split arithmetic problems.

    Args:
        tokenizer: the policy's tokenizer (:func:`cooper_mcore.data.tokenizer.load_tokenizer`); needs an EOS token.
        n: how many examples (distinct questions of the train split; never a held-out one).
        config: the problem family (default: :class:`~cooper_mcore.data.mathgen.MathTaskConfig`).
        seed: draws the problems and which of them get a wrong solution.
        template: prompt format template with ``{question}`` (as the trainer's ``data.template``).
        mix_wrong: share in [0, 1] of the examples (rounded to a count) whose response is a plausible
            wrong worked solution (:func:`wrong_worked_solution`; see the module docstring).
        style: final-answer style (:data:`~cooper_mcore.data.mathgen.STYLES`), or a function of the
            problem and the random source choosing one per example (a task whose convention varies).
        use_chat_template: wrap the prompt with the tokenizer's chat template (as the trainer's option).
        problems: the problems to use (``n`` of them, train split) instead of drawing them from ``config``.

    Returns:
        ``(prompt ids, response ids)`` pairs; the prompt ids are what the trainer and ``cooper eval``
        generate from, the response ids the completion text's tokens followed by EOS.

    Raises:
        ValueError: ``mix_wrong`` outside [0, 1], a tokenizer without EOS, or as
            :func:`~cooper_mcore.data.mathgen.generate_problems` and the template functions.
    """
    if not 0.0 <= mix_wrong <= 1.0:
        raise ValueError(f"mix_wrong must be in [0, 1], got {mix_wrong}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("math_sft_examples: the tokenizer has no EOS token")
    if problems is None:
        problems = generate_problems(n, config, "train", seed)
    elif len(problems) != n:
        raise ValueError(f"math_sft_examples: {len(problems)} problems given for n={n}")
    prompts = template_prompts(to_prompts(problems), template, tokenizer, use_chat_template, tokenize=True)
    rng = random.Random(seed * 1_000_003 + 7)
    wrong = set(rng.sample(range(n), round(mix_wrong * n)))
    out = []
    for i, (problem, prompt) in enumerate(zip(problems, prompts)):
        form = style(problem, rng) if callable(style) else style
        text = wrong_worked_solution(problem, rng, form) if i in wrong else worked_solution(problem, form)
        response = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]
        out.append((list(prompt.token_ids), response))
    return out


# --------------------------------------------------------------------------- training


def example_stream(num_examples: int, global_batch_size: int, seed: int, dp_rank: int = 0,
                   dp_size: int = 1) -> Iterator[list[int]]:
    """Indices of this data-parallel rank's share of each global batch, forever.

    Epoch ``e`` visits the examples in :func:`cooper_mcore.data.iterator.epoch_order` ``(seed, e)``;
    the epochs are concatenated (a batch may span two epochs) and cut into global batches, of which
    rank ``dp_rank`` gets the ``dp_rank``-th of ``dp_size`` contiguous slices.
    """
    share = global_batch_size // dp_size
    epoch, pending = 0, []
    while True:
        while len(pending) < global_batch_size:
            pending += epoch_order(num_examples, seed, epoch)
            epoch += 1
        batch, pending = pending[:global_batch_size], pending[global_batch_size:]
        yield batch[dp_rank * share:(dp_rank + 1) * share]


def _sft_step(ddp, optimizer, examples: Sequence[Example], pad_id: int,
              micro_batch_size: int) -> tuple[float, float, float]:
    """One guarded optimizer step on this rank's examples; returns (this rank's loss sum, token
    count, grad norm: NaN when a non-finite loss or gradient skipped the update)."""
    batch = build_token_batch([p for p, _ in examples], [r for _, r in examples], pad_id)

    def step(data_iterator, model):
        mb = next(data_iterator)
        logits = mb.micro.forward(model)

        def loss_fn(output):
            nll = -token_logprobs(output, mb.labels) * mb.loss_mask
            n = mb.loss_mask.sum()
            return nll.sum(), n.int(), {"loss": nll.sum().detach(), "tokens": n.detach()}

        return logits, loss_fn

    mbs = batch.micro_batches(MicroBatching(micro_batch_size))
    counts = AuxLossCounts(float(sum(mb.loss_mask.sum() for mb in mbs)), sum(mb.micro.num_tokens for mb in mbs))
    result = train_step(ddp, optimizer, step, iter(mbs), len(mbs), batch.input_ids.shape[1], micro_batch_size,
                        aux_counts=counts)
    loss_sum = float(sum(r["loss"] for r in result.metrics))  # last pipeline stage only
    tokens = float(sum(r["tokens"] for r in result.metrics))
    return loss_sum, tokens, result.grad_norm


def sft(cfg: SFTConfig, examples: Sequence[Example]) -> dict[str, Any]:
    """Fine-tune a model checkpoint on prompt/response pairs (response tokens' token-mean cross-entropy).

    Collective: under torchrun every rank calls it with the same arguments; in a plain process a
    one-process world is set up (and torn down) if none is initialised (:func:`cooper_mcore.job.job`).
    Data parallelism is the world size over ``tp * pp``. A stop signal (SIGTERM, SIGUSR1, Ctrl-C)
    ends the job after the current step with :class:`~cooper_mcore.job.TrainingStopped`, writing
    nothing (SFT keeps no training checkpoints).

    Args:
        cfg: the job (:class:`~cooper_mcore.config.schema.SFTConfig`): ``ckpt`` the cooper_mcore causal-LM
            checkpoint to start from, ``out`` the output checkpoint folder (must not exist),
            ``parallel`` the TP/PP layout, ``optim`` AdamW's peak ``lr`` (reached after
            ``warmup_steps`` of linear warm-up from 0), ``weight_decay`` and ``clip_grad``, and
            ``train`` the loop (``steps``, ``global_batch_size``, a multiple of ``micro_batch_size
            * dp``, ``min_lr``, ``seed``, ``log_every``). ``cfg.data`` is not read: the examples are given.
        examples: ``(prompt ids, response ids)``; the response should end with EOS to teach stopping.

    Returns:
        ``{"loss": [global token-mean loss of each step, before its update], "grad_norm": [...],
        "lr": [learning rate of each step], "tokens": response tokens trained on, "seconds": wall time
        of the steps (not loading and saving), "steps": steps}``
        (the same on every rank).

    Raises:
        ValueError: no examples, an empty prompt or response, an example longer than the model's
            positions, a non-causal-LM checkpoint, or inconsistent sizes.
        FileExistsError: ``cfg.out`` exists.
    """
    t, o = cfg.train, cfg.optim
    arch, hf_config, dtype = check_sft(cfg, examples)
    # the output is renamed into place when complete: the lock is a file beside it, the check made again holding it
    with job(cfg.out, t.steps, parallel=cfg.parallel, seed=t.seed, write_metrics=False,
             check=lambda: _check_out_free(cfg.out), lock_file=os.path.abspath(cfg.out) + ".lock") as room:
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        assert t.global_batch_size % (t.micro_batch_size * dp) == 0, "validate() checks the batch against dp"
        model, arch = load_checkpoint_model(cfg.ckpt, cfg.parallel)
        ddp, optimizer = wrap_for_training(
            model, OptimConfig(lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad), per_token_loss=True)
        scheduler = build_scheduler(optimizer, o.lr, o.warmup_steps, t.steps, o.weight_decay, t.min_lr)
        stream = example_stream(len(examples), t.global_batch_size, t.seed, dp_rank, dp)
        history = _sft_steps(cfg, room, ddp, optimizer, scheduler, _batches(examples, stream), pad_id_of(hf_config))
        save_model_checkpoint_atomic(model, cfg.out, arch, hf_config, dtype, extra_from=cfg.ckpt)
        if room.main:
            logger.info("sft: %d steps in %.1f s, loss %.4f -> %.4f; wrote %s", t.steps, history["seconds"],
                        history["loss"][0], history["loss"][-1], cfg.out)
        del ddp, optimizer, model
    return history


def check_sft(cfg: SFTConfig, examples: Sequence[Example]) -> tuple[Any, dict[str, Any], Any]:
    """Check the job before any work (its config by :func:`cooper_mcore.config.checks.validate`, as
    ``cooper train``'s, then the examples); return the input checkpoint's ``(arch, hf_config, dtype)``.

    Raises:
        ValueError / FileExistsError: as :func:`sft`.
    """
    validate(cfg, launched_world_size())
    if not examples:
        raise ValueError("sft: no examples")
    bad = next((i for i, (p, r) in enumerate(examples) if not p or not r), None)
    if bad is not None:
        raise ValueError(f"sft: example {bad} has an empty prompt or response")
    _check_out_free(cfg.out)
    arch, hf_config, dtype = read_meta(cfg.ckpt)
    if arch.model_type != "causal_lm":
        raise ValueError(f"sft needs a causal-LM checkpoint; {cfg.ckpt!r} is a {arch.model_type} model")
    top = max(max(max(p), max(r)) for p, r in examples)
    check_vocab_fits(top + 1, arch.vocab_size, "the tokenizer of the SFT examples", cfg.ckpt)
    longest = max(len(p) + len(r) for p, r in examples)
    if longest > arch.max_position_embeddings:
        raise ValueError(f"sft: an example has {longest} tokens, more than the model's "
                         f"max_position_embeddings={arch.max_position_embeddings}")
    return arch, hf_config, dtype


def _check_out_free(out: str) -> None:
    """Raise FileExistsError when the output checkpoint ``out`` exists."""
    if os.path.exists(out):
        raise FileExistsError(f"output {out!r} already exists; remove it or choose another path")


def _batches(examples: Sequence[Example], stream: Iterator[list[int]]) -> Iterator[list[Example]]:
    """This rank's examples of each step, forever."""
    for indices in stream:
        yield [examples[i] for i in indices]


def _sft_steps(cfg: SFTConfig, room: JobRoom, ddp: Any, optimizer: Any, scheduler: Any,
               batches: Iterator[list[Example]], pad_id: int) -> dict[str, Any]:
    """The SFT loop: ``cfg.train.steps`` guarded steps, each logged; a stop signal ends it after its step."""
    steps, tp = cfg.train.steps, cfg.parallel.tp
    history: dict[str, Any] = {"loss": [], "grad_norm": [], "lr": [], "tokens": 0, "steps": steps}
    start = time.perf_counter()
    for step in range(1, steps + 1):
        history["lr"].append(float(optimizer.param_groups[0]["lr"]))
        loss_sum, tokens, grad_norm = _sft_step(ddp, optimizer, next(batches), pad_id, cfg.train.micro_batch_size)
        if math.isfinite(grad_norm):  # as megatron: a skipped (non-finite) update does not advance the schedule
            scheduler.step(1)
        else:
            logger.warning("sft step %d: non-finite loss or gradient norm; update skipped", step)
        # over the world: TP replicas count each sum tp times (cancels in the ratio), non-last stages add 0
        totals = all_reduce(torch.tensor([loss_sum, tokens], dtype=torch.float64))
        loss = float(totals[0] / totals[1])
        history["loss"].append(loss)
        history["grad_norm"].append(grad_norm)
        history["tokens"] += int(round(float(totals[1]) / tp))
        room.log(step, {K.LOSS: loss, K.GRAD_NORM: grad_norm, K.LR: history["lr"][-1]})  # the bar's (no file)
        log_every = cfg.train.log_every
        if room.main and ((log_every and step % log_every == 0) or step == steps):
            elapsed = time.perf_counter() - start
            logger.info("sft step %d/%d: loss %.4f, grad norm %.3f, lr %.2e, %.0f tokens/s", step, steps,
                        loss, grad_norm, history["lr"][-1], history["tokens"] / max(elapsed, 1e-9))
        if step < steps and room.stop_requested():
            raise room.stopped(step, None)
    history["seconds"] = time.perf_counter() - start
    return history
