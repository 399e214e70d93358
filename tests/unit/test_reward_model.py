"""VerifyRM on Megatron in one process: scores against transformers, the BCE and pairwise steps
against hand formulas and transformers' autograd, and the train-rm / eval-rm jobs."""

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F

from cooper_mcore.checkpoint.tokenizer import load_checkpoint_tokenizer
from cooper_mcore.config.schema import OptimSection, RMDataConfig, RMTrainConfig, VerifyRMConfig
from cooper_mcore.data.mathgen import generate_problems, tokenizer_corpus
from cooper_mcore.data.templates import rm_input
from cooper_mcore.jobs.verify_rm import (
    RMExample,
    accuracy_report,
    eval_rm,
    read_eval_examples,
    read_rm_examples,
    train_rm,
)
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.train.reward_model import (
    RMBatch,
    bce_train_step,
    make_batch,
    pad_token_lists,
    pairwise_train_step,
    rm_scores,
    tokenize_texts,
    wrap_reward_model,
)
from cooper_mcore.train.step import OptimConfig
from tests.conftest import ROOT

FIXTURE = str(ROOT / "tests" / "fixtures" / "verifybench_tiny.jsonl")

def rm_job(ckpt, train, out, eval_path="", lr: float = 2e-5, **train_settings) -> VerifyRMConfig:
    """The VerifyRM job config of these tests: ``train_settings`` are ``train.*`` (the rest at their defaults)."""
    data = RMDataConfig(train_path=str(train), eval_path=str(eval_path))
    return VerifyRMConfig(ckpt=str(ckpt), out=str(out), data=data,
                          optim=OptimSection(lr=lr), train=RMTrainConfig(**train_settings))


def _triples(n, seed=3):
    """Mathgen triples labeled by the rule verifier: a bare correct boxed answer, and the worked steps
    ending in a wrong boxed answer. (The fixture's random model happens to score the long wrong
    completions higher, so training has to reverse its initial ranking.)"""
    from cooper_mcore.verify.rule import check_pair

    rng = random.Random(seed)
    rows = []
    for p in generate_problems(n, seed=seed):
        wrong = ",".join(p.steps()) + " \\boxed{" + str(p.answer + rng.choice([-11, -2, -1, 1, 2, 10])) + "}"
        for c in ("\\boxed{" + str(p.answer) + "}", wrong):
            rows.append({"question": p.question, "reference": str(p.answer), "completion": c,
                         "label": bool(check_pair(str(p.answer), c)[0])})
    return rows


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    """(hf_dir, ckpt): a 2-layer Qwen2 reward model with a tiny tokenizer for the RM template."""
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.data.tokenizer import train_tiny_tokenizer
    from cooper_mcore.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("rm")
    hf_dir, ckpt = str(root / "hf"), str(root / "mcore")
    save_tiny_hf_model(hf_dir, "qwen2", "reward", seed=5, num_hidden_layers=2)
    texts = [rm_input(r["question"], r["reference"], r["completion"]) for r in _triples(40, seed=11)]
    train_tiny_tokenizer(texts + tokenizer_corpus(100), hf_dir, vocab_size=128)
    hf_to_mcore(hf_dir, ckpt)
    return hf_dir, ckpt


def _texts(n, seed=3):
    return [rm_input(r["question"], r["reference"], r["completion"]) for r in _triples(n, seed)], \
        [float(r["label"]) for r in _triples(n, seed)]


def _hf(hf_dir):
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _hf_grad_norm(hf, loss_of_scores, *batches):
    """Norm of the gradient of ``loss_of_scores(scores...)`` w.r.t. all parameters of ``hf``."""
    hf.zero_grad()
    scores = [hf(b.input_ids).logits.squeeze(-1) for b in batches]
    loss = loss_of_scores(*scores)
    loss.backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))


def _load(ckpt):
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.parallel import ParallelConfig

    return load_checkpoint_model(ckpt, ParallelConfig())[0]


