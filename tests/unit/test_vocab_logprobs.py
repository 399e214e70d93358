"""Log-probabilities and entropy from (vocab-parallel) logits in chunks of tokens
(:func:`cooper_mcore.algo.chunked_logprobs_entropy`): hand values, a float64 plain-torch reference,
the trainer's previous functions (megatron's ``vocab_parallel_cross_entropy`` on an fp32 copy, the
full-vocabulary entropy), the vocabulary split over two "ranks" (threads that all-reduce through a
barrier), bf16 logits, and that no fp32 tensor larger than one chunk is ever made.

Tolerances: the chunked values are fp32 sums of ``V`` exponentials (pairwise in torch, so a few ulps
of ``log Z``) and a logarithm: against float64 they agree to about ``log2(V) * 6e-8 * |log Z|``,
under 2e-6 at ``V <= 1000`` and logits of scale 3; 1e-5 leaves a margin for other reduction orders
(vector ISAs). Gradients are ``[v = label] - p_v`` (and ``-p_v (log p_v + H)``) times the upstream
gradient, each entry computed from one fp32 exponential: 1e-6 of the largest upstream gradient. A
wrong chunk boundary, a label on the wrong slice or a missing term is off by 1e-2 or more.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cooper_mcore.algo import VocabShard, chunked_logprobs_entropy
from cooper_mcore.parallel import single_process_world
from cooper_mcore.train.tokens import token_logprobs, token_logprobs_and_entropy
from tests.harness.previous_logprobs import previous_token_logprobs, previous_vocab_parallel_entropy

MODES = ("none", "metric", "grad")


def _case(shape=(3, 7), vocab=300, scale=3.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    g_logp, g_ent = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    return logits, labels, g_logp, g_ent


def _reference(logits: torch.Tensor, labels: torch.Tensor, g_logp, g_ent):
    """float64 plain torch: values and the gradient of ``sum(g_logp * logp + g_ent * H)``."""
    x = logits.detach().double().requires_grad_()
    log_p = torch.log_softmax(x, dim=-1)
    logp = log_p.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    (g_logp.double() * logp + (0 if g_ent is None else g_ent.double() * ent)).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def _chunked(logits, labels, g_logp, g_ent, chunk, mode, shard=None):
    x = logits.detach().clone().requires_grad_()
    logp, ent = chunked_logprobs_entropy(x, labels, shard, chunk_tokens=chunk, entropy=mode)
    loss = (g_logp * logp).sum()
    if mode == "grad":
        loss = loss + (g_ent * ent).sum()
    loss.backward()
    return logp.detach(), ent, x.grad


def test_hand_values():
    # two entries [0, ln 3]: p = (1/4, 3/4); H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351446
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, 5.0], [1000.0, 1000.0]])
    logp, ent = chunked_logprobs_entropy(logits, torch.tensor([1, 0, 1]), chunk_tokens=2, entropy="metric")
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), math.log(0.5), math.log(0.5)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.tensor([0.5623351446, math.log(2.0), math.log(2.0)]), atol=1e-6, rtol=0)
    # d logp / d l = [v = label] - p: (-1/4, 1/4) for the first row
    x = logits.clone().requires_grad_()
    chunked_logprobs_entropy(x, torch.tensor([1, 0, 1]), chunk_tokens=1)[0][0].backward()
    torch.testing.assert_close(x.grad[0], torch.tensor([-0.25, 0.25]), atol=1e-7, rtol=0)
    assert chunked_logprobs_entropy(logits, torch.tensor([1, 0, 1]))[1] is None  # entropy="none"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", [1, 4, 7, 21, 1024])
def test_equal_a_float64_reference(mode, chunk):
    logits, labels, g_logp, g_ent = _case()
    logp, ent, grad = _chunked(logits, labels, g_logp, g_ent, chunk, mode)
    ref_logp, ref_ent, ref_grad = _reference(logits, labels, g_logp, g_ent if mode == "grad" else None)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    if mode == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent.detach().double(), ref_ent, atol=1e-5, rtol=0)
        assert ent.requires_grad == (mode == "grad")
    scale = float(ref_grad.abs().max())
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6 * scale, rtol=0)


@pytest.mark.parametrize("chunk", [3, 1024])
def test_equal_the_previous_functions(chunk):
    """The trainer's log-probabilities and entropy before the chunks (TP=1): the same values and
    gradients within fp32 round-off."""
    logits, labels, g_logp, g_ent = _case(shape=(4, 9), vocab=500)
    with single_process_world():
        x = logits.clone().requires_grad_()
        logp, ent = token_logprobs_and_entropy(x, labels, "grad", chunk)
        ((g_logp * logp).sum() + (g_ent * ent).sum()).backward()
        y = logits.clone().requires_grad_()
        prev_logp, prev_ent = previous_token_logprobs(y, labels), previous_vocab_parallel_entropy(y)
        ((g_logp * prev_logp).sum() + (g_ent * prev_ent).sum()).backward()
        torch.testing.assert_close(token_logprobs(logits, labels, chunk), prev_logp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(logp.detach(), prev_logp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.detach(), prev_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6 * float(y.grad.abs().max()), rtol=0)


class _ThreadGroup:
    """``n`` threads that all-reduce through a barrier: every thread gets the same result, summed or
    maxed in rank order (deterministic)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n)

    def shard(self, rank: int, width: int) -> VocabShard:
        def reduce(op):
            def run(t):
                self.slots[rank] = t.clone()
                self.barrier.wait()
                out = self.slots[0].clone()
                for other in self.slots[1:]:
                    out = op(out, other)
                self.barrier.wait()
                return out
            return run

        return VocabShard(start=rank * width, all_reduce_max=reduce(torch.maximum), all_reduce_sum=reduce(torch.add))


