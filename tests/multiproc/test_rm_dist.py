"""Reward-model scores and losses on 2 processes (DP=2, TP=2, PP=2) equal one process.

The losses are exact global means: "sum over counted rows / number counted" over micro-batches
and data-parallel ranks, also when one rank has no counted row at all."""

import json
import os

import pytest
import torch

from cooper_mcore.config.schema import OptimSection, RMDataConfig, RMTrainConfig, VerifyRMConfig
from cooper_mcore.convert.compare import sample_batch
from cooper_mcore.convert.hf import hf_to_mcore
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.models.tiny import save_tiny_hf_model
from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


def _reference(ckpt, data):
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world
    from cooper_mcore.train.reward_model import (
        RMBatch,
        bce_train_step,
        pairwise_train_step,
        rm_scores,
        wrap_reward_model,
    )
    from cooper_mcore.train.step import OptimConfig

    with single_process_world():
        model, _ = load_checkpoint_model(ckpt, ParallelConfig())
        scores = rm_scores(model, data["chosen_ids"], data["chosen_len"])
        ddp, opt = wrap_reward_model(model, OptimConfig(lr=1e-4))
        pair = pairwise_train_step(ddp, opt, RMBatch(data["chosen_ids"], data["chosen_len"]),
                                   RMBatch(data["rejected_ids"], data["rejected_len"]), data["mask"], 3)
        model2, _ = load_checkpoint_model(ckpt, ParallelConfig())
        ddp2, opt2 = wrap_reward_model(model2, OptimConfig(lr=1e-4))
        bce = bce_train_step(ddp2, opt2, RMBatch(data["chosen_ids"], data["chosen_len"], data["labels"]), 4,
                             mask=data["bce_mask"])
    return scores, pair, bce


def _train_rows():
    from cooper_mcore.data.mathgen import generate_problems, worked_solution

    rows = []
    for i, p in enumerate(generate_problems(5, seed=4)):
        rows.append({"question": p.question, "reference": str(p.answer), "completion": worked_solution(p),
                     "label": True, "answer_type": "int"})
        rows.append({"question": p.question, "reference": str(p.answer), "completion": f"\\boxed{{{i}}}",
                     "label": False, "answer_type": "int" if i % 2 else None})
    return rows


def test_rm_layouts_equal_single_process(tmp_path):
    from cooper_mcore.data.mathgen import tokenizer_corpus
    from cooper_mcore.data.templates import rm_input
    from cooper_mcore.data.tokenizer import train_tiny_tokenizer
    from cooper_mcore.jobs.verify_rm import eval_rm, train_rm

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "mcore")
    save_tiny_hf_model(hf_dir, "qwen2", "reward", seed=3, num_hidden_layers=2)
    rows = _train_rows()
    train_tiny_tokenizer([rm_input(r["question"], r["reference"], r["completion"]) for r in rows]
                         + tokenizer_corpus(50), hf_dir, vocab_size=128)
    hf_to_mcore(hf_dir, ckpt)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chosen_ids, chosen_len = sample_batch(128, 6, 11, 0, seed=1)
    rejected_ids, rejected_len = sample_batch(128, 6, 9, 0, seed=2)
    data = {"chosen_ids": chosen_ids, "chosen_len": chosen_len, "rejected_ids": rejected_ids,
            "rejected_len": rejected_len,
            "mask": torch.tensor([True, False, True, False, False, False]),  # DP rank 1: no valid pair
            "bce_mask": torch.tensor([True, True, True, False, True, False]),
            "labels": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])}
    torch.save(data, tmp_path / "data.pt")
    scores, pair, bce = _reference(ckpt, data)
    ref_train = train_rm(VerifyRMConfig(ckpt=ckpt, out=str(tmp_path / "run1"),
                                        data=RMDataConfig(train_path=str(train), eval_path=str(train)),
                                        optim=OptimSection(lr=1e-3), train=RMTrainConfig(
                                            epochs=2, micro_batch_size=2, global_batch_size=4, seed=0)))
    ref_eval = eval_rm(ref_train["final_checkpoint"], str(train), micro_batch_size=3)
    out = last_json(torchrun("rm_worker.py", 2, "--ckpt", ckpt, "--data", str(tmp_path / "data.pt"),
                             "--train", str(train), "--out", str(tmp_path / "run2")))
    got_train, got_eval = out.pop("train"), out.pop("eval")
    assert set(out) == {"dp2", "tp2", "pp2"}
    for name, got in out.items():
        torch.testing.assert_close(torch.tensor(got["scores"]), scores, rtol=0, atol=2e-5, msg=name)
        assert got["pair"]["num_valid"] == 2 and got["bce"]["num_samples"] == 4, name
        for key in ("loss", "pair_acc", "mean_chosen", "mean_rejected", "grad_norm"):
            assert got["pair"][key] == pytest.approx(pair[key], rel=1e-4, abs=1e-6), (name, key)
        for key in ("loss", "acc", "mean_score", "grad_norm"):
            assert got["bce"][key] == pytest.approx(bce[key], rel=1e-4, abs=1e-6), (name, key)

    # train-rm at DP=2 (the last batch of each epoch, 2 rows, leaves DP rank 1 without a row):
    # the same steps as one process; eval-rm at DP=2 splits and gathers the rows
    lines = [[json.loads(x) for x in open(tmp_path / run / "metrics.jsonl")] for run in ("run1", "run2")]
    assert [x["step"] for x in lines[1] if K.RM_TRAIN_LOSS in x] == [1, 2, 3, 4, 5, 6]
    assert len(lines[0]) == len(lines[1])
    for a, b in zip(*lines):
        assert a.keys() == b.keys() and a["step"] == b["step"]
        key = K.RM_TRAIN_LOSS if K.RM_TRAIN_LOSS in a else K.RM_EVAL_MEAN_PROB
        assert b[key] == pytest.approx(a[key], rel=1e-4), (a, b)
        if K.RM_TRAIN_LOSS in a:
            assert a[K.RM_TRAIN_NUM_SAMPLES] == b[K.RM_TRAIN_NUM_SAMPLES]
            assert b[K.RM_TRAIN_GRAD_NORM] == pytest.approx(a[K.RM_TRAIN_GRAD_NORM], rel=1e-3)
    assert os.path.isdir(got_train["final_checkpoint"]) and got_train["steps"] == 6
    assert got_eval["n"] == 10 and got_eval["per_label"] == ref_eval["per_label"]
    assert got_eval["per_answer_type"] == ref_eval["per_answer_type"]
    assert set(ref_eval["per_answer_type"]) == {"int", "unknown"}
    assert got_eval["mean_prob"] == pytest.approx(ref_eval["mean_prob"], rel=1e-5)