def test_rm_scores_equal_transformers(tiny_rm):
    from cooper_mcore.parallel import single_process_world

    hf_dir, ckpt = tiny_rm
    texts, _ = _texts(4)
    texts = texts[:7]
    with single_process_world():
        tok = load_checkpoint_tokenizer(ckpt)  # read from the checkpoint's hf_extra/
        batch = make_batch(tok, texts)
        assert len(set(batch.lengths.tolist())) > 1  # rows of several lengths: last-token pick matters
        assert (batch.input_ids[0, batch.lengths[0]:] == tok.pad_token_id).all()
        got = rm_scores(_load(ckpt), batch.input_ids, batch.lengths, micro_batch_size=3)  # 7 = 3+3+1 filled
    with torch.no_grad():
        ref = _hf(hf_dir)(batch.input_ids).logits.squeeze(-1)
    assert got.shape == (7,) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_tokenize_cuts_long_rows_in_the_middle(tiny_rm):
    tok = load_checkpoint_tokenizer(tiny_rm[1])
    text = rm_input("1+2=", "3", "1+2=3 \\boxed{3}")
    full = tok(text)["input_ids"]
    assert len(full) > 12
    assert tokenize_texts(tok, [text], max_length=12) == [full[:4] + full[-8:]]
    assert tokenize_texts(tok, [text], max_length=len(full)) == [full]
    ids, lengths = pad_token_lists([[5, 6, 7], [8]], pad_id=0, multiple_of=4)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]] and lengths.tolist() == [3, 1]


def test_bce_step_loss_matches_hand_formula_and_decreases(tiny_rm):
    from cooper_mcore.parallel import single_process_world

    hf_dir, ckpt = tiny_rm
    texts, labels = _texts(3)
    with single_process_world():
        tok = load_checkpoint_tokenizer(ckpt)
        batch = make_batch(tok, texts, labels)
        model = _load(ckpt)
        s0 = rm_scores(model, batch.input_ids, batch.lengths).double()
        ddp, opt = wrap_reward_model(model, OptimConfig(lr=3e-4, weight_decay=0.0, clip_grad=0.0))
        first = bce_train_step(ddp, opt, batch, micro_batch_size=4)  # 6 rows: 4 + 2 (masked filler)
        losses = [first["loss"]] + [bce_train_step(ddp, opt, batch, micro_batch_size=2)["loss"] for _ in range(5)]
    y = torch.tensor(labels, dtype=torch.float64)
    p = torch.sigmoid(s0)
    hand = float((-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).mean())
    assert first["loss"] == pytest.approx(hand, rel=1e-6)
    assert first["acc"] == pytest.approx(float(((p >= 0.5).double() == y).double().mean()))
    assert first["num_samples"] == 6
    # the gradient is that of the mean over the 6 real rows (not of 2 micro-batch means)
    hf_norm = _hf_grad_norm(_hf(hf_dir), lambda s: F.binary_cross_entropy_with_logits(s, y.float()), batch)
    assert first["grad_norm"] == pytest.approx(hf_norm, rel=1e-4)
    assert losses[-1] < losses[0] - 0.05, losses


