"""The arithmetic task generator: values checked by Python's own arithmetic, disjoint splits."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from cooper_mcore.data.datasets import read_prompts, write_prompts
from cooper_mcore.data.mathgen import (
    MathProblem,
    MathTaskConfig,
    generate_problems,
    generate_prompts,
    parse_question,
    split_of,
    tokenizer_corpus,
    worked_solution,
)

ALL_OPS = MathTaskConfig(num_steps=3, operators=("+", "-", "*"))


def test_hand_worked_example():
    assert worked_solution("59-15-75=") == "59-15=44,44-75=-31 \\boxed{-31}"
    assert worked_solution("59-15-75=", style="gsm8k") == "59-15=44,44-75=-31 #### -31"
    p = MathProblem((59, 15, 75), ("-", "-"))
    assert (p.question, p.answer, p.steps()) == ("59-15-75=", -31, ["59-15=44", "44-75=-31"])
    q = MathProblem((3, 4, 5, 2), ("+", "*", "-"))
    assert q.question == "(3+4)*5-2="
    assert worked_solution(q) == "3+4=7,7*5=35,35-2=33 \\boxed{33}"
    assert MathProblem((2, 3, 4), ("*", "+")).question == "2*3+4="
    with pytest.raises(ValueError, match="unknown answer style"):
        worked_solution(q, style="latex")


@pytest.mark.parametrize("config", [MathTaskConfig(), ALL_OPS, MathTaskConfig(num_steps=1, operators=("*",))])
def test_values_agree_with_python_arithmetic(config):
    problems = generate_problems(300, config, seed=5)
    assert len({p.question for p in problems}) == 300
    for p in problems:
        assert p.question.endswith("=")
        assert eval(p.question[:-1]) == p.answer  # ordinary precedence, thanks to the parentheses
        assert len(p.ops) == config.num_steps and set(p.ops) <= set(config.operators)
        assert all(config.min_operand <= a <= config.max_operand for a in p.operands)
        steps = p.steps()
        for i, step in enumerate(steps):  # each step is a true equation, chained on the previous result
            lhs, rhs = step.rsplit("=", 1)
            assert eval(lhs) == int(rhs)
            if i:
                assert lhs.startswith(steps[i - 1].rsplit("=", 1)[1])
        for style, marker in (("boxed", f" \\boxed{{{p.answer}}}"), ("gsm8k", f" #### {p.answer}")):
            sol = worked_solution(p.question, style)  # from the text alone
            assert sol == ",".join(steps) + marker
            assert re.fullmatch(r"[0-9+\-*=,() ]*(\\boxed\{-?\d+\}|#### -?\d+)", sol)
        assert parse_question(p.question) == p


def test_deterministic_and_seeded():
    a = generate_problems(50, ALL_OPS, seed=1)
    assert generate_problems(50, ALL_OPS, seed=1) == a
    assert generate_problems(50, ALL_OPS, seed=2) != a


def test_splits_are_disjoint_and_partition_the_space():
    small = MathTaskConfig(num_steps=1, min_operand=0, max_operand=9, operators=("+", "-"), held_out_fraction=0.25)
    assert small.num_questions() == 200
    train = {p.question for p in generate_problems(120, small, "train", seed=0)}
    test = {p.question for p in generate_problems(30, small, "test", seed=0)}
    assert len(train) == 120 and len(test) == 30 and not train & test
    everything = [MathProblem((a, b), (op,)).question for a, b, op in itertools.product(range(10), range(10), "+-")]
    held = [q for q in everything if split_of(q, small) == "test"]
    assert 25 <= len(held) <= 75  # about a quarter of 200
    assert test <= set(held) and not train & set(held)
    other_seed = dataclasses.replace(small, split_seed=1)
    assert [split_of(q, other_seed) for q in everything] != [split_of(q, small) for q in everything]
    corpus = set(tokenizer_corpus(100, small, styles=("boxed",)))
    assert not corpus & set(held)  # the tokenizer corpus comes from the train split only


def test_prompts_and_jsonl_round_trip(tmp_path):
    prompts = generate_prompts(20, ALL_OPS, "test", seed=3)
    assert prompts[0].id == "mathgen-test-0" and prompts[0].source == "mathgen"
    assert all(eval(p.question[:-1]) == int(p.answer) for p in prompts)
    path = str(tmp_path / "math.jsonl")
    write_prompts(prompts, path)
    assert read_prompts(path) == (prompts, 0)


def test_errors():
    with pytest.raises(ValueError, match="min_operand must be >= 0"):
        generate_problems(1, MathTaskConfig(min_operand=-1))
    with pytest.raises(ValueError, match="operators must be a non-empty subset"):
        generate_problems(1, MathTaskConfig(operators=("/",)))
    with pytest.raises(ValueError, match="num_steps"):
        generate_problems(1, MathTaskConfig(num_steps=0))
    with pytest.raises(ValueError, match="cannot draw 100 distinct test problems"):
        generate_problems(100, MathTaskConfig(num_steps=1, max_operand=9), "test")
    with pytest.raises(ValueError, match="unknown split"):
        generate_problems(1, split="dev")
    for bad in ("2+3*4=", "1+1", "a+b=", "(1+2)=", "-1+2="):
        with pytest.raises(ValueError, match="not a mathgen question"):
            parse_question(bad)
