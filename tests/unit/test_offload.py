"""Offload/onload of a DDP-wrapped tiny policy and its optimizer, and the reference-model swap (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cooper_mcore.train.offload import ModelOffloader, ReferenceSwap

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """Tiny qwen2 policies converted to megatron checkpoints: fp32 and bf16."""
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("offload")
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        save_tiny_hf_model(str(root / f"{name}-hf"), "qwen2", seed=3, dtype=dtype, num_hidden_layers=2)
        hf_to_mcore(str(root / f"{name}-hf"), str(root / name))
        out[name] = str(root / name)
    return out


def load(ckpt: str):
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.parallel import ParallelConfig

    return load_checkpoint_model(ckpt, ParallelConfig())


def setup(ckpt: str):
    """(ddp, optimizer, arch) of a freshly loaded policy."""
    from cooper_mcore.train.step import OptimConfig, wrap_for_training

    model, arch = load(ckpt)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-2, clip_grad=1.0))
    return ddp, opt, arch


def step(ddp, opt, vocab: int, seed: int) -> None:
    """One real optimizer step (two micro-batches) on random tokens."""
    from cooper_mcore.models.forward import position_ids_for
    from cooper_mcore.train.step import train_step

    tokens = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(seed))

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        ids, labels = batch[:, :-1], batch[:, 1:]
        logits = m(ids, position_ids_for(ids), None)
        return logits, lambda out: (F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), labels.reshape(-1)), {})

    train_step(ddp, opt, forward_step, iter(tokens.split(1)), num_microbatches=2, seq_length=12, micro_batch_size=1)


def live(ddp, opt) -> dict[str, torch.Tensor]:
    """Every tensor that offloading must preserve, by a readable name (no copies)."""
    out = {}
    for i, b in enumerate(ddp.buffers):
        out[f"param_data{i}"], out[f"grad_data{i}"] = b.param_data, b.grad_data
    for n, p in ddp.module.named_parameters():
        out[f"param:{n}"], out[f"main_grad:{n}"] = p, p.main_grad
    for j, sub in enumerate(opt.chained_optimizers):
        for gi, group in enumerate(sub.optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"main_param{j}.{gi}.{k}"] = p
                for key, v in sub.optimizer.state[p].items():
                    out[f"state{j}.{gi}.{k}.{key}"] = v
    return out


def in_param_buffer(ddp, t: torch.Tensor) -> bool:
    return t.untyped_storage()._cdata in {b.param_data.untyped_storage()._cdata for b in ddp.buffers}


def snapshot(ddp, opt) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in live(ddp, opt).items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad[:10]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    from cooper_mcore.models.forward import forward_only

    return forward_only(getattr(model, "module", model), ids)


def ids_for(arch) -> torch.Tensor:
    return torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offload_onload_cycles_bitwise_and_train_like_no_offload(world, ckpts, dtype):
    a_ddp, a_opt, arch = setup(ckpts[dtype])
    b_ddp, b_opt, _ = setup(ckpts[dtype])
    for ddp, opt in ((a_ddp, a_opt), (b_ddp, b_opt)):
        step(ddp, opt, arch.vocab_size, seed=1)
    before = snapshot(a_ddp, a_opt)
    assert any(k.endswith("exp_avg_sq") for k in before), "Adam states were not created"
    assert all(before[f"grad_data{i}"].abs().sum() > 0 for i in range(len(a_ddp.buffers)))
    assert_equal(before, snapshot(b_ddp, b_opt))  # the two setups are identical so far
    # fp32 main params are views into DDP's param buffer; those of bf16 params are separate tensors.
    separate = [not in_param_buffer(a_ddp, v) for k, v in live(a_ddp, a_opt).items() if k.startswith("main_param")]
    assert any(separate) == (dtype == "bf16")

    # What must move: each distinct storage once, counted independently of the offloader.
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in live(a_ddp, a_opt).values()}
    expected_bytes = sum(storages.values())

    off = ModelOffloader(a_ddp, a_opt)
    for _ in range(3):
        stats = off.offload()
        assert stats.bytes == expected_bytes and stats.seconds >= 0
        assert off.offloaded == {"params", "grads", "optimizer"}
        held = {k: v.untyped_storage().nbytes() for k, v in live(a_ddp, a_opt).items()}
        assert set(held.values()) == {0}, [k for k, n in held.items() if n][:10]
        assert all(off.device_bytes(c) == 0 for c in ("params", "grads", "optimizer"))
        assert off.onload().bytes == expected_bytes
        assert off.offloaded == frozenset()
        assert_equal(before, snapshot(a_ddp, a_opt))

    for ddp, opt in ((a_ddp, a_opt), (b_ddp, b_opt)):
        step(ddp, opt, arch.vocab_size, seed=2)
    after = snapshot(a_ddp, a_opt)
    assert_equal(after, snapshot(b_ddp, b_opt))
    assert not torch.equal(after["param_data0"], before["param_data0"])  # the second step moved weights


def test_partial_offload_and_state_errors(world, ckpts):
    ddp, opt, arch = setup(ckpts["bf16"])
    step(ddp, opt, arch.vocab_size, seed=1)
    before = snapshot(ddp, opt)
    names = live(ddp, opt)
    main = [k for k in names if k.startswith("main_param") and not in_param_buffer(ddp, names[k])]
    assert main  # the fp32 copies of the bf16 weights
    ids = ids_for(arch)
    ref_logits = logits(ddp, ids)

    off = ModelOffloader(ddp, opt)
    opt_bytes = off.device_bytes("optimizer")
    assert opt_bytes > 0
    # Optimizer only: bf16 main params and Adam states leave, the model still runs.
    assert off.offload(params=False, grads=False).bytes == opt_bytes
    assert all(names[k].untyped_storage().nbytes() == 0 for k in main)
    assert all(b.param_data.untyped_storage().nbytes() > 0 for b in ddp.buffers)
    assert torch.equal(logits(ddp, ids), ref_logits)
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    assert off.offloaded == {"optimizer"}  # a refused call moves nothing
    with pytest.raises(RuntimeError, match="not offloaded"):
        off.onload()
    off.offload(optimizer=False)
    assert off.device_bytes("params") == off.device_bytes("grads") == 0
    off.onload(optimizer=False)
    off.onload(params=False, grads=False)
    assert_equal(before, snapshot(ddp, opt))
    with pytest.raises(RuntimeError, match="not offloaded"):
        off.onload(grads=False, optimizer=False)


def test_discard_grads_frees_without_copy_and_zeroes(world, ckpts):
    ddp, opt, arch = setup(ckpts["fp32"])
    step(ddp, opt, arch.vocab_size, seed=1)
    before = snapshot(ddp, opt)
    grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in ddp.buffers)
    off = ModelOffloader(ddp, opt, discard_grads=True)
    total = sum(off.device_bytes(c) for c in ("params", "grads", "optimizer"))
    assert off.offload().bytes == total - grad_bytes
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in ddp.buffers)
    assert off.onload().bytes == total - grad_bytes
    after = snapshot(ddp, opt)
    grads = [k for k in after if k.startswith(("grad_data", "main_grad"))]
    assert grads and all(not after[k].any() for k in grads)
    rest = [k for k in after if k not in grads]
    assert_equal({k: before[k] for k in rest}, {k: after[k] for k in rest})


def test_reference_swap(world, ckpts):
    from cooper_mcore.train.step import OptimConfig, wrap_for_training

    model, arch = load(ckpts["bf16"])
    # Built from the bare model before DDP moves its params into the contiguous buffer (as the
    # trainer does), and from a DDP-wrapped policy with weights given by name.
    ref = ReferenceSwap(model)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-2))
    ref_from_state = ReferenceSwap(ddp, reference=load(ckpts["bf16"])[0].state_dict())
    step(ddp, opt, arch.vocab_size, seed=1)
    ids = ids_for(arch)
    policy = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    policy_logits = logits(ddp, ids)
    reference_logits = logits(load(ckpts["bf16"])[0], ids)  # a separately loaded reference
    assert not torch.equal(policy_logits, reference_logits)
    buffers = [b.param_data.clone() for b in ddp.buffers]

    for swap in (ref, ref_from_state):
        with swap.swapped():
            assert swap.active
            assert torch.equal(logits(ddp, ids), reference_logits)
            # Written into DDP's contiguous buffer, not rebound: params are still views into it.
            assert all(in_param_buffer(ddp, p) for p in ddp.module.parameters())
            assert not torch.equal(ddp.buffers[0].param_data, buffers[0])
            with pytest.raises(RuntimeError, match="already swapped"):
                with swap.swapped():
                    pass
        assert not swap.active and swap.last_stats.bytes == 3 * swap.nbytes
        assert all(torch.equal(p, policy[n]) for n, p in ddp.module.named_parameters())
        assert torch.equal(logits(ddp, ids), policy_logits)

    with pytest.raises(ValueError, match="boom"):
        with ref.swapped():
            assert torch.equal(logits(ddp, ids), reference_logits)
            raise ValueError("boom")
    assert not ref.active
    assert all(torch.equal(p, policy[n]) for n, p in ddp.module.named_parameters())
    assert all(torch.equal(b.param_data, c) for b, c in zip(ddp.buffers, buffers))
    off = ModelOffloader(ddp, opt)
    off.offload(grads=False, optimizer=False)
    with pytest.raises(RuntimeError, match="offloaded"):
        with ref.swapped():
            pass
    off.onload(grads=False, optimizer=False)
    assert torch.equal(logits(ddp, ids), policy_logits)


def test_reference_swap_rejects_mismatched_weights(world, ckpts):
    model, _ = load(ckpts["fp32"])
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    name = next(iter(state))
    with pytest.raises(KeyError, match="lacks"):
        ReferenceSwap(model, reference={k: v for k, v in state.items() if k != name})
    with pytest.raises(ValueError, match="shape"):
        ReferenceSwap(model, reference={**state, name: state[name][:1]})
    ref = ReferenceSwap(model, reference={k: v.double() for k, v in state.items()})  # cast to the param dtype
    assert all(t.dtype == state[n].dtype for n, t in ref.reference_state().items())


def test_plain_module_and_torch_optimizer_and_free_host_copies():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    tensors = {n: p for n, p in model.named_parameters()}
    tensors |= {f"grad:{n}": p.grad for n, p in model.named_parameters()}
    tensors |= {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    assert len(tensors) == 4 * 5  # param, grad, step, exp_avg, exp_avg_sq
    before = {k: v.detach().clone() for k, v in tensors.items()}
    total = sum(v.untyped_storage().nbytes() for v in tensors.values())

    off = ModelOffloader(model, opt)
    for _ in range(2):
        assert off.offload(grads=False).bytes == total
        assert all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
        assert off.free_host_copies() == 0  # nothing on the device has a host copy to drop
        assert off.onload(grads=False).bytes == total
        assert_equal(before, {k: v.detach().clone() for k, v in tensors.items()})
        assert off.free_host_copies() == total