def test_bce_mask_drops_rows(tiny_rm):
    """A masked row changes neither the loss nor the gradient."""
    from cooper_mcore.parallel import single_process_world

    hf_dir, ckpt = tiny_rm
    texts, labels = _texts(2)
    with single_process_world():
        tok = load_checkpoint_tokenizer(ckpt)
        batch = make_batch(tok, texts, labels)
        ddp, opt = wrap_reward_model(_load(ckpt), OptimConfig(lr=1e-4))
        m = bce_train_step(ddp, opt, batch, 1, mask=torch.tensor([True, False, True, True]))
    keep = [0, 2, 3]
    sub = RMBatch(batch.input_ids[keep], batch.lengths[keep], batch.labels[keep])
    hf = _hf(hf_dir)
    with torch.no_grad():
        s = hf(sub.input_ids).logits.squeeze(-1)
    assert m["num_samples"] == 3
    assert m["loss"] == pytest.approx(float(F.binary_cross_entropy_with_logits(s, sub.labels)), rel=1e-5)
    norm = _hf_grad_norm(hf, lambda s: F.binary_cross_entropy_with_logits(s, sub.labels), sub)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_pairwise_step_matches_hand_formula(tiny_rm):
    from cooper_mcore.parallel import single_process_world

    hf_dir, ckpt = tiny_rm
    texts, _ = _texts(5)
    valid = torch.tensor([True, False, True, True, False])
    with single_process_world():
        tok = load_checkpoint_tokenizer(ckpt)
        chosen, rejected = make_batch(tok, texts[0::2]), make_batch(tok, texts[1::2])
        model = _load(ckpt)
        sc = rm_scores(model, chosen.input_ids, chosen.lengths).double()
        sr = rm_scores(model, rejected.input_ids, rejected.lengths).double()
        ddp, opt = wrap_reward_model(model, OptimConfig(lr=1e-4))
        # tuples are accepted as well as RMBatch; micro-batches of 2 pairs: 3 valid + 1 filler
        m = pairwise_train_step(ddp, opt, (chosen.input_ids, chosen.lengths), rejected, valid, micro_batch_size=2)
    d = (sc - sr)[valid]
    hand = float(torch.log1p(torch.exp(-d)).sum() / 3)
    assert m["loss"] == pytest.approx(hand, rel=1e-6)
    assert m["num_valid"] == 3 and m["skipped"] is False
    assert m["pair_acc"] == pytest.approx(float((d > 0).double().mean()))
    assert m["mean_chosen"] == pytest.approx(float(sc[valid].mean()), rel=1e-5)
    idx = valid.nonzero().flatten()
    c = RMBatch(chosen.input_ids[idx], chosen.lengths[idx])
    r = RMBatch(rejected.input_ids[idx], rejected.lengths[idx])
    norm = _hf_grad_norm(_hf(hf_dir), lambda a, b: -F.logsigmoid(a - b).mean(), c, r)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_pairwise_without_valid_pairs_leaves_weights_bitwise_unchanged(tiny_rm):
    from cooper_mcore.parallel import single_process_world

    _, ckpt = tiny_rm
    texts, _ = _texts(3)
    with single_process_world():
        tok = load_checkpoint_tokenizer(ckpt)
        chosen, rejected = make_batch(tok, texts[0::2]), make_batch(tok, texts[1::2])
        model = _load(ckpt)
        ddp, opt = wrap_reward_model(model, OptimConfig(lr=1e-3, weight_decay=0.1))
        # a real step first: Adam moments and weight decay would move the weights on any later step
        assert not pairwise_train_step(ddp, opt, chosen, rejected, torch.ones(3, dtype=torch.bool), 2)["skipped"]
        before = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        m = pairwise_train_step(ddp, opt, chosen, rejected, torch.zeros(3, dtype=torch.bool), 2)
        after = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        moved = pairwise_train_step(ddp, opt, chosen, rejected, torch.tensor([True, False, False]), 2)
        changed = [k for k, v in model.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert m["skipped"] is True and m["num_valid"] == 0 and m["loss"] == 0.0 and m["grad_norm"] is None
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert moved["num_valid"] == 1 and changed  # the check above could have failed


def test_wrong_inputs_raise(tiny_rm):
    from cooper_mcore.parallel import single_process_world

    _, ckpt = tiny_rm
    with single_process_world():
        tok = load_checkpoint_tokenizer(ckpt)
        batch = make_batch(tok, _texts(1)[0], [1.0, 0.0])
        model = _load(ckpt)
        from cooper_mcore.train.step import wrap_for_training

        ddp, opt = wrap_for_training(model, OptimConfig())  # mean-loss mode: not exact for pairs
        with pytest.raises(ValueError, match="wrap_reward_model"):
            bce_train_step(ddp, opt, batch, 1)
        with pytest.raises(ValueError, match="do not align"):
            pairwise_train_step(ddp, opt, batch, make_batch(tok, ["x"]), torch.ones(2, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="lengths"):
        RMBatch(torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 4]))


# --------------------------------------------------------------------------- data and evaluation


def test_read_rm_examples(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"question": "q1", "reference": 3, "completion": "c", "label": 1},
            {"question": "q2", "reference": "x", "completion": "c", "label": False, "answer_type": "t"},
            {"question": "q3", "reference": "x", "completion": "c", "label": 2}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\nnot json\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:line 3: field 'label' must be"):
        read_rm_examples(str(p))
    got, skipped = read_rm_examples(str(p), skip_malformed=True)
    assert skipped == 2
    assert [(e.id, e.reference, e.label, e.answer_type) for e in got] == [
        ("d.jsonl:1", "3", True, None), ("d.jsonl:2", "x", False, "t")]
    q = tmp_path / "e.jsonl"
    q.write_text(json.dumps({"q": "a", "ref": "b", "c": "c", "y": True}) + "\n")
    got, _ = read_rm_examples(str(q), question_key="q", reference_key="ref", completion_key="c", label_key="y")
    assert got[0].rm_text() == rm_input("a", "b", "c")
    with pytest.raises(ValueError, match="cannot tell the data format"):
        read_eval_examples(str(q))
    items, _ = read_eval_examples(FIXTURE)
    assert len(items) == 12 and items[1].reference == "10" and items[0].answer_type == "numeric"


