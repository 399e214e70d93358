"""GPU tier: the grouped experts' matrix multiplies on a CUDA device, at Qwen3-30B-A3B's expert shape.

Each test is a few kernels (under a second on any GPU): the group counts a layer is handed on the
host (as megatron's alltoall dispatcher hands them) reach the kernel without a host synchronisation;
experts without tokens get exactly zero weight gradients on the path this GPU takes (pytorch#172439:
torch's kernel on Blackwell did not; whether it still does is logged); a rank without tokens takes the
broadcast gradient of a sum.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cooper_mcore.models.experts import ExpertGroups, cuda_grouped_mm_correct, grouped_mm, grouped_mm_supported

pytestmark = pytest.mark.gpu
logger = logging.getLogger(__name__)

HIDDEN, FFN = 2048, 768  # Qwen3-30B-A3B's hidden size and expert FFN
COUNTS = [162, 0, 2577, 446, 0, 83]  # the rows per expert of pytorch#172439's report, two experts empty


def _operands(counts: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(sum(counts), HIDDEN, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(len(counts), FFN, HIDDEN, generator=generator) * 0.02).to("cuda", torch.bfloat16)
    return x, w.requires_grad_()


@pytest.mark.parametrize("grouped", [True, False], ids=["torch_grouped_mm", "per_expert"])
def test_host_counts_reach_the_experts_without_a_host_synchronisation(grouped):
    """Under ``torch.cuda.set_sync_debug_mode("error")`` any synchronising call (a blocking copy, a
    value read on the host) raises: the layer's groups from host counts, both linears' forward and
    their backward queue their work without waiting."""
    if grouped and not cuda_grouped_mm_correct(torch.cuda.get_device_capability()):
        pytest.skip("torch._grouped_mm is not used on this GPU")
    x, w = _operands(COUNTS, torch.Generator().manual_seed(0))
    w2 = w.detach().transpose(1, 2).contiguous().requires_grad_()
    counts = torch.tensor(COUNTS)  # pageable host memory, the worst case
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        groups = ExpertGroups.of(counts, x.device, grouped)
        out = grouped_mm(torch.relu(grouped_mm(x, w, groups)), w2, groups)
        out.float().pow(2).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == x.shape and float(w.grad.float().abs().max()) > 0


def test_experts_without_tokens_get_zero_weight_gradients():
    """On the path :func:`grouped_mm_supported` picks for this GPU, an expert without tokens gets a
    zero weight gradient; torch's grouped kernel forced on anyway is logged (pytorch#172439's check)."""
    x, w = _operands(COUNTS, torch.Generator().manual_seed(1))
    counts = torch.tensor(COUNTS)
    grouped = grouped_mm_supported(x, w)
    grouped_mm(x, w, ExpertGroups.of(counts, x.device, grouped)).float().sum().backward()
    empty = [e for e, n in enumerate(COUNTS) if n == 0]
    assert all(float(w.grad[e].abs().max()) == 0.0 for e in empty), [float(w.grad[e].abs().max()) for e in empty]
    assert all(float(w.grad[e].abs().max()) > 0 for e, n in enumerate(COUNTS) if n)
    capability = torch.cuda.get_device_capability()
    if capability >= (9, 0):  # torch has the kernel: what it does here, whatever the gate decided
        w.grad = None
        grouped_mm(x, w, ExpertGroups.of(counts, x.device, True)).float().sum().backward()
        worst = max(float(w.grad[e].abs().max()) for e in empty)
        logger.warning("torch._grouped_mm on compute capability %s: largest weight gradient of an expert without "
                       "tokens %.3g (the gate uses it: %s)", capability, worst, grouped)
        if grouped:
            assert worst == 0.0


def test_a_rank_without_tokens_takes_the_gradient_of_a_sum():
    """Zero rows on this rank, the output gradient of ``sum()`` (stride 0), on the path this GPU takes."""
    x = torch.zeros(0, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4, FFN, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    groups = ExpertGroups.of(torch.zeros(4, dtype=torch.int64), x.device, grouped_mm_supported(x, w))
    out = grouped_mm(x, w, groups)
    out.sum().backward()
    assert out.shape == (0, FFN) and float(w.grad.abs().max()) == 0.0
