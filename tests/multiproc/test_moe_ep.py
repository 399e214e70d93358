"""Expert parallelism in training: a GRPO update of a converted tiny Qwen3-MoE policy and a pairwise
update of a tiny Qwen3-MoE reward model at EP=2 equal EP=1, on 2 gloo ranks (data parallelism 2 in
both layouts, the same rows on each data-parallel rank).

What EP changes is where expert gradients are summed (the alltoall's backward brings every token's
contribution to the expert's owner; megatron's DDP reduces ``allreduce=False`` params over
``expt_dp``, size 1 at EP=2, instead of over the 2 data-parallel replicas) and how the gradient norm
counts experts (the expert optimizer's model-parallel group is ``tp_ep_pp``). A wrong group or a
double count changes the gradient norm and the RM's gradients by a factor ~2; fp32 sums in another
order differ by ulps: losses and norms at 1e-5 relative, gradients at 1e-5 of the largest
(as tests/multiproc/test_parallel.py). The policy's updated weights: Adam's first step moves each
weight by ``lr * g / (|g| + eps)``, about ``lr * sign(g)`` = 1e-3, which ulp noise in ``g`` changes only
where ``|g|`` is within a few orders of Adam's eps (1e-8): there it moved a handful of weights by up to
6e-6 in the run that set this bound. They are compared at 1e-5 absolute (1% of lr, as the dense
DP test in test_parallel.py) and must have moved; Adam's step is blind to a gradient's scale, which
the gradient norm and the RM's gradients check.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import torchrun


def _run(ckpts: tuple[str, str], ep: int, out) -> list[dict]:
    torchrun("ep_step.py", 2, "--policy", ckpts[0], "--rm", ckpts[1], "--ep", str(ep), "--out", str(out))
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _merged(ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """One dict of global names over the ranks; a name on both ranks (replicated) must agree."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, t in r[key].items():
            if name in out:
                torch.testing.assert_close(t, out[name], rtol=0, atol=0, msg=(key, name, "replicas differ"))
            out[name] = t
    return out


def test_policy_and_rm_steps_at_ep2_equal_ep1(moe_ckpts, tmp_path):
    ep1, ep2 = _run(moe_ckpts, 1, tmp_path / "ep1"), _run(moe_ckpts, 2, tmp_path / "ep2")
    assert [r["ep"] for r in ep1 + ep2] == [1, 1, 2, 2]
    for a, b in zip(ep1, ep2):  # per data-parallel rank
        for key in ("policy_loss", "policy_grad_norm", "policy_aux", "rm_loss", "rm_grad_norm", "rm_aux"):
            assert a[key] is not None and b[key] == pytest.approx(a[key], rel=1e-5), key
        assert a["policy_aux"] > 0 and a["rm_aux"] > 0
    for r in ep1 + ep2:  # expert weights have their own DDP buffers only under EP; offload moves them too
        assert bool(r["expert_buffers"]) == (r["ep"] > 1) and r["round_trip_equal"]
        assert r["param_bytes"] >= r["model_bytes"] and r["offloaded_bytes"] == 0
    p1, p2 = _merged(ep1, "policy_params"), _merged(ep2, "policy_params")
    assert p1.keys() == p2.keys() and sum("local_experts" in k for k in p1) == 3 * 8 * 2
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=0, atol=1e-5, msg=name)
    initial = _merged(ep1, "policy_initial")
    moved = [float((p1[k] - initial[k]).abs().max()) for k in p1 if "local_experts" in k]
    assert sum(m > 1e-4 for m in moved) > len(moved) // 2  # most experts were routed to and updated
    g1, g2 = _merged(ep1, "rm_grads"), _merged(ep2, "rm_grads")
    assert g1.keys() == g2.keys()
    scale = max(float(g.abs().max()) for g in g1.values())
    expert_grads = [float(g1[k].abs().max()) for k in g1 if "local_experts" in k]
    assert max(expert_grads) > 1e-3 * scale  # the experts do get gradient
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