def test_accuracy_report_per_type_and_label():
    items, _ = read_eval_examples(FIXTURE, "verifybench")
    # stub scores: predicted correct (sigmoid >= 0.5) for these ids; 0.0 is exactly p = 0.5
    yes = {"vb-num-1": 3.0, "vb-num-3": 0.0, "vb-expr-1": 1.0, "vb-mc-1": 2.0, "vb-mc-2": 0.5,
           "vb-str-1": 4.0, "vb-str-3": 0.1}
    scores = torch.tensor([yes.get(it.id, -1e-3 if it.id == "vb-num-2" else -2.0) for it in items])
    r = accuracy_report(items, scores)
    assert r["n"] == 12 and r["accuracy"] == pytest.approx(7 / 12)
    assert {k: v["accuracy"] for k, v in r["per_answer_type"].items()} == pytest.approx(
        {"numeric": 1 / 3, "expression": 2 / 3, "multiple_choice": 2 / 3, "string": 2 / 3})
    assert {k: v["n"] for k, v in r["per_answer_type"].items()} == {
        "numeric": 3, "expression": 3, "multiple_choice": 3, "string": 3}
    assert r["per_label"] == {"correct": {"n": 6, "accuracy": 4 / 6}, "incorrect": {"n": 6, "accuracy": 3 / 6}}
    untyped = [RMExample("a", "q", "r", "c", True), RMExample("b", "q", "r", "c", False)]
    r2 = accuracy_report(untyped, torch.tensor([1.0, 1.0]), threshold=0.8)  # sigmoid(1) = 0.73 < 0.8
    assert r2["accuracy"] == 0.5 and r2["per_answer_type"] == {}
    assert r2["per_label"]["correct"]["accuracy"] == 0.0 and r2["per_label"]["incorrect"]["accuracy"] == 1.0


# --------------------------------------------------------------------------- jobs


def test_train_rm_then_eval_rm_and_export(tiny_rm, tmp_path):
    from cooper_mcore.checkpoint.model import load_model_checkpoint, read_meta
    from cooper_mcore.convert.hf import mcore_to_hf
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    _, ckpt = tiny_rm
    rows = _triples(16)
    assert sum(r["label"] for r in rows) == 16  # balanced: chance is 0.5
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    s = train_rm(rm_job(ckpt, data, out, eval_path=data, epochs=6, lr=1e-3, micro_batch_size=4,
                        global_batch_size=8, eval_every=10, save_every=12, seed=0))
    assert s["steps"] == 24 and s["num_train"] == 32
    assert s["eval"]["accuracy"] >= 0.85, s["eval"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if K.RM_TRAIN_LOSS in x]
    evals = [x for x in lines if K.RM_EVAL_ACCURACY in x]
    assert len(train_lines) + len(evals) == len(lines)
    assert [x["step"] for x in train_lines] == list(range(1, 25))
    assert [x["step"] for x in evals] == [0, 4, 8, 10, 12, 16, 20, 24]  # start, epochs, every 10
    assert evals[0][K.RM_EVAL_ACCURACY] <= 0.6
    assert train_lines[-1][K.RM_TRAIN_LOSS] < train_lines[0][K.RM_TRAIN_LOSS] - 0.3
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000012", "step_000024"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 24
    final = s["final_checkpoint"]
    assert os.path.isfile(os.path.join(final, "hf_extra", "tokenizer.json"))
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]

    # the checkpoint loads (and differs from the start), and eval-rm reproduces the last evaluation
    arch = read_meta(final)[0]
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False)
        load_model_checkpoint(model, final, arch)
        start = build_model(arch, ParallelConfig(), init_weights=False)
        load_model_checkpoint(start, ckpt, arch)
        a, b = model.state_dict(), start.state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a if not k.endswith("_extra_state"))
    r = eval_rm(final, str(data), micro_batch_size=3, predictions_path=str(tmp_path / "pred.jsonl"))
    assert r["accuracy"] == s["eval"]["accuracy"] and r["n"] == 32
    assert len((tmp_path / "pred.jsonl").read_text().splitlines()) == 32

    # export to HF: transformers' scores give eval-rm's report on VerifyBench data. (The same
    # tokenizer object: with the export's config.json next to it, transformers 5 loads the tiny
    # tokenizer as Qwen2Tokenizer, which segments unknown characters and spaces differently.)
    hf_out = tmp_path / "hf"
    mcore_to_hf(final, str(hf_out))
    assert os.path.isfile(hf_out / "tokenizer.json")
    tok = load_checkpoint_tokenizer(final)
    items, _ = read_eval_examples(FIXTURE)
    batch = make_batch(tok, [it.rm_text() for it in items])
    with torch.no_grad():
        ref_scores = _hf(str(hf_out))(batch.input_ids).logits.squeeze(-1)
    got = eval_rm(final, FIXTURE, micro_batch_size=4)
    want = accuracy_report(items, ref_scores)
    assert got["per_answer_type"] == want["per_answer_type"] and got["per_label"] == want["per_label"]
    assert got["mean_prob"] == pytest.approx(want["mean_prob"], abs=1e-6)
    with pytest.raises(FileExistsError):
        train_rm(rm_job(ckpt, data, out))


