"""The demo's two-family task and the pieces it stands on: the task's oracle (``answer_value``,
``verify/oracle.py``), math-verify's miss of ``\\boxed{N.}`` (the premise), the references the rule cannot
read whatever the policy writes, per-step operators,
:class:`~cooper_mcore.demo.task.DemoTask` and the tokenizer's isolated characters.

Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import math
import random

import pytest

from cooper_mcore.data.mathgen import (
    MathProblem,
    MathTaskConfig,
    answer_form,
    answer_value,
    format_answer,
    generate_problems,
    parse_question,
    reference_value,
    split_of,
    tokenizer_corpus,
    unreadable_reference,
    worked_solution,
)
from cooper_mcore.data.tokenizer import train_tiny_tokenizer
from cooper_mcore.demo.task import FAMILIES, ISOLATE, DemoTask, family_of, form_shares, like_reference
from cooper_mcore.verify.oracle import ArithmeticOracle, oracle_correct
from cooper_mcore.verify.rule import check_pair

TIMES = MathTaskConfig(num_steps=2, max_operand=9, step_operators=(("*",), ("+", "-")))
#: 3*4-5= worked in each form: 3*4=12,12-5=7
THREE_FOUR_FIVE = MathProblem((3, 4, 5), ("*", "-"))


# ----------------------------------------------------------------------------- the task's oracle


@pytest.mark.parametrize("completion,value,form", [
    ("3*4=12,12-5=7 \\boxed{7}", 7, "boxed"),
    ("9+5=14 \\boxed{14.}", 14, "boxed_period"),  # the times family's convention
    ("1-4=-3 \\boxed{-3}", -3, "boxed"),
    ("1-4=-3 \\boxed{-3.}", -3, "boxed_period"),
    ("\\boxed{6.} then \\boxed{-4}", -4, "boxed"),  # two boxes: the last one is the answer
    ("\\boxed{6} then \\boxed{5.}", 5, "boxed_period"),
    ("7-1=6,6-1=5", None, "none"),  # no box: no answer, although 5 is the last number
    ("\\boxed{1.5}", None, "none"),  # not an integer answer of the task
    ("", None, "none"),
])
def test_answer_value_and_form(completion, value, form):
    assert answer_value(completion) == value
    assert answer_form(completion) == form


def test_format_answer_and_worked_solution_write_the_period_form():
    assert format_answer(-31, "boxed_period") == "\\boxed{-31.}"
    assert worked_solution(THREE_FOUR_FIVE, "boxed_period") == "3*4=12,12-5=7 \\boxed{7.}"
    assert worked_solution("3*4-5=", "boxed") == "3*4=12,12-5=7 \\boxed{7}"


def test_oracle_correct_reads_both_forms_and_needs_integer_golds():
    assert oracle_correct("14", "9+5=14 \\boxed{14.}") is True
    assert oracle_correct(" 14 ", "\\boxed{14}") is True  # the gold is stripped
    assert oracle_correct("-3", "\\boxed{-3.}") is True
    assert oracle_correct("14", "\\boxed{14} \\boxed{15.}") is False  # the last box answers
    assert oracle_correct("14", "9+5=14") is False  # no final answer
    for gold in ("14.0", "x", "1/2", "", "\\boxed{14} or \\boxed{15}", "fourteen"):
        with pytest.raises(ValueError, match="integer gold"):
            oracle_correct(gold, "\\boxed{14}")


@pytest.mark.parametrize("reference,value", [
    ("14", 14), (" -3 ", -3), ("\\boxed{14.}", 14), ("\\boxed{-3}", -3),  # bare, or one boxed answer
    ("\\text{14.}", 14), ("\\text{-3.}", -3), ("\\text{14}", None),  # the rule-unreadable form
    ("14.", None), ("\\boxed{14.} \\boxed{15}", None), ("\\boxed{1.5}", None), ("fourteen", None), ("", None),
])
def test_reference_value(reference, value):
    assert reference_value(reference) == value


def test_the_oracle_reads_a_reference_the_rule_cannot():
    """The demo writes some references ``\\text{N.}``: math-verify cannot read them (the item is
    unverifiable for the rule), the oracle reads both the reference and the answer."""
    assert unreadable_reference(14) == "\\text{14.}" and unreadable_reference(-3) == "\\text{-3.}"
    assert check_pair("\\text{14.}", "9+5=14 \\boxed{14}")[:2] == (None, "gold_unreadable")
    assert oracle_correct("\\text{14.}", "9+5=14 \\boxed{14}") is True
    assert oracle_correct("\\text{14.}", "9+5=14 \\boxed{14.}") is True
    assert oracle_correct("\\text{14.}", "9+5=15 \\boxed{15}") is False


#: answers of the demo's task: negative (down to 0-9-9), zero, one and two digits (up to 9*9+9)
TASK_ANSWERS = (-18, -3, 0, 7, 14, 90)


@pytest.mark.parametrize("value", TASK_ANSWERS)
def test_the_rule_cannot_verify_an_unreadable_reference_whatever_the_policy_writes(value):
    """Against ``\\text{N.}`` the rule says neither right nor wrong (``gold_unreadable``) for every answer
    the policy writes in the task's forms (``\\boxed{N}``, ``\\boxed{N.}``, ``#### N``, worked or bare,
    right or wrong, or none): math-verify matches it only with the same ``\\text{}``, which the policy never
    writes. A ``\\boxed{N.}`` reference would not do: the ``times`` convention writes that very string."""
    ref = unreadable_reference(value)
    steps = "9*9=81,81+9=" + str(value)
    completions = [f"{steps} {format_answer(v, style)}" for v in (value, value + 1, -value - 1)
                   for style in ("boxed", "boxed_period", "gsm8k")]
    completions += [format_answer(value, "boxed_period"), str(value), f"{value}.", steps, "", f"\\boxed{{{value}..}}"]
    for completion in completions:
        assert check_pair(ref, completion)[:2] == (None, "gold_unreadable"), (ref, completion)
    assert check_pair(ref, f"\\boxed{{{ref}}}")[0] is True  # the same text: math-verify matches strings
    assert check_pair(format_answer(value, "boxed_period"), f"{steps} {format_answer(value, 'boxed_period')}")[0]


def test_arithmetic_oracle_batch():
    with ArithmeticOracle() as oracle:
        outs = oracle.verify_batch(["14", "14", "14", "-3"],
                                   ["\\boxed{14.}", "\\boxed{15}", "the sum is 14", "1-4=-3 \\boxed{-3}"])
    assert [(o.correct, o.answered, o.status) for o in outs] == [
        (True, True, "ok"), (False, True, "ok"), (False, False, "ok"), (True, True, "ok")]
    assert oracle.verify_batch([], []) == []
    with pytest.raises(ValueError, match="2 gold answers for 1 completions"):
        oracle.verify_batch(["1", "2"], ["\\boxed{1}"])
    with pytest.raises(ValueError, match="integer gold"):
        oracle.verify_batch(["1.5"], ["\\boxed{1}"])


def test_math_verify_misses_the_period_form_the_premise():
    """The premise's fact: math-verify does not read ``\\boxed{14.}`` as a number (a wrong verdict,
    nothing answered) but reads ``\\boxed{14}``; the oracle reads both."""
    assert check_pair("14", "\\boxed{14.}") == (False, "ok", None, False)
    assert check_pair("14", "\\boxed{14}") == (True, "ok", None, True)
    period, plain = worked_solution(THREE_FOUR_FIVE, "boxed_period"), worked_solution(THREE_FOUR_FIVE, "boxed")
    assert check_pair("7", period) == (False, "ok", None, False)  # the task's own correct solution, missed
    assert check_pair("7", plain) == (True, "ok", None, True)
    assert oracle_correct("7", period) and oracle_correct("7", plain)


# ----------------------------------------------------------------------------- per-step operators


def test_step_operators_shape_the_problems():
    # 10 choices per operand (0..9), 3 operands, 1 operator choice then 2: 10*10*10*1*2
    assert TIMES.num_questions() == 2000
    assert TIMES.operator_choices() == [["*"], ["+", "-"]]
    problems = generate_problems(300, TIMES, "train", seed=3)
    assert len({p.question for p in problems}) == 300
    assert all(p.ops[0] == "*" and p.ops[1] in "+-" for p in problems)
    assert {p.ops[1] for p in problems} == {"+", "-"}
    for p in problems:  # a*b+c= needs no parentheses; the value is Python's
        assert "(" not in p.question and eval(p.question[:-1]) == p.answer
    # step_operators override operators: (a-b)*c=
    other = MathTaskConfig(num_steps=2, operators=("+",), step_operators=(("-",), ("*",)))
    assert other.num_questions() == 100 ** 3
    assert {p.ops for p in generate_problems(50, other, seed=0)} == {("-", "*")}
    assert all(p.question.startswith("(") for p in generate_problems(50, other, seed=0))
    # without step_operators every step draws from operators
    assert MathTaskConfig(num_steps=2, operators=("-", "+", "-")).operator_choices() == [["+", "-"], ["+", "-"]]


@pytest.mark.parametrize("step_operators", [
    (("*",),),  # one step's choices for two steps
    (("*",), ("+",), ("-",)),
    (("*",), ()),  # an empty choice
    (("*",), ("/",)),  # an unknown operator
])
def test_step_operators_are_validated(step_operators):
    config = MathTaskConfig(num_steps=2, step_operators=step_operators)
    with pytest.raises(ValueError, match="step_operators"):
        config.validate()
    with pytest.raises(ValueError, match="step_operators"):
        generate_problems(1, config)


# ----------------------------------------------------------------------------- DemoTask


def test_family_of_and_form_shares():
    assert family_of("7-1-1=") == "plus_minus" and family_of("3*4-5=") == "times"
    assert family_of("(3+4)*5=") == "times"
    shares = form_shares(["\\boxed{1}", "\\boxed{2.}", "\\boxed{3.}", "no answer"])
    assert shares == {"boxed": 0.25, "boxed_period": 0.5, "none": 0.25}
    assert all(math.isnan(v) for v in form_shares([]).values())


@pytest.mark.parametrize("times_share,n,n_times", [
    (1 / 3, 30, 10), (1 / 3, 100, 33), (0.33, 512, 169), (0.0, 40, 0), (1.0, 40, 40)])
def test_problems_hold_the_families_in_their_shares(times_share, n, n_times):
    task = DemoTask(times_share=times_share)
    problems = task.problems(n, "test", seed=0)
    families = [family_of(p.question) for p in problems]
    assert len({p.question for p in problems}) == n
    assert families.count("times") == n_times == round(times_share * n)
    cfg = task.configs()
    for p, fam in zip(problems, families):
        if fam == "times":
            assert p.ops[0] == "*" and p.ops[1] in "+-"
        else:
            assert set(p.ops) <= {"+", "-"} and len(p.ops) == 2
        assert all(0 <= a <= 9 for a in p.operands)
        assert split_of(p.question, cfg[fam]) == "test"
    if 0 < n_times < n:  # shuffled: the families are interleaved, not one block after the other
        first_times = families.index("times")
        assert "plus_minus" in families[first_times:]


def test_problems_train_and_test_are_disjoint_and_deterministic():
    task = DemoTask()
    train, test = task.problems(600, "train", seed=0), task.problems(200, "test", seed=0)
    assert not {p.question for p in train} & {p.question for p in test}
    assert task.problems(200, "test", seed=0) == test  # the same seed: the same list, same order
    assert task.problems(200, "test", seed=1) != test


def test_prompts_are_the_problems():
    task = DemoTask()
    problems, prompts = task.problems(12, "train", seed=4), task.prompts(12, "train", seed=4)
    assert [(p.id, p.question, p.answer) for p in prompts] == [
        (f"mathgen-train-{i}", q.question, str(q.answer)) for i, q in enumerate(problems)]


def test_task_shares_are_validated():
    for kwargs in ({"times_share": -0.1}, {"times_share": 1.5}, {"times_parseable": 2.0}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"task.{name} must be in"):
            DemoTask(**kwargs)


def test_style_is_the_families_convention():
    task = DemoTask(times_parseable=0.1)
    plus_minus, times = MathProblem((7, 1, 1), ("-", "-")), THREE_FOUR_FIVE
    rng = random.Random(0)
    assert {task.style(plus_minus, rng) for _ in range(1000)} == {"boxed"}
    draws = 4000
    boxed = sum(task.style(times, rng) == "boxed" for _ in range(draws))
    # binomial(4000, 0.1): mean 400, sd sqrt(4000 * 0.1 * 0.9) = 19.0; 4 sd either side
    sd = math.sqrt(draws * 0.1 * 0.9)
    assert abs(boxed - 400) <= 4 * sd
    assert {DemoTask(times_parseable=0.0).style(times, rng) for _ in range(200)} == {"boxed_period"}
    assert {DemoTask(times_parseable=1.0).style(times, rng) for _ in range(200)} == {"boxed"}


# ----------------------------------------------------------------------------- tokenizer and SFT examples


@pytest.fixture(scope="module")
def small_corpus():
    cfg = DemoTask().configs()
    return (tokenizer_corpus(300, cfg["plus_minus"], 0, styles=("boxed",))
            + tokenizer_corpus(300, cfg["times"], 0, styles=("boxed", "boxed_period")))


def _contains(ids, part):
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_isolated_characters_make_a_number_the_same_tokens_everywhere(small_corpus, tmp_path):
    tok = train_tiny_tokenizer(small_corpus, str(tmp_path / "iso"), vocab_size=96, isolate=ISOLATE)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    number = ids("-13")
    assert tok.convert_ids_to_tokens(number) == ["-", "1", "3"]
    for text in ("=-13", "\\boxed{-13}", "\\boxed{-13.}", "12-25=-13 \\boxed{-13.}"):
        assert _contains(ids(text), number), (text, tok.convert_ids_to_tokens(ids(text)))
        assert tok.decode(ids(text)) == text
    for ch in ISOLATE:  # each a token of its own
        assert len(ids(ch)) == 1
    # what isolate fixes: on this corpus, without it '=-' (and '{-') merge, so '-13' after '=' is other tokens
    plain = train_tiny_tokenizer(small_corpus, str(tmp_path / "plain"), vocab_size=96)
    minus13 = plain("-13", add_special_tokens=False)["input_ids"]
    assert not _contains(plain("=-13", add_special_tokens=False)["input_ids"], minus13)


@pytest.fixture(scope="module")
def task_tokenizer(tmp_path_factory):
    """The demo's tokenizer: the task's corpus, vocabulary 96, the isolated characters."""
    out = str(tmp_path_factory.mktemp("demo-tok"))
    return train_tiny_tokenizer(DemoTask().tokenizer_corpus(0), out, vocab_size=96, isolate=ISOLATE)


def _decoded(tok, examples):
    """(prompt text, response text) per example; the response ends in EOS."""
    out = []
    for prompt, response in examples:
        assert response[-1] == tok.eos_token_id
        out.append((tok.decode(prompt), tok.decode(response[:-1])))
    return out


def test_sft_examples_are_worked_solutions_in_the_families_conventions(task_tokenizer):
    task, n, seed = DemoTask(), 30, 3
    examples = task.sft_examples(task_tokenizer, n, seed=seed, mix_wrong=0.2)
    problems = task.problems(n, "train", seed)  # the examples' problems, in order
    texts = _decoded(task_tokenizer, examples)
    assert [q for q, _ in texts] == [p.question for p in problems]
    right = [answer_value(c) == p.answer for (_, c), p in zip(texts, problems)]
    assert sum(right) == n - round(0.2 * n) == 24  # the wrong solutions never end in the right answer
    for ok, (_, completion), p in zip(right, texts, problems):
        form = answer_form(completion)
        assert form != "none"  # wrong ones are boxed too
        if family_of(p.question) == "plus_minus":
            assert form == "boxed"
        if ok:
            assert completion == worked_solution(p, form)
    assert task.sft_examples(task_tokenizer, n, seed=seed, mix_wrong=0.2) == examples  # deterministic


@pytest.mark.parametrize("parseable,times_form", [(0.0, "boxed_period"), (1.0, "boxed")])
def test_sft_examples_times_form_follows_times_parseable(task_tokenizer, parseable, times_form):
    task = DemoTask(times_parseable=parseable)
    problems = task.problems(24, "train", 5)
    texts = _decoded(task_tokenizer, task.sft_examples(task_tokenizer, 24, seed=5, mix_wrong=0.0))
    assert {family_of(p.question) for p in problems} == set(FAMILIES)  # 8 times problems of 24
    for (_, completion), p in zip(texts, problems):
        form = times_form if family_of(p.question) == "times" else "boxed"
        assert completion == worked_solution(p, form)


def test_single_family_task_has_only_plus_minus(task_tokenizer):
    task = DemoTask(times_share=0.0)
    assert {family_of(p.question) for p in task.problems(60, "train", 0)} == {"plus_minus"}
    texts = _decoded(task_tokenizer, task.sft_examples(task_tokenizer, 20, seed=0, mix_wrong=0.0))
    assert all(answer_form(c) == "boxed" for _, c in texts)


def test_task_corpus_tokenizes_both_families_and_the_rm_template(task_tokenizer):
    from cooper_mcore.data.templates import rm_input

    texts = [worked_solution(THREE_FOUR_FIVE, "boxed_period"), "7-1-1=", rm_input("3*4-5=", "7", "\\boxed{7.}"),
             rm_input("3*4-5=", unreadable_reference(-7), "\\boxed{7}")]  # the rule-unreadable reference too
    for text in texts:
        ids = task_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert task_tokenizer.unk_token_id not in ids and task_tokenizer.decode(ids) == text


def test_a_share_of_the_references_is_unreadable_by_a_hash_of_the_question():
    """task.unreadable_share of the problems, both families and both splits, have the reference
    ``\\text{N.}``: the rule verifier cannot read it, the oracle reads the same value."""
    task = DemoTask(unreadable_share=0.3)
    for split in ("train", "test"):
        prompts = task.prompts(600, split, seed=4)
        unreadable = [p for p in prompts if task.rule_unreadable(p.question)]
        assert 0.24 < len(unreadable) / 600 < 0.36  # 0.3 of 600 with a binomial sd of 0.019
        assert {family_of(p.question) for p in unreadable} == {"plus_minus", "times"}
        for p in prompts:
            value = parse_question(p.question).answer
            assert p.answer == (f"\\text{{{value}.}}" if task.rule_unreadable(p.question) else str(value))
            assert reference_value(p.answer) == value
    assert task.rule_unreadable("3*4-5=") == DemoTask(unreadable_share=0.3, times_share=0.0).rule_unreadable("3*4-5=")
    assert not any(DemoTask().rule_unreadable(p.question) for p in DemoTask().prompts(100, "test", 0))  # default 0
    assert DemoTask(unreadable_share=0.3).groups_of("3*4-5=") in (("times",), ("times", "rule_unreadable"))
    assert like_reference("\\text{7.}", -3) == "\\text{-3.}" and like_reference("7", -3) == "-3"
    with pytest.raises(ValueError, match="unreadable_share"):
        DemoTask(unreadable_share=1.5)
