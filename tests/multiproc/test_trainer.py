"""The Cooper trainer end to end on CPU: exact resume, first-step invariants, checkpoints."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from cooper_mcore.demo.assets import build_tiny_assets

    root = tmp_path_factory.mktemp("assets")
    paths = build_tiny_assets(str(root), n_train=64, n_eval=8)
    # Single-digit answers: the untrained policy's last number sometimes matches, so there are
    # rule-correct rollouts, valid RM pairs and a moving reward model.
    rows = [{"id": f"q{i}", "question": f"{i % 10}+0=", "answer": str(i % 10)} for i in range(64)]
    with open(paths["train"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    _sft(paths["policy_hf"], rows, steps=60)  # right some of the time: valid pairs, a moving RM
    from cooper_mcore.convert.hf import hf_to_mcore

    paths["policy_ckpt"] = str(root / "policy_sft_mcore")
    hf_to_mcore(paths["policy_hf"], paths["policy_ckpt"])
    return paths


def _sft(hf_dir, rows, steps):
    """A few steps of plain transformers SFT on question -> answer<eos> (test set-up only)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    seqs = [(tok(r["question"], add_special_tokens=False)["input_ids"],
             tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for r in rows]
    width = max(len(q) + len(a) for q, a in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    for i, (q, a) in enumerate(seqs):
        ids[i, :len(q) + len(a)] = torch.tensor(q + a)
        labels[i, len(q):len(q) + len(a)] = torch.tensor(a)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(hf_dir)


def _train_args(assets, out, *overrides):
    return ["--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out", str(out),
            f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"model.rm_ckpt={assets['rm_ckpt']}", f"data.train_path={assets['train']}",
            f"data.eval_path={assets['eval']}", "eval.every=0", "logging.wandb=false",
            "rollout.max_new_tokens=8", "rollout.group_size=4", "train.prompts_per_step=4",
            "train.micro_batch_size=4", *overrides]


def _train(assets, out, *overrides, nproc=1):
    args = _train_args(assets, out, *overrides)
    if nproc == 1:
        cmd = [sys.executable, "-m", "cooper_mcore", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", "cooper_mcore",
               "train", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    from cooper_mcore.metric_names import SCHEMA

    unknown = sorted({k for m in lines for k in m} - set(SCHEMA))
    assert not unknown, f"keys missing from cooper_mcore/metric_names.py: {unknown}"  # docs/metrics.md lists them all
    return lines


def _tensors(ckpt):
    from megatron.core.dist_checkpointing import load_plain_tensors

    from cooper_mcore.parallel import single_process_world

    with single_process_world():
        return {k: v for k, v in load_plain_tensors(str(ckpt)).items() if isinstance(v, torch.Tensor)}


def test_resume_is_bitwise_identical(assets, tmp_path):
    full = _train(assets, tmp_path / "full", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=3")
    _train(assets, tmp_path / "cut", "train.steps=2", "checkpoint.every=2")
    resumed = _train(assets, tmp_path / "cut", "train.steps=4", "checkpoint.every=2", "checkpoint.resume=auto")
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    assert [m["step"] for m in resumed][-2:] == [3, 4]
    # the run learned something: the policy moved and the RM saw valid pairs
    assert any(m["grad_norm"] > 0 for m in full) and sum(m["pairs/valid"] for m in full) > 0
    for part in ("policy", "rm"):
        a = _tensors(tmp_path / "full" / "checkpoints" / "step_4" / part)
        b = _tensors(tmp_path / "cut" / "checkpoints" / "step_4" / part)
        assert a.keys() == b.keys() and len(a) > 10
        for k in a:
            assert torch.equal(a[k], b[k]), (part, k)
        init = _tensors(tmp_path / "full" / "checkpoints" / "step_2" / part)
        assert any(not torch.equal(a[k], init[k]) for k in a), f"{part} did not change"
    for key in ("reward/mean", "rule/acc", "loss", "kl"):
        assert full[3][key] == resumed[-1][key], key
    # a trainer checkpoint exports to HF (with its tokenizer) and evaluates with `cooper eval`
    r = subprocess.run([sys.executable, "-m", "cooper_mcore", "eval", "--model",
                        str(tmp_path / "full" / "checkpoints" / "step_4" / "policy"), "--data", assets["train"],
                        "--k", "2", "--max-new-tokens", "4", "--limit", "8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["samples"] == 16 and 0.0 < result["acc"] <= 1.0


def test_first_step_invariants_and_run_files(assets, tmp_path):
    """Step 1 from the policy's weights: ratio 1, no KL, no clip; the fp32 transformers engine agrees
    with Megatron's log-probabilities to fp32 rounding (the weights were pushed), so the truncated
    importance weights are 1 and none is capped."""
    m = _train(assets, tmp_path / "run", "train.steps=1", "reward.mode=static_rm", "algo.tis_cap=2.0")
    first = m[0]
    assert first["ratio/mean"] == 1.0 and first["kl"] == 0.0 and first["clip_frac"] == 0.0
    assert first["rollout/logprob_diff_mean"] < 1e-4 and first["rollout/logprob_diff_max"] < 1e-3
    assert 0.0 <= first["rollout/logprob_kl"] < 1e-6
    assert first["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4) and first["rollout/tis_capped_frac"] == 0.0
    for key in ("step", "reward/mean", "rule/acc", "time/rollout", "time/policy_update", "time/weight_sync"):
        assert key in first, key
    assert 0.0 < first["reward/mean"] < 1.0  # sigmoid of the RM
    assert (tmp_path / "run" / "config.yaml").exists()


def test_an_engine_without_the_policys_weights_stops_the_first_step(assets, tmp_path):
    """The engine started from other weights (the policy's HF folder with its weights drawn again)
    and the weight push left out: the first step stops with one line naming the likely cause (exit
    code 2), before any update or metrics line."""
    import shutil

    import transformers

    other = tmp_path / "other-hf"
    shutil.copytree(assets["policy_hf"], other)
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    torch.manual_seed(3)
    for p in model.parameters():
        p.data.normal_(0.0, 0.1)
    model.save_pretrained(other)
    skip_push = ("import sys; import cooper_mcore.rl.colocate as c; c.sync_weights = lambda *a, **k: None; "
                 "from cooper_mcore.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", skip_push, "train",
                        *_train_args(assets, tmp_path / "run", "train.steps=2", f"model.policy_hf={other}")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "step 1: the rollout engine's log-probabilities differ from the trainer's" in errors[0]
    assert "the engine's weights are not the policy's" in errors[0] and "Traceback" not in r.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


def test_bad_config_fails_before_work(assets, tmp_path):
    r = subprocess.run([sys.executable, "-m", "cooper_mcore", "train", "--out", str(tmp_path / "x"),
                        f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
                        f"data.train_path={assets['train']}", "reward.mode=rule", "train.prompts_per_step=3",
                        "rollout.group_size=4", "train.micro_batch_size=8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "not divisible by micro_batch_size" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_tp_pp_runs_match_one_process(assets, tmp_path, layout):
    """TP=2 and PP=2 compute the step that one process computes.

    What the layout must not change is the first step, run on the same weights with the same
    rollouts: its losses, KL, entropy, rewards and gradient norm, which differ only by fp32
    reduction order (~1e-7 relative here; tolerances 1e-5 absolute on O(0.1) values, 1e-4 relative
    on the norm). Later steps are not compared: Adam's first update moves every weight by about
    ``lr * sign(grad)``, so a near-zero gradient whose sign the reduction order flips moves a weight
    by 2 lr in one layout and not the other, and sampled rollouts then diverge.
    """
    common = ("train.steps=1", "checkpoint.every=1", "eval.every=1", "eval.k=1", "data.eval_limit=4")
    one = _train(assets, tmp_path / "one", *common)
    two = _train(assets, tmp_path / "two", *common, layout, nproc=2)
    assert (tmp_path / "two" / "checkpoints" / "step_1" / "trainer.json").exists()
    (a,), (b,) = one, two
    assert a["rule/acc"] == b["rule/acc"] and a["response/length"] == b["response/length"]  # same rollouts
    assert a["pairs/valid"] == b["pairs/valid"]
    for key in ("reward/mean", "loss", "kl", "entropy", "rm/loss", "rm/pair_acc"):
        assert a[key] == pytest.approx(b[key], abs=1e-5), (layout, key)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), layout
    assert 0.0 <= b["eval/acc"] <= 1.0
    # the engine (on the group leader) against the trainer at this layout: fp32 rounding apart
    assert a["rollout/logprob_diff_mean"] < 1e-4 and b["rollout/logprob_diff_mean"] < 1e-4


def test_packed_token_budget_matches_fixed_micro_batches_at_dp2(assets, tmp_path):
    """Two data-parallel ranks, each binning its own rows by a token budget and packing them, run as
    many micro-batches as the rank with the most; step 1 (same rollouts, same weights) computes the
    same losses and gradient norm as fixed micro-batches."""
    common = ("train.steps=1", "train.prompts_per_step=4")
    fixed = _train(assets, tmp_path / "fixed", *common, nproc=2)
    packed = _train(assets, tmp_path / "packed", *common, "train.max_tokens_per_micro_batch=48",
                    "train.pack_sequences=true", nproc=2)
    (a,), (b,) = fixed, packed
    assert a["rule/acc"] == b["rule/acc"] and a["pairs/valid"] == b["pairs/valid"]
    for key in ("reward/mean", "loss", "kl", "entropy", "rm/loss"):
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