def test_train_rm_rejects_bad_arguments(tiny_rm, tmp_path):
    _, ckpt = tiny_rm
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _triples(2)))
    with pytest.raises(ValueError, match="global_batch_size=6 is not a multiple"):
        train_rm(rm_job(ckpt, data, tmp_path / "o1", micro_batch_size=4, global_batch_size=6))
    with pytest.raises(ValueError, match="epochs"):
        train_rm(rm_job(ckpt, data, tmp_path / "o2", epochs=0))


def test_gate_score_by_hand():
    from cooper_mcore.jobs.verify_rm import gate_score

    typed = {"accuracy": 0.85, "per_answer_type": {"x": {"n": 4, "accuracy": 0.9}, "y": {"n": 4, "accuracy": 0.8},
                                                   "empty": {"n": 0, "accuracy": None}}}
    assert gate_score(typed).score == 0.8 and gate_score(typed).accuracy == {"x": 0.9, "y": 0.8}
    assert gate_score({"accuracy": 0.7, "per_answer_type": {}}).accuracy == {"all": 0.7}


def test_train_rm_stops_at_its_gate_and_keeps_its_best_epoch(tiny_rm, tmp_path):
    """A gate every epoch reaches stops training after the first; without a gate every epoch runs, and with
    keep_best the final model is the epoch with the best evaluation (eval-rm reproduces it), not the last."""
    _, ckpt = tiny_rm
    rows = _triples(16)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = dict(micro_batch_size=4, global_batch_size=8, seed=0, eval_at_start=False)
    early = train_rm(rm_job(ckpt, data, tmp_path / "early", eval_path=data, epochs=5, lr=1e-3, gate=0.01, **settings))
    assert (early["epochs"], early["steps"]) == (1, 4)  # 32 rows in batches of 8
    assert early["gate"]["met"] is True and early["gate"]["epoch"] == 1

    out = tmp_path / "best"
    s = train_rm(rm_job(ckpt, data, out, eval_path=data, epochs=6, lr=3e-3, keep_best=True, **settings))
    evals = [json.loads(x)[K.RM_EVAL_ACCURACY] for x in (out / "metrics.jsonl").read_text().splitlines()
             if K.RM_EVAL_ACCURACY in json.loads(x)]
    assert s["epochs"] == 6 and len(evals) == 6 and s["gate"]["met"] is False
    best = max(range(6), key=lambda i: (evals[i], -i))  # the first best epoch
    assert s["gate"]["epoch"] == best + 1 and s["gate"]["accuracy"] == {"all": evals[best]}
    assert eval_rm(s["final_checkpoint"], str(data), micro_batch_size=4)["accuracy"] == evals[best]
    with pytest.raises(ValueError, match="set data.eval_path"):
        train_rm(rm_job(ckpt, data, tmp_path / "no_eval", gate=0.9))