@pytest.mark.parametrize("mode", MODES)
def test_vocabulary_split_over_two_ranks_is_exact(mode):
    """Each rank holds half of the vocabulary: the log-probabilities and the entropy are the whole
    vocabulary's on both ranks, and each rank's gradient is its slice of the whole gradient."""
    logits, labels, g_logp, g_ent = _case(shape=(5, 6), vocab=400, seed=3)
    ref_logp, ref_ent, ref_grad = _reference(logits, labels, g_logp, g_ent if mode == "grad" else None)
    group, results = _ThreadGroup(2), [None, None]

    def rank(r):
        part = logits[..., r * 200:(r + 1) * 200]
        results[r] = _chunked(part, labels, g_logp, g_ent, 4, mode, group.shard(r, 200))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    scale = float(ref_grad.abs().max())
    for r, (logp, ent, grad) in enumerate(results):
        torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
        if mode != "none":
            torch.testing.assert_close(ent.detach().double(), ref_ent, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad.double(), ref_grad[..., r * 200:(r + 1) * 200], atol=1e-6 * scale, rtol=0)


def test_bf16_logits_give_the_fp32_values_and_a_bf16_gradient():
    """bf16 logits are read in fp32 (the same numbers as their fp32 upcast) and never written; the
    gradient is the fp32 one rounded once to bf16."""
    logits, labels, g_logp, g_ent = _case(dtype=torch.bfloat16)
    before = logits.clone()
    logp, ent, grad = _chunked(logits, labels, g_logp, g_ent, 5, "grad")
    logp32, ent32, grad32 = _chunked(logits.float(), labels, g_logp, g_ent, 5, "grad")
    assert torch.equal(logits, before) and grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp, logp32, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ent32, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, grad32.to(torch.bfloat16), atol=0, rtol=0)


def test_fp32_logits_are_not_written():
    logits, labels, g_logp, g_ent = _case()
    x = logits.clone().requires_grad_()
    logp, ent = chunked_logprobs_entropy(x, labels, chunk_tokens=4, entropy="grad")
    ((g_logp * logp).sum() + (g_ent * ent).sum()).backward()
    assert torch.equal(x.detach(), logits)


class _Allocations(TorchDispatchMode):
    """Record the element count of every fp32 tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t._base is None:
                self.fp32.append(t.numel())
        return out


@pytest.mark.parametrize("mode", MODES)
def test_no_fp32_tensor_larger_than_a_chunk(mode):
    """bf16 logits of 64 positions: no fp32 tensor of more than one chunk (8 positions) of the
    vocabulary is made, forward or backward; the previous functions made several of all 64."""
    tokens, vocab, chunk = 64, 512, 8
    logits, labels, g_logp, g_ent = _case(shape=(4, 16), vocab=vocab, dtype=torch.bfloat16)
    with _Allocations() as seen:
        _chunked(logits, labels, g_logp, g_ent, chunk, mode)
    assert max(seen.fp32) <= chunk * vocab, max(seen.fp32)
    with single_process_world(), _Allocations() as before:
        x = logits.clone().requires_grad_()
        ((g_logp * previous_token_logprobs(x, labels)).sum() + (g_ent * previous_vocab_parallel_entropy(x)).sum()
         ).backward()
    assert sum(n >= tokens * vocab for n in before.fp32) >= 3


def test_bad_arguments_are_value_errors():
    logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_logprobs_entropy(logits, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="entropy must be one of"):
        chunked_logprobs_entropy(logits, labels, entropy="yes")
    with pytest.raises(ValueError, match="must agree"):
        chunked_logprobs_entropy(logits, labels[:, :2])
