"""Prompt templates and the VerifyRM input format with the paper's truncation."""

from __future__ import annotations

import pytest

from cooper_mcore.data.templates import (
    RM_TEMPLATE,
    apply_prompt_template,
    rm_input,
    rm_question,
    template_prompts,
    truncate_completion,
)
from cooper_mcore.types import Prompt


class _FakeChatTokenizer:
    """Records the messages it is given; renders them in a fixed, hand-checkable way."""

    chat_template = "fake"
    name_or_path = "fake"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls.append((messages, add_generation_prompt, tokenize))
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text] + ([0] if add_special_tokens else [])}


def test_format_template_replaces_only_the_placeholder():
    t = "Solve: {question} Put the answer in \\boxed{}. Repeat: {question}"
    assert apply_prompt_template("1+2=", t) == "Solve: 1+2= Put the answer in \\boxed{}. Repeat: 1+2="
    assert apply_prompt_template("{x}") == "{x}"  # the default template is the question itself
    with pytest.raises(ValueError, match="has no {question} placeholder"):
        apply_prompt_template("q", "Solve: {q}")
    with pytest.raises(ValueError, match="system_prompt"):
        apply_prompt_template("q", system_prompt="be brief")


def test_chat_template_gets_one_user_turn():
    tok = _FakeChatTokenizer()
    text = apply_prompt_template("1+2=", "Q: {question}", tok, use_chat_template=True, system_prompt="S")
    assert text == "[system]S[user]Q: 1+2=[assistant]"
    assert tok.calls == [([{"role": "system", "content": "S"}, {"role": "user", "content": "Q: 1+2="}], True, False)]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        apply_prompt_template("q", use_chat_template=True)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        apply_prompt_template("q", tokenizer=tok, use_chat_template=True)


def test_template_prompts_fills_text_and_tokens():
    prompts = [Prompt(id="a", question="1+1=", answer="2"), Prompt(id="b", question="2+2=", answer="4")]
    tok = _FakeChatTokenizer()
    out = template_prompts(prompts, "<{question}>", tok, tokenize=True)
    assert out[0] is prompts[0]
    assert [p.text for p in prompts] == ["<1+1=>", "<2+2=>"]
    assert prompts[1].token_ids == [ord(c) for c in "<2+2=>"] + [0]  # plain text: special tokens added
    template_prompts(prompts, tokenizer=tok, use_chat_template=True, tokenize=True)
    assert prompts[0].text == "[user]1+1=[assistant]"
    assert prompts[0].token_ids == [ord(c) for c in prompts[0].text]  # chat text: none added
    with pytest.raises(ValueError, match="needs a tokenizer"):
        template_prompts(prompts, tokenize=True)


def test_rm_input_exact_format():
    assert rm_input("What is 2+2?", "4", "2+2=4 \\boxed{4}") == (
        "<question>What is 2+2?</question>\n<reference_answer>4</reference_answer>\n"
        "<completion>2+2=4 \\boxed{4}</completion>"
    )
    # braces in the texts are kept (no str.format on user text)
    assert rm_input("{a}", "{b}", "{c}") == "<question>{a}</question>\n<reference_answer>{b}</reference_answer>\n" \
        "<completion>{c}</completion>"
    assert rm_input("q", "r", "c") == RM_TEMPLATE.format(q="q", ref="r", c="c")


def test_truncation_boundary_1500_vs_1501():
    exactly = "".join(chr(ord("a") + i % 26) for i in range(1500))
    assert truncate_completion(exactly) == exactly
    assert rm_input("q", "r", exactly).endswith("<completion>" + exactly + "</completion>")

    # 1501 characters: 500 'H' head, then 1 'M' that must be cut, then 1000 'T' tail
    longer = "H" * 500 + "M" + "T" * 1000
    assert len(longer) == 1501
    assert truncate_completion(longer) == "H" * 500 + "T" * 1000
    assert rm_input("q", "r", longer) == (
        "<question>q</question>\n<reference_answer>r</reference_answer>\n<completion>"
        + "H" * 500 + "T" * 1000 + "</completion>"
    )
    assert rm_input("q", "r", longer, truncate=False).count("M") == 1

    # a long completion: first 500 and last 1000 characters by position
    digits = "".join(str(i % 10) for i in range(4000))
    cut = truncate_completion(digits)
    assert len(cut) == 1500
    assert cut[:500] == digits[:500] and cut[500:] == digits[3000:]


def test_reference_answer_is_truncated_like_the_completion():
    long_ref = "R" * 500 + "X" + "S" * 1000  # 1501 characters: the X is cut
    assert rm_input("q", long_ref, "c") == (
        "<question>q</question>\n<reference_answer>" + "R" * 500 + "S" * 1000
        + "</reference_answer>\n<completion>c</completion>"
    )
    # the earlier behaviour (completion only) stays reachable
    assert "X" in rm_input("q", long_ref, "c", truncate_reference=False)
    # no truncation at all
    assert "X" in rm_input("q", long_ref, "c", truncate=False)
    assert rm_input("q", "r" * 1500, "c") == rm_input("q", "r" * 1500, "c", truncate_reference=False)


def test_rm_question_is_the_policy_prompt_without_chat_template():
    template = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
    expected_q = "What is 2+2?\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert rm_question("What is 2+2?", template) == expected_q
    assert rm_question("What is 2+2?") == "What is 2+2?"
    assert rm_input("What is 2+2?", "4", "\\boxed{4}", question_template=template) == (
        "<question>" + expected_q + "</question>\n<reference_answer>4</reference_answer>\n"
        "<completion>\\boxed{4}</completion>"
    )
    assert rm_input("What is 2+2?", "4", "c") == rm_input("What is 2+2?", "4", "c", question_template=None)
    with pytest.raises(ValueError, match="placeholder"):
        rm_input("q", "r", "c", question_template="no placeholder")
