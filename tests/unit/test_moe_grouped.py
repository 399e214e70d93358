"""Grouped expert matrix multiplies (:mod:`cooper_mcore.models.experts`) against megatron's SequentialMLP.

The same tiny Qwen3-MoE (all layers sparse, 8 experts, top 2) is built twice from one HF checkpoint,
with :class:`GroupedExperts` and with ``SequentialMLP``: logits, the loss's gradients per expert and
the checkpoints must agree. fp32 on CPU: ``torch._grouped_mm`` on CPU and the per-expert fallback run
one matmul per expert, the very products ``SequentialMLP``'s linears compute, so the outputs agree to
the last bit or to a few ulps where a kernel picks another summation order (1e-6 on values of size
~1; a wrong expert or a missed probability scale is off by ~1e-1).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from cooper_mcore.checkpoint.model import load_model_checkpoint, save_model_checkpoint
from cooper_mcore.convert.hf import load_hf_weights, mapped_state
from cooper_mcore.models import experts
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.experts import ExpertGroups, GroupedExperts, grouped_mm, grouped_mm_supported
from cooper_mcore.models.forward import position_ids_for
from cooper_mcore.models.tiny import save_tiny_hf_model
from cooper_mcore.parallel import ParallelConfig, single_process_world

TOL = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(autouse=True)
def _aux_loss_scale():
    """A backward outside megatron's schedule leaves megatron's process-wide aux-loss scale a 0-d
    tensor, which the next schedule's ``set_loss_scale`` (a 1-element one) cannot copy into."""
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("moe") / "hf"), "qwen3_moe", seed=3, mlp_only_layers=[],
                              router_aux_loss_coef=0.01)


def _model(hf: str, grouped: bool):
    arch = ArchSpec.from_hf_config(load_hf_config(hf))
    model = build_model(arch, ParallelConfig(), init_weights=False, use_te=False, grouped_experts=grouped)
    load_hf_weights(model, hf, arch)
    return model, arch


def _groups(counts: torch.Tensor, grouped: bool, device: str = "cpu") -> ExpertGroups:
    return ExpertGroups.of(counts, torch.device(device), grouped)


@pytest.mark.parametrize("use_grouped", [True, False], ids=["torch_grouped_mm", "per_expert"])
def test_grouped_mm_is_each_groups_matmul(use_grouped):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7, 1, 0, 3])  # empty groups included
    x = torch.randn(int(counts.sum()), 16, generator=g, requires_grad=True)
    w = torch.randn(6, 8, 16, generator=g, requires_grad=True)
    out = grouped_mm(x, w, _groups(counts, use_grouped))
    ref = torch.cat([a @ b.t() for a, b in zip(torch.split(x, counts.tolist()), w)])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()  # a broadcast gradient: the grouped backward needs real strides
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref.sum().backward()
    torch.testing.assert_close(gx, x.grad, **TOL)
    torch.testing.assert_close(gw, w.grad, **TOL)
    assert float(gw[1].abs().max()) == 0.0  # an expert without tokens gets a zero gradient


def test_grouped_mm_falls_back_where_torch_cannot():
    w = torch.randn(2, 8, 6)  # rows of 6 fp32 = 24 bytes, not a multiple of 16
    assert not grouped_mm_supported(torch.randn(3, 6), w)
    assert grouped_mm_supported(torch.randn(3, 8), torch.randn(2, 4, 8))
    assert not grouped_mm_supported(torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(2, 4, 8))
    x = torch.randn(3, 6)
    out = grouped_mm(x, w, _groups(torch.tensor([1, 2]), grouped_mm_supported(x, w)))
    torch.testing.assert_close(out, torch.cat([x[:1] @ w[0].t(), x[1:] @ w[1].t()]), rtol=0, atol=0)


@pytest.mark.parametrize("capability,grouped,says", [((9, 0), True, None), ((9, 2), True, None),
                                                     ((10, 0), False, "pytorch#172439"),
                                                     ((10, 3), False, "pytorch#172439"),
                                                     ((12, 0), False, "for 9.x and 10.x only"),
                                                     ((8, 0), False, "for 9.x and 10.x only")])
def test_the_cuda_grouped_kernel_only_where_it_is_known_correct(monkeypatch, caplog, capability, grouped, says):
    """Hopper takes ``torch._grouped_mm``; Blackwell (its kernel gives experts without tokens non-zero
    weight gradients) and GPUs without torch's fast kernel take one matmul per expert, said once."""
    experts._per_expert_notice.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0), element_size=lambda: 2)
    w = torch.empty(4, 64, 32, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=experts.__name__):
        assert [grouped_mm_supported(x, w) for _ in range(3)] == [grouped] * 3
    notes = [r.getMessage() for r in caplog.records]
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and says in notes[0] and f"compute capability {capability[0]}." in notes[0], notes
    experts._per_expert_notice.cache_clear()


