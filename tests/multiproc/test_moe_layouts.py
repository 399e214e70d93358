"""Every accepted mixture-of-experts layout trains as one process does, and keeps its replicas equal.

A GRPO update of a tiny Qwen3-MoE policy and a pairwise update of a tiny Qwen3-MoE reward model
(``workers/ep_step.py``) at TP=2 with sequence parallelism, where the expert tensor-parallel size
follows TP (each expert split over the two TP ranks, megatron's default), and at TP=2 x EP=2 with ETP=1
(an expert's copy on each of two data-parallel replicas), against the same step on one process (resp.
two data-parallel ranks at TP=1), the same rows on each data-parallel rank.

Before the expert TP size followed TP, ``parallel.tp=2`` at ep=1 gave ETP=1: each TP rank kept a
full copy of every expert, computed from its half of the sequence, and megatron reduces expert
gradients over the data-parallel group only at ep=1, so after one step every expert differed between
the two ranks; that layout is now refused (tests/unit/test_config_validate.py, ``wrap_for_training``).

Tolerances: fp32 sums in another order (TP all-reduces, sequence slices, the all-to-all) change losses
and gradient norms by ulps (compared at 1e-5 relative, as tests/multiproc/test_moe_ep.py). Adam's first
step moves each weight by about ``lr * sign(g)`` = 1e-3, so the updated weights show a gradient's sign,
not its scale (the norms check that); where ``|g|`` is within a few orders of Adam's eps (1e-8) ulp
noise in ``g`` moves a weight by a fraction of lr (1.1e-5 seen at TP=2): compared at 1e-4, a tenth of
lr, which a wrong or missing gradient exceeds. Replicas are compared bitwise: megatron hands every
replica the same reduced gradient (the drift this guards against was ~1e-3 in every expert).
"""

from __future__ import annotations

import json

import pytest
import torch

from cooper_mcore.convert.hf import stream_checkpoint_tensors
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.parallel import single_process_world
from tests.conftest import torchrun

pytestmark = pytest.mark.multiproc

METRICS = ("policy_loss", "policy_grad_norm", "policy_aux", "rm_loss", "rm_grad_norm", "rm_aux")


def _run(ckpts: tuple[str, str], nproc: int, out, *layout: str) -> list[dict]:
    torchrun("ep_step.py", nproc, "--policy", ckpts[0], "--rm", ckpts[1], "--out", str(out), *layout)
    return [torch.load(f"{out}.{r}") for r in range(nproc)]


def _assert_replicas_equal(ranks: list[dict]) -> None:
    """A tensor (or shard) held by several ranks is the same on all of them, experts included."""
    for key in ("policy_params", "rm_params", "rm_grads"):
        seen: dict[str, torch.Tensor] = {}
        for r in ranks:
            for name, t in r[key].items():
                if name in seen:
                    assert torch.equal(t, seen[name]), (key, name, "replicas differ")
                seen[name] = t


def _assert_same_step(got: list[dict], ref: list[dict]) -> None:
    """Per data-parallel rank: the metrics; per replica: the whole updated models (HF names)."""
    by_dp = {r["dp_rank"]: r for r in ref}
    for r in got:
        want = by_dp[r["dp_rank"]]
        for key in METRICS:
            assert r[key] is not None and r[key] == pytest.approx(want[key], rel=1e-5), key
        for model in ("policy_full", "rm_full"):
            if not r[model]:  # not a replica's first rank
                continue
            assert r[model].keys() == want[model].keys()
            for name, t in r[model].items():
                torch.testing.assert_close(t, want[model][name], rtol=0, atol=1e-4, msg=f"{model} {name}")
    assert sum(bool(r["policy_full"]) for r in got) == len(ref)  # every replica's first rank compared


def test_tp2_with_sequence_parallel_trains_as_one_process(moe_ckpts, tmp_path):
    ref = _run(moe_ckpts, 1, tmp_path / "ref")
    tp2 = _run(moe_ckpts, 2, tmp_path / "tp2", "--tp", "2", "--save", str(tmp_path / "tp2-ckpt"))
    experts = [k for k in tp2[0]["policy_params"] if "local_experts" in k]
    assert experts and all("#shard" in k for k in experts)  # etp followed tp: each expert split over the TP ranks
    assert any(k in tp2[1]["policy_params"] for k in tp2[0]["policy_params"] if "router" in k)  # replicated router
    _assert_replicas_equal(tp2)
    _assert_same_step(tp2, ref)
    # the checkpoint saved at ETP=2 (each expert's [gate; up] halves written as two row blocks) is the
    # model the weight push sent, bit for bit
    with single_process_world():
        arch = ArchSpec.from_dict(json.loads((tmp_path / "tp2-ckpt" / "cooper_model.json").read_text())["arch"])
        saved = dict(stream_checkpoint_tensors(str(tmp_path / "tp2-ckpt"), arch))
    assert saved.keys() == tp2[0]["policy_full"].keys()
    for name, t in saved.items():
        assert torch.equal(t, tp2[0]["policy_full"][name]), name


def test_tp2_ep2_etp1_trains_as_two_data_parallel_ranks(moe_ckpts, tmp_path):
    ref = _run(moe_ckpts, 2, tmp_path / "ref")
    run = _run(moe_ckpts, 4, tmp_path / "tp2ep2", "--tp", "2", "--ep", "2", "--etp", "1")
    shared = {k for k in run[0]["policy_params"] if "local_experts" in k} & \
        {k for r in run[1:] for k in r["policy_params"] if "local_experts" in k}
    assert shared  # some expert is held whole by two ranks, which must agree
    _assert_replicas_equal(run)
    _assert_same_step(run, ref)
