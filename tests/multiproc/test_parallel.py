"""Multi-process tests on CPU (gloo): TP/PP logits against transformers, resharding, DP."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cooper_mcore.convert.hf import mcore_to_hf
from tests.conftest import ROOT, VARIANTS, _free_port, last_json, torchrun

pytestmark = pytest.mark.multiproc
LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2)]  # (processes, tp, pp)


@pytest.mark.parametrize("nproc,tp,pp", LAYOUTS, ids=lambda x: str(x))
def test_logits_equal_transformers(tiny_models, tmp_path, nproc, tp, pp):
    pairs = [["-".join(v), *tiny_models[v]] for v in VARIANTS]
    resave = tmp_path / "resaved"
    resave.mkdir()
    out = last_json(torchrun("logits.py", nproc, "--pairs", json.dumps(pairs), "--tp", str(tp),
                             "--pp", str(pp), "--resave-dir", str(resave),
                             "--together", "qwen2-causal_lm,qwen2-reward"))
    unmarked = {k: out.pop(k) for k in list(out) if k.startswith("unmarked:")}
    assert set(unmarked.values()) == {0}, unmarked  # TP shards carry megatron's TP attributes
    assert set(out) == {p[0] for p in pairs} | {"together:qwen2-causal_lm", "together:qwen2-reward"}
    for name, diff in out.items():
        assert diff < 2e-5, (name, diff)
    if tp * pp > 1:  # saved at this layout, loaded at TP=PP=1: the same tensors bit for bit
        for name, hf_dir, _ in pairs[:2] + pairs[-2:]:
            mcore_to_hf(str(resave / name), str(tmp_path / f"{name}-hf"), weights_only=True)
            a = load_file(f"{hf_dir}/model.safetensors")
            b = load_file(str(tmp_path / f"{name}-hf" / "model.safetensors"))
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name


def test_chunked_logprobs_are_exact_with_the_vocabulary_split_over_tp2():
    """TP=2, each rank holding half of the vocabulary: the chunked log-probabilities and entropy (in
    chunks of 4 positions and in one chunk) equal the whole vocabulary's in float64, and megatron's
    vocab-parallel cross entropy and the previous full fp32 entropy; each rank's gradient is its
    slice of the whole gradient. fp32 sums of 384 exponentials: 1e-5 on values of scale 6, 1e-6 of
    the largest gradient entry (see tests/unit/test_vocab_logprobs.py)."""
    out = last_json(torchrun("vocab_logprobs.py", 2, "--tp", "2"))
    for chunk in (4, 1024):
        for key in ("ref_logp", "ref_entropy", "prev_logp", "prev_entropy"):
            assert out[f"chunk{chunk}/{key}"] < 1e-5, (chunk, key, out)
        for key in ("ref_grad", "prev_grad"):
            assert out[f"chunk{chunk}/{key}"] < 1e-6 * out["grad_scale"], (chunk, key, out)


def test_compare_logits_tool_prints_last_line(tiny_models):
    hf_dir, ckpt = tiny_models[("qwen3", "causal_lm")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", str(ROOT / "tools" / "compare_logits.py"),
           "--hf-dir", hf_dir, "--ckpt", ckpt, "--tp", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("max_abs_logit_diff=")
    assert float(last.split("=")[1]) < 2e-5


def test_distributed_optimizer_dp2_equals_dp1(tiny_models, tmp_path):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    torchrun("dp_step.py", 1, "--ckpt", ckpt, "--out", str(tmp_path / "dp1.pt"))
    torchrun("dp_step.py", 2, "--ckpt", ckpt, "--out", str(tmp_path / "dp2.pt"))
    a, b = torch.load(tmp_path / "dp1.pt"), torch.load(tmp_path / "dp2.pt")
    torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-5, atol=1e-6)
    assert a["params"].keys() == b["params"].keys()
    # Adam's first step moves each weight by ~lr = 1e-2; DP changes only the fp32 reduction
    # order, which Adam's normalisation can amplify to ~1e-6 for near-zero gradients.
    for k in a["params"]:
        torch.testing.assert_close(a["params"][k], b["params"][k], rtol=0, atol=1e-5, msg=k)
        step = (a["params"][k] - a["initial"][k]).abs().max()
        assert step > 1e-3, f"{k} did not move ({step})"


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_policy_and_rm_gradients_at_tp2_equal_tp1(tiny_models, tmp_path, sp):
    """Full gradients of a GRPO update and of a pairwise RM update at TP=2 (with and without
    sequence parallelism) equal TP=1's. Under sequence parallelism the norms' gradients are summed
    over the TP group (each rank saw half the sequence) and the RM head's replicated gather splits
    its gradient; before the fix the RM backbone's gradients came out tp times too large."""
    _, policy = tiny_models[("qwen2", "causal_lm")]
    _, rm = tiny_models[("qwen2", "reward")]
    torchrun("sp_grads.py", 1, "--policy", policy, "--rm", rm, "--out", str(tmp_path / "tp1.pt"))
    torchrun("sp_grads.py", 2, "--policy", policy, "--rm", rm, "--tp", "2", *(["--sp"] if sp else []),
             "--out", str(tmp_path / "tp2.pt"))
    a, b = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    for part in ("policy", "rm"):
        assert a[part].keys() == b[part].keys() and len(a[part]) > 10
        scale = max(float(g.abs().max()) for g in a[part].values())
        for name in a[part]:  # fp32 sums in another order: 1e-5 of the largest gradient
            torch.testing.assert_close(b[part][name], a[part][name], atol=1e-5 * scale, rtol=1e-4, msg=(part, name))
        assert abs(a[f"{part}_loss"] - b[f"{part}_loss"]) < 1e-5
