"""Grouped expert matrix multiplies (:mod:`cooper_mcore.models.experts`) against megatron's SequentialMLP.

The same tiny Qwen3-MoE (all layers sparse, 8 experts, top 2) is built twice from one HF checkpoint,
with :class:`GroupedExperts` and with ``SequentialMLP``: logits, the loss's gradients per expert and
the checkpoints must agree. fp32 on CPU: ``torch._grouped_mm`` on CPU and the per-expert fallback run
one matmul per expert, the very products ``SequentialMLP``'s linears compute, so the outputs agree to
the last bit or to a few ulps where a kernel picks another summation order (1e-6 on values of size
~1; a wrong expert or a missed probability scale is off by ~1e-1).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from cooper_mcore.checkpoint.model import load_model_checkpoint, save_model_checkpoint
from cooper_mcore.convert.hf import load_hf_weights, mapped_state
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.experts import GroupedExperts, grouped_mm, grouped_mm_supported
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


@pytest.mark.parametrize("use_grouped", [True, False], ids=["torch_grouped_mm", "per_expert"])
def test_grouped_mm_is_each_groups_matmul(use_grouped):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7, 1, 0, 3])  # empty groups included
    x = torch.randn(int(counts.sum()), 16, generator=g, requires_grad=True)
    w = torch.randn(6, 8, 16, generator=g, requires_grad=True)
    out = grouped_mm(x, w, counts, use_grouped=use_grouped)
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
    counts = torch.tensor([1, 2])
    x = torch.randn(3, 6)
    torch.testing.assert_close(grouped_mm(x, w, counts), torch.cat([x[:1] @ w[0].t(), x[1:] @ w[1].t()]), rtol=0,
                               atol=0)


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