def test_the_grouped_path_reads_no_count_on_the_host():
    """The grouped path never reads a count's value on the host (each read would wait for the GPU): on
    the ``meta`` device, which holds no values and runs the CUDA kernel's checks (bf16, strides), a
    whole experts forward and backward runs, with the offsets made on the counts' device."""
    counts = torch.tensor([5, 0, 7, 4], device="meta")
    x = torch.empty(16, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(4, 64, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    groups = _groups(counts, True, "meta")
    assert groups.offsets.device.type == "meta" and groups.offsets.dtype == torch.int32 and groups.sizes is None
    grouped_mm(x, w, groups).sum().backward()
    assert w.grad.shape == w.shape and x.grad.shape == x.shape
    with pytest.raises((RuntimeError, NotImplementedError)):
        counts.tolist()  # what the per-expert path would do


def test_host_counts_reach_the_device_once_per_layer(hf_dir, monkeypatch):
    """megatron's dispatcher hands the counts on the host: the offsets are made once per layer for
    both linears (one copy, queued without waiting: ``to_device_async``), not once per linear."""
    calls = []
    real = experts.ExpertGroups.of

    def of(counts, device, grouped):
        calls.append((counts.device.type, grouped))
        return real(counts, device, grouped)

    monkeypatch.setattr(experts.ExpertGroups, "of", staticmethod(of))
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    with single_process_world():
        model, arch = _model(hf_dir, grouped=True)
        model(ids, position_ids_for(ids), None).sum().backward()
    assert calls == [("cpu", True)] * arch.num_layers


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("meta", torch.bfloat16)], ids=["cpu", "meta"])
def test_a_rank_without_tokens_takes_an_expanded_gradient(device, dtype):
    """A rank that received no tokens, with the output gradient of a sum (stride 0): torch calls an
    empty tensor contiguous whatever its strides, and ``_grouped_mm`` refused it ("Invalid
    strides/sizes"); the gradient is given real strides, the experts' weight gradients are zero."""
    x = torch.zeros(0, 32, dtype=dtype, device=device, requires_grad=True)
    w = torch.ones(4, 64, 32, dtype=dtype, device=device, requires_grad=True)
    broadcast = torch.ones(1, 32, dtype=dtype, device=device).expand(0, 32)  # an empty input as a view
    for rows in (x, broadcast.requires_grad_()):
        w.grad = None
        out = grouped_mm(rows, w, _groups(torch.zeros(4, dtype=torch.int64, device=device), True, device))
        hidden = grouped_mm(out, w.transpose(1, 2), _groups(torch.zeros(4, dtype=torch.int64, device=device),
                                                            True, device))
        hidden.sum().backward()
        assert out.shape == (0, 64) and w.grad.shape == w.shape
        if device == "cpu":
            assert float(w.grad.abs().max()) == 0.0


def test_grouped_experts_equal_sequential_mlp(hf_dir):
    """Logits, and every parameter's gradient (per expert) after a backward through the whole model."""
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    out = {}
    with single_process_world():
        for grouped in (True, False):
            model, _ = _model(hf_dir, grouped)
            experts = model.decoder.layers[0].mlp.experts
            assert isinstance(experts, GroupedExperts) == grouped
            model.train()
            logits = model(ids, position_ids_for(ids), None)
            (logits.float().pow(2).mean()).backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            out[grouped] = (logits.detach(), mapped_state_of_grads(model, grads))
    torch.testing.assert_close(out[True][0], out[False][0], **TOL)
    g_grouped, g_seq = out[True][1], out[False][1]
    assert g_grouped.keys() == g_seq.keys() and sum("local_experts" in k for k in g_seq) == 4 * 8 * 2
    for name in g_seq:
        torch.testing.assert_close(g_grouped[name], g_seq[name], **TOL, msg=name)
    assert all(float(g_seq[k].abs().max()) > 0 for k in g_seq if "local_experts" in k)  # every expert was routed to


def mapped_state_of_grads(model, grads) -> dict[str, torch.Tensor]:
    """``{mapping name: gradient}``: stacked expert gradients split per expert, as the weights are."""
    from cooper_mcore.models.hf_mapping import mapping_tensors

    return {name: t.clone() for n, g in grads.items() for name, t in mapping_tensors(n, g)}


@pytest.mark.parametrize("save_grouped", [True, False], ids=["grouped_to_sequential", "sequential_to_grouped"])
def test_checkpoints_move_between_grouped_and_sequential(hf_dir, tmp_path, save_grouped):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt = str(ckpt)
    with single_process_world():
        model, arch = _model(hf_dir, save_grouped)
        save_model_checkpoint(model, ckpt, arch, {}, torch.float32)
        other = build_model(arch, ParallelConfig(), init_weights=True, use_te=False, grouped_experts=not save_grouped)
        load_model_checkpoint(other, ckpt, arch)
        a, b = mapped_state(model), mapped_state(other)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
