"""The transformers rollout engine: greedy = step-by-step argmax, logprobs = a plain forward,
padding-invariant batching, seeded sampling, stop strings, weight updates."""

import pytest
import torch
import transformers

from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.rollout.base import SamplingParams, bucketize
from cooper_mcore.rollout.hf_engine import HFEngine


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen2", eos_token_id=1, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _argmax_loop(model, prompt, n, eos=1):
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
            if nxt == eos:
                break
    return out


def test_greedy_matches_argmax_loop_and_padding_does_not_matter(model):
    engine = HFEngine(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]  # different lengths: left padding
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
    for p, o in zip(prompts, outs):
        assert o.token_ids == _argmax_loop(model, p, 8)
        alone = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=0))[0]
        assert alone.token_ids == o.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(o.logprobs), atol=1e-5, rtol=0)


def test_logprobs_equal_a_plain_forward(model):
    engine = HFEngine(model)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    scored = engine.score([p + o.token_ids for p, o in zip(prompts, outs)], [len(p) for p in prompts])
    for o, s in zip(outs, scored):
        assert len(o.logprobs) == len(o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(s), atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible_and_varies(model):
    engine = HFEngine(model)
    p = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    a = engine.generate([[5, 6]] * 4, p)
    b = engine.generate([[5, 6]] * 4, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1  # 4 samples of one prompt differ


def test_update_weights_changes_outputs_and_checks_names(model):
    engine = HFEngine(transformers.AutoModelForCausalLM.from_config(model.config).eval())
    new = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    engine.update_weights(bucketize(new, bucket_bytes=20_000), version=3)
    assert engine.weight_version == 3
    prompt = [[5, 6, 7]]
    g = SamplingParams(max_new_tokens=6, temperature=0)
    assert engine.generate(prompt, g)[0].token_ids == _argmax_loop(model, prompt[0], 6)
    with pytest.raises(ValueError, match="no parameter 'model.bogus'"):
        engine.update_weights([[("model.bogus", torch.zeros(1))]], version=4)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        engine.update_weights([[("model.norm.weight", torch.zeros(3))]], version=4)


def test_bucketize_bounds_and_order():
    ts = [(str(i), torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(bucketize(ts, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["0", "1"], ["2"], ["3", "4"]]
    assert all(sum(t.numel() * 4 for _, t in b) <= 80 or len(b) == 1 for b in buckets)
    with pytest.raises(ValueError):
        list(bucketize(ts, 0))


def test_text_prompts_and_stop_strings(tmp_path):
    from cooper_mcore.data.mathgen import tokenizer_corpus
    from cooper_mcore.data.tokenizer import train_tiny_tokenizer

    tok = train_tiny_tokenizer(tokenizer_corpus(300), str(tmp_path / "tok"), vocab_size=128)
    torch.manual_seed(1)
    # the model's vocabulary is the tokenizer's (about 77 of the 128 allowed): every id the random model can
    # emit is a token with text, whereas ids past the tokenizer's size decode to nothing, so whether the
    # free-running text was empty depended on how many pieces the corpus happened to yield
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = HFEngine(transformers.AutoModelForCausalLM.from_config(cfg).eval(), tok)
    free = engine.generate(["12+3="], SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True)
    # a stop string taken from the free-running text: generation stops there, the text ends before it
    assert len(free.text) >= 2
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 1]
    cut = engine.generate(["12+3="], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text) and len(cut.token_ids) <= len(free.token_ids)
    assert free.token_ids[:len(cut.token_ids)] == cut.token_ids
