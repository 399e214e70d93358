"""A tokenizer (or token ids) larger than the model's vocabulary is refused where a model is loaded,
naming both paths and both sizes, instead of ``IndexError: index out of range in self`` in the first
forward: the trainer's model loading, the rollout engine (and so ``cooper eval``), the reward-model
jobs and SFT all call :func:`cooper_mcore.data.tokenizer.check_vocab_fits`."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest

from cooper_mcore.data.tokenizer import check_tokenizer_fits, check_vocab_fits, load_tokenizer, tokenizer_size
from cooper_mcore.models.tiny import save_tiny_tokenizer


def _save_tokenizer(folder, n: int) -> str:
    """A word-level fast tokenizer with ``n`` ids (the tiny models have a vocabulary of 128)."""
    return save_tiny_tokenizer(str(folder), n)


def _swap_tokenizer(src_ckpt, dest, n) -> str:
    shutil.copytree(src_ckpt, dest)
    shutil.rmtree(os.path.join(dest, "hf_extra"), ignore_errors=True)
    _save_tokenizer(os.path.join(dest, "hf_extra"), n)
    return str(dest)


def _too_big(tok_path, model, size=200, vocab=128):
    return (rf"the tokenizer '{re.escape(str(tok_path))}' has {size} token ids \(0\.\.{size - 1}\), the model "
            rf"'{re.escape(str(model))}' a vocabulary of {vocab} \(ids >= {vocab} have no embedding\)")


def test_the_check(tmp_path):
    small = load_tokenizer(_save_tokenizer(tmp_path / "small", 100))
    big = load_tokenizer(_save_tokenizer(tmp_path / "big", 200))
    assert tokenizer_size(small) == 100 and tokenizer_size(big) == 200
    check_tokenizer_fits(small, 128, "m")
    check_tokenizer_fits(big, 200, "m")
    with pytest.raises(ValueError, match=_too_big(tmp_path / "big", "models/x")):
        check_tokenizer_fits(big, 128, "models/x")
    with pytest.raises(ValueError, match=r"^the data has 129 token ids \(0\.\.128\), the model 'm' a vocabulary of "):
        check_vocab_fits(129, 128, "the data", "m")


def test_trainer_load_refuses_a_larger_tokenizer(tiny_models, tmp_path):
    from cooper_mcore.rl.setup import load_model

    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    tok = load_tokenizer(_save_tokenizer(tmp_path / "tok", 200))
    cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32"), parallel=None)  # refused before any loading
    with pytest.raises(ValueError, match=_too_big(tmp_path / "tok", ckpt)):
        load_model("policy", ckpt, cfg, tok, None, 1)


def test_rollout_engine_and_cooper_eval_refuse_a_larger_tokenizer(tiny_models, tmp_path):
    from cooper_mcore.jobs.evaluate import evaluate_policy
    from cooper_mcore.rollout.hf_engine import HFEngine

    hf_dir, ckpt = tiny_models[("qwen2", "causal_lm")]
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    _save_tokenizer(hf, 200)
    with pytest.raises(ValueError, match=_too_big(hf, hf)):
        HFEngine.from_pretrained(str(hf))
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(ValueError, match=_too_big(hf, hf)):
        evaluate_policy(str(hf), str(data), k=1, max_new_tokens=2)
    bad = _swap_tokenizer(ckpt, tmp_path / "ckpt", 200)
    with pytest.raises(ValueError, match=_too_big(os.path.join(bad, "hf_extra"), bad)):
        evaluate_policy(bad, str(data), k=1, max_new_tokens=2)


def test_reward_model_jobs_refuse_a_larger_tokenizer(tiny_models, tmp_path):
    from cooper_mcore.config.schema import RMDataConfig, RMTrainConfig, VerifyRMConfig
    from cooper_mcore.jobs.verify_rm import eval_rm, train_rm

    _, ckpt = tiny_models[("qwen2", "reward")]
    bad = _swap_tokenizer(ckpt, tmp_path / "rm", 200)
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "verifybench_tiny.jsonl")
    with pytest.raises(ValueError, match=_too_big(os.path.join(bad, "hf_extra"), bad)):
        eval_rm(bad, fixture)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "q", "reference": "1", "completion": "1", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=_too_big(os.path.join(bad, "hf_extra"), bad)):
        train_rm(VerifyRMConfig(ckpt=bad, out=str(tmp_path / "out"), data=RMDataConfig(train_path=str(train)),
                                train=RMTrainConfig(epochs=1, global_batch_size=4)))


def test_sft_refuses_token_ids_past_the_vocabulary(tiny_models, tmp_path):
    from cooper_mcore.config.schema import OptimSection, SFTConfig, SFTTrainConfig
    from cooper_mcore.jobs.sft import sft

    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    with pytest.raises(ValueError, match=r"the tokenizer of the SFT examples has 201 token ids \(0\.\.200\), the model "
                                         rf"'{re.escape(ckpt)}' a vocabulary of 128"):
        sft(SFTConfig(ckpt=ckpt, out=str(tmp_path / "out"), optim=OptimSection(lr=1e-3),
                      train=SFTTrainConfig(steps=1, global_batch_size=1, micro_batch_size=1)), [([5, 6], [7, 200])])
    assert not os.path.exists(tmp_path / "out")
