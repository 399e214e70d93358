"""The tiny sentencepiece tokenizer: AutoTokenizer loading, exact round trips, stable special ids."""

from __future__ import annotations

import json
import os
import random

import pytest
import sentencepiece as spm
import transformers

from cooper_mcore.data.mathgen import MathTaskConfig, generate_problems, tokenizer_corpus, worked_solution
from cooper_mcore.data.templates import apply_prompt_template
from cooper_mcore.data.tokenizer import SPECIAL_TOKENS, SPM_FILE, tokenizer_size, train_tiny_tokenizer, widen_tokenizer

CONFIG = MathTaskConfig(num_steps=3, operators=("+", "-", "*"))


@pytest.fixture(scope="module")
def corpus():
    return tokenizer_corpus(600, CONFIG, seed=0)


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def trained(request, corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(f"tok-{request.param}"))
    returned = train_tiny_tokenizer(corpus, out, vocab_size=128, model_type=request.param)
    return out, returned


def _held_out_texts():
    texts = []
    for p in generate_problems(100, CONFIG, "test", seed=9):  # never seen in training
        texts += [p.question, worked_solution(p), worked_solution(p, "gsm8k")]
    return texts + ["59-15-75=", "59-15=44,44-75=-31 \\boxed{-31}", "  1,  2   3  ", "-0 -1 --2", "\\boxed{}"]


def test_autotokenizer_loads_offline_with_special_tokens(trained):
    out, returned = trained
    assert {"tokenizer.json", "tokenizer_config.json", SPM_FILE} <= set(os.listdir(out))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(returned) <= 128
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 4)
    assert (tok.bos_token, tok.bos_token_id) == ("<|endoftext|>", 1)
    assert tok.unk_token_id == 2
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    # special tokens written in text are single tokens; nothing is added automatically
    assert tok("<|im_start|>1<|im_end|>")["input_ids"] == [3, tok.convert_tokens_to_ids("1"), 4]
    assert tok("7")["input_ids"] == tok("7", add_special_tokens=False)["input_ids"]


def test_round_trip_exact_and_same_segmentation_as_sentencepiece(trained):
    out, tok = trained
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, SPM_FILE))
    for text in _held_out_texts():
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids) == text
        assert ids == sp.encode(text), text  # the HF tokenizer segments exactly like sentencepiece
    digits = tok.tokenize("1234567890")
    assert digits == list("1234567890")  # split_digits: one token per digit
    batch = tok(["1+1=", "12*34-5="], padding=True)
    assert batch["input_ids"][0][-1] == 0 and batch["attention_mask"][0][-1] == 0  # right-padded with <|pad|>


def test_chat_template_renders(trained):
    _, tok = trained
    text = apply_prompt_template("59-15-75=", tokenizer=tok, use_chat_template=True)
    assert text == "<|im_start|>user\n59-15-75=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert ids[0] == 3 and ids.count(4) == 1
    with_system = tok.apply_chat_template([{"role": "system", "content": "1"}, {"role": "user", "content": "2"}],
                                          tokenize=False)
    assert with_system == "<|im_start|>system\n1<|im_end|>\n<|im_start|>user\n2<|im_end|>\n"


def test_deterministic_required_chars_and_errors(corpus, tmp_path):
    a = train_tiny_tokenizer(corpus[:300], str(tmp_path / "a"), vocab_size=64)
    b = train_tiny_tokenizer(corpus[:300], str(tmp_path / "b"), vocab_size=64)
    assert a.get_vocab() == b.get_vocab() and len(a) <= 64
    c = train_tiny_tokenizer(["1+1=2"], str(tmp_path / "c"), vocab_size=64, required_chars="Qz?")
    for text in ("Qz? 1+1=2", "zQ ??11+1="):
        ids = c(text)["input_ids"]
        assert c.unk_token_id not in ids and c.decode(ids) == text
    assert c("%")["input_ids"] == [c.unk_token_id]  # no byte fallback: unseen characters are <unk>
    with pytest.raises(ValueError, match="vocab_size=20 is too small"):
        train_tiny_tokenizer(corpus, str(tmp_path / "d"), vocab_size=20)
    with pytest.raises(ValueError, match="no non-empty training text"):
        train_tiny_tokenizer(["", ""], str(tmp_path / "e"))
    with pytest.raises(ValueError, match="unknown tokenizer model_type"):
        train_tiny_tokenizer(corpus, str(tmp_path / "f"), model_type="wordpiece")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_segmentation_matches_sentencepiece_on_ambiguous_text(model_type, tmp_path):
    """Random words over {a, b}: many overlapping pieces, so merge order and scores matter."""
    rng = random.Random(0)

    def words(n):
        return " ".join("".join(rng.choice("aab") for _ in range(rng.randint(1, 7))) for _ in range(n))

    train, test = [words(8) for _ in range(300)], [words(8) for _ in range(100)]
    tok = train_tiny_tokenizer(train, str(tmp_path), vocab_size=64, model_type=model_type)
    assert len(tok) == 64  # enough pieces here to fill the vocabulary
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / SPM_FILE))
    for text in test:
        ids = tok(text)["input_ids"]
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text


def test_a_widened_tokenizer_reads_every_sampled_id_back(corpus, tmp_path):
    """Random weights at a real shape sample ids all over the vocabulary: each must decode to text
    that tokenizes back to it (the reward model then reads completions as long as they were
    generated), while the tiny tokenizer's own texts tokenize as before."""
    src = tmp_path / "tiny"
    tiny = train_tiny_tokenizer(corpus[:300], str(src), vocab_size=64)
    wide = widen_tokenizer(str(src), str(tmp_path / "wide"), 151_936)
    assert tokenizer_size(wide) == len(wide) == 151_936
    assert not (tmp_path / "wide" / SPM_FILE).exists() and (tmp_path / "wide" / "tokenizer_config.json").exists()
    for text in corpus[:50]:
        assert wide(text)["input_ids"] == tiny(text)["input_ids"]
    fresh = random.Random(0).choices(range(len(tiny), 151_936), k=512)  # (the tiny pieces may merge when adjacent)
    assert wide(wide.decode(fresh), add_special_tokens=False)["input_ids"] == fresh
    assert wide.eos_token_id == tiny.eos_token_id and wide.pad_token_id == tiny.pad_token_id
    with pytest.raises(ValueError, match="vocab_size=10 must be between"):
        widen_tokenizer(str(src), str(tmp_path / "small"), 10)
    with pytest.raises(ValueError, match="no BPE tokenizer.json"):
        widen_tokenizer(str(tmp_path), str(tmp_path / "none"), 1000)
