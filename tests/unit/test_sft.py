"""SFT through Megatron: the loss against transformers, micro-batch invariance, the output checkpoint,
learning a trivial task end to end, and the arithmetic SFT data (including the plausible wrong solutions)."""

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cooper_mcore.config.schema import OptimSection, SFTConfig, SFTTrainConfig
from cooper_mcore.data.mathgen import MathTaskConfig, generate_problems, worked_solution
from cooper_mcore.jobs.sft import example_stream, math_sft_examples, sft, wrong_worked_solution


def sft_config(ckpt, out, steps: int, lr: float, global_batch_size: int, micro_batch_size: int = 8, seed: int = 0,
               warmup_steps: int = 0, min_lr=None, log_every: int = 10) -> SFTConfig:
    """The SFT job config of these tests (the other settings at their defaults)."""
    return SFTConfig(ckpt=str(ckpt), out=str(out), optim=OptimSection(lr=lr, warmup_steps=warmup_steps),
                     train=SFTTrainConfig(steps=steps, global_batch_size=global_batch_size,
                                          micro_batch_size=micro_batch_size, min_lr=min_lr, seed=seed,
                                          log_every=log_every))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from cooper_mcore.demo.assets import build_tiny_assets

    return build_tiny_assets(str(tmp_path_factory.mktemp("sft_assets")), n_train=16, n_eval=8)


@pytest.fixture(scope="module")
def tok(assets):
    from cooper_mcore.data.tokenizer import load_tokenizer

    return load_tokenizer(assets["tokenizer"])


def _hf_masked_ce(hf_dir, examples) -> float:
    """Token-mean cross-entropy of the response tokens, one unpadded sequence at a time, with transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, response in examples:
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            for j, token in enumerate(response):  # token j of the response is predicted at position len(prompt)+j-1
                total -= float(logp[len(prompt) + j - 1, token])
                count += 1
    return total / count


def _weights(ckpt):
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    with single_process_world():
        model, _ = load_checkpoint_model(ckpt, ParallelConfig())
        return {k: v.detach().clone() for k, v in model.state_dict().items() if "extra" not in k}


@pytest.fixture(scope="module")
def trained(assets, tok, tmp_path_factory):
    """Five steps on one fixed batch of 8 arithmetic examples (every step sees all 8)."""
    examples = math_sft_examples(tok, 8, seed=0)
    out = str(tmp_path_factory.mktemp("sft_run") / "out")
    history = sft(sft_config(assets["policy_ckpt"], out, steps=5, lr=3e-3, global_batch_size=8, micro_batch_size=4),
                  examples)
    return examples, out, history


def test_first_loss_is_masked_token_mean_ce_and_steps_lower_it(assets, trained):
    examples, _, history = trained
    assert history["loss"][0] == pytest.approx(_hf_masked_ce(assets["policy_hf"], examples), abs=1e-4)
    assert history["tokens"] == 5 * sum(len(r) for _, r in examples)
    losses = history["loss"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.3, losses


def test_micro_batch_8_equals_8x1(assets, tok, tmp_path):
    examples = math_sft_examples(tok, 8, seed=1)
    runs = {}
    for mbs in (8, 1):
        out = str(tmp_path / f"mbs{mbs}")
        # Adam's first step is about lr * sign(grad): where |grad| is near adam_eps, float noise in the
        # gradient moves a weight by up to ~lr * 1e-3, so a small lr keeps that below the tolerance
        runs[mbs] = sft(sft_config(assets["policy_ckpt"], out, steps=1, lr=1e-4, global_batch_size=8,
                                   micro_batch_size=mbs, seed=3), examples)
        runs[mbs]["weights"] = _weights(out)
    a, b, before = runs[8]["weights"], runs[1]["weights"], _weights(assets["policy_ckpt"])
    assert runs[8]["loss"][0] == pytest.approx(runs[1]["loss"][0], abs=1e-6)
    assert runs[8]["grad_norm"][0] == pytest.approx(runs[1]["grad_norm"][0], abs=1e-5)
    assert max(float((a[k] - before[k]).abs().max()) for k in a) > 5e-5  # the step did change the weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_output_checkpoint_exports_with_tokenizer_and_holds_the_trained_weights(assets, trained, tmp_path):
    import transformers

    from cooper_mcore.checkpoint.model import EXTRA_DIR, META_FILE
    from cooper_mcore.convert.hf import mcore_to_hf
    from cooper_mcore.data.tokenizer import load_tokenizer

    examples, out, history = trained
    assert os.path.isfile(os.path.join(out, META_FILE)) and os.path.isdir(os.path.join(out, EXTRA_DIR))
    assert not os.path.exists(out + ".tmp")
    hf_dir = str(tmp_path / "hf")
    mcore_to_hf(out, hf_dir)
    assert isinstance(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), transformers.PreTrainedModel)
    src_extra = os.path.join(assets["policy_ckpt"], EXTRA_DIR)
    assert sorted(os.listdir(src_extra)) == sorted(os.listdir(os.path.join(out, EXTRA_DIR)))
    for name in os.listdir(src_extra):  # the input checkpoint's tokenizer files, unchanged in the export
        with open(os.path.join(src_extra, name), "rb") as a, open(os.path.join(hf_dir, name), "rb") as b:
            assert a.read() == b.read(), name
    assert "tokenizer.json" in os.listdir(hf_dir) and load_tokenizer(hf_dir).eos_token_id == examples[0][1][-1]
    # training on from the output: its first loss is the exported model's loss, below the last one seen
    again = sft(sft_config(out, tmp_path / "again", steps=1, lr=1e-3, global_batch_size=8, micro_batch_size=8),
                examples)
    assert again["loss"][0] == pytest.approx(_hf_masked_ce(hf_dir, examples), abs=1e-4)
    assert again["loss"][0] < history["loss"][-1]
    with pytest.raises(FileExistsError):
        sft(sft_config(out, out, steps=1, lr=1e-3, global_batch_size=8), examples)


_DP_WORKER = """
import json, os, sys
from cooper_mcore.data.tokenizer import load_tokenizer
from cooper_mcore.config.schema import SFTConfig, load_config
from cooper_mcore.jobs.sft import math_sft_examples, sft

if __name__ == "__main__":
    tokenizer_dir, ckpt, out = sys.argv[1:4]
    examples = math_sft_examples(load_tokenizer(tokenizer_dir), 12, seed=1)
    cfg = load_config(None, [f"ckpt={ckpt}", f"out={out}", "train.steps=3", "optim.lr=1e-4",
                             "train.global_batch_size=8", "train.micro_batch_size=2", "train.seed=3",
                             "train.log_every=0"], cls=SFTConfig)
    h = sft(cfg, examples)
    if os.environ["RANK"] == "0":
        print(json.dumps(h))
"""


def test_torchrun_data_parallel_equals_one_process(assets, tok, tmp_path):
    """Two data-parallel ranks (each its half of every shuffled global batch) give one process's result."""
    examples = math_sft_examples(tok, 12, seed=1)  # 12 examples in batches of 8: steps span epochs
    one = sft(sft_config(assets["policy_ckpt"], tmp_path / "one", steps=3, lr=1e-4, global_batch_size=8,
                         micro_batch_size=8, seed=3), examples)
    script = tmp_path / "worker.py"
    script.write_text(_DP_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                        str(script), assets["tokenizer"], assets["policy_ckpt"], str(tmp_path / "dp2")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-4000:]
    dp2 = json.loads(r.stdout.strip().splitlines()[-1])
    assert dp2["tokens"] == one["tokens"]
    assert dp2["loss"] == pytest.approx(one["loss"], abs=1e-6) and dp2["grad_norm"] == pytest.approx(one["grad_norm"])
    a, b = _weights(str(tmp_path / "one")), _weights(str(tmp_path / "dp2"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_sft_learns_single_digit_copy(assets, tok, tmp_path):
    from cooper_mcore.convert.hf import mcore_to_hf
    from cooper_mcore.rollout.base import SamplingParams
    from cooper_mcore.rollout.hf_engine import HFEngine
    from cooper_mcore.verify.rule import RuleVerifier

    prompts = [tok(f"{d}+0=", add_special_tokens=False)["input_ids"] for d in range(10)]
    examples = [(p, tok(str(d), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                for d, p in enumerate(prompts)]
    out = str(tmp_path / "copy")
    history = sft(sft_config(assets["policy_ckpt"], out, steps=120, lr=3e-3, global_batch_size=10,
                             micro_batch_size=10, log_every=0), examples)
    assert history["loss"][-1] < 0.1 * history["loss"][0]

    def accuracy(ckpt, verifier) -> float:
        hf_dir = str(tmp_path / (os.path.basename(ckpt) + "_hf"))
        mcore_to_hf(ckpt, hf_dir)
        outs = HFEngine.from_pretrained(hf_dir).generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
        verdicts = verifier.verify_batch([str(d) for d in range(10)], [o.text for o in outs])
        return sum(bool(v.correct) for v in verdicts) / 10

    with RuleVerifier(num_workers=1) as verifier:
        before, after = accuracy(assets["policy_ckpt"], verifier), accuracy(out, verifier)
    assert before <= 0.2 and after >= 0.8, (before, after)  # chance is 0.1


def test_example_stream_shards_a_shuffled_stream_of_epochs():
    ranks = [example_stream(10, 4, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    batches = [next(ranks[0]) + next(ranks[1]) for _ in range(5)]  # 20 indices = two epochs
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:] and flat[:10] != list(range(10))  # shuffled, differently per epoch
    assert [next(example_stream(10, 4, seed=5))[:2] for _ in range(2)] == [batches[0][:2]] * 2  # deterministic


def test_math_sft_examples_are_templated_questions_and_worked_solutions(tok):
    config = MathTaskConfig()
    examples = math_sft_examples(tok, 12, config, seed=4, template="{question} ")
    problems = generate_problems(12, config, "train", seed=4)
    for (prompt, response), problem in zip(examples, problems):
        assert tok.decode(prompt) == problem.question + " "
        assert response[-1] == tok.eos_token_id and tok.eos_token_id not in response[:-1]
        assert tok.decode(response[:-1]) == worked_solution(problem)
    assert math_sft_examples(tok, 12, config, seed=4, template="{question} ") == examples
    with pytest.raises(ValueError, match="mix_wrong"):
        math_sft_examples(tok, 4, mix_wrong=1.5)


_STEP = re.compile(r"^(-?\d+)([-+*])(\d+)=(-?\d+)$")


def _check_wrong(problem, text):
    """Assert ``text`` is a plausible wrong worked solution of ``problem``; return its kind."""
    body, boxed = re.fullmatch(r"(.*) \\boxed\{(-?\d+)\}", text).groups()
    assert int(boxed) != problem.answer
    steps = [_STEP.match(s).groups() for s in body.split(",")]
    assert len(steps) == len(problem.ops) and int(steps[0][0]) == problem.operands[0]
    errors = []
    for i, (a, op, b, r) in enumerate(steps):
        assert op == problem.ops[i] and int(b) == problem.operands[i + 1]
        if i:
            assert int(a) == int(steps[i - 1][3])  # the chain is consistent
        exact = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        if int(r) != exact:
            errors.append(int(r) - exact)
    if not errors:  # right steps, an intermediate boxed
        assert int(boxed) in problem.results[:-1]
        return "intermediate"
    assert len(errors) == 1 and errors[0] in (-10, -1, 1, 10) and int(boxed) == int(steps[-1][3])
    return "off_by"


def test_mix_wrong_replaces_that_share_with_plausible_wrong_solutions(tok):
    config = MathTaskConfig(max_operand=12)  # the tiny tokenizer knows "+" and "-" only
    examples = math_sft_examples(tok, 40, config, seed=2, mix_wrong=0.25)
    problems = generate_problems(40, config, "train", seed=2)
    texts = [tok.decode(r[:-1]) for _, r in examples]
    wrong = [i for i, (t, p) in enumerate(zip(texts, problems)) if t != worked_solution(p)]
    assert len(wrong) == 10
    kinds = [_check_wrong(problems[i], texts[i]) for i in wrong]
    assert 2 <= kinds.count("intermediate") <= 8, kinds  # each kind about half of the time
    # with "*": a later "*0" (or "*1" after 0) can make a wrong step harmless; such variants are never returned
    rng = random.Random(0)
    mul = MathTaskConfig(operators=("+", "-", "*"), max_operand=3, num_steps=3)
    for p in generate_problems(40, mul, "train", seed=0):
        for _ in range(5):
            _check_wrong(p, wrong_worked_solution(p, rng))


def test_learning_rate_schedules(assets, tok, trained, tmp_path):
    assert trained[2]["lr"] == [3e-3] * 5  # default: constant, no warm-up
    h = sft(sft_config(assets["policy_ckpt"], tmp_path / "cos", steps=4, lr=1e-3, global_batch_size=4,
                       micro_batch_size=4, warmup_steps=1, min_lr=1e-4), math_sft_examples(tok, 4, seed=0))
    # linear warm-up from 0 over one step, then cosine from 1e-3 to 1e-4 over the remaining three
    assert h["lr"] == pytest.approx([0.0, 1e-3, 1e-4 + 0.75 * 9e-4, 1e-4 + 0.25 * 9e-4])


def test_sft_rejects_bad_arguments(assets, tmp_path):
    ckpt, out = assets["policy_ckpt"], str(tmp_path / "out")
    with pytest.raises(ValueError, match="empty prompt or response"):
        sft(sft_config(ckpt, out, steps=1, lr=1e-3, global_batch_size=1, micro_batch_size=1), [([5, 6], [])])
    with pytest.raises(ValueError, match="multiple of train.micro_batch_size"):
        sft(sft_config(ckpt, out, steps=1, lr=1e-3, global_batch_size=6, micro_batch_size=4), [([5, 6], [7, 4])])
    with pytest.raises(ValueError, match="causal-LM"):
        sft(sft_config(assets["rm_ckpt"], out, steps=1, lr=1e-3, global_batch_size=1, micro_batch_size=1),
            [([5, 6], [7, 4])])
    with pytest.raises(ValueError, match="min_lr"):
        sft(sft_config(ckpt, out, steps=1, lr=1e-3, global_batch_size=1, min_lr=2e-3), [([5, 6], [7, 4])])
    assert not os.path.exists(out)
