"""ChainRewrite, the offline assistant-like negatives of the arithmetic-chain task: each kind's
rewrites enumerated by hand, the verifier's veto, and math-verify (through the rule verifier)
calling them wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from cooper_mcore.data.mathgen import MathTaskConfig, generate_problems, worked_solution
from cooper_mcore.negatives.pairs import make_negative_generator
from cooper_mcore.negatives.rewrites import STEP_SLIPS, ChainRewrite, parse_chain
from cooper_mcore.types import Prompt

pytestmark = pytest.mark.timeout(120)

CHAIN = "59-15=44,44-75=-31 \\boxed{-31}"


@dataclass
class Verdict:
    correct: Optional[bool]


class BoxedVerifier:
    """Compares the last \\boxed{...} (or the token after '####') with the gold string."""

    def verify_batch(self, golds, preds):
        out = []
        for g, p in zip(golds, preds):
            if "\\boxed{" in p:
                ans = p.rsplit("\\boxed{", 1)[1].split("}", 1)[0]
            elif "####" in p:
                ans = p.rsplit("####", 1)[1].strip()
            else:
                out.append(Verdict(None))
                continue
            out.append(Verdict(ans == g))
        return out


class AlwaysCorrect:
    def verify_batch(self, golds, preds):
        return [Verdict(True) for _ in preds]


def draws(gen: ChainRewrite, text: str, kind: str, n: int = 200) -> set[Optional[str]]:
    return {gen.rewrite(text, kind) for _ in range(n)}


def test_parse_chain():
    steps, span = parse_chain(CHAIN)
    assert [(s.a, s.op, s.b, s.r) for s in steps] == [(59, "-", 15, 44), (44, "-", 75, -31)]
    assert CHAIN[span[0]:span[1]] == "-31"
    steps, _ = parse_chain("3+4=7,7*5=35,35-40=-5 #### -5")
    assert [(s.a, s.op, s.b, s.r) for s in steps] == [(3, "+", 4, 7), (7, "*", 5, 35), (35, "-", 40, -5)]
    assert parse_chain("59-15=45,45-75=-30 \\boxed{-30}") is None  # a wrong step: not a clean chain
    assert parse_chain("59-15=44,40-75=-35 \\boxed{-35}") is None  # not chained
    assert parse_chain("59-15=44,44-75=-31 \\boxed{44}") is None  # final is not the last result
    assert parse_chain("the answer is \\boxed{3}") is None


def test_step_slip_carries_on_consistently():
    gen = ChainRewrite(BoxedVerifier(), seed=0)
    # step 1 off by d: 59-15=(44+d),(44+d)-75=(-31+d); step 2 off by d: 59-15=44,44-75=(-31+d)
    expected = {f"59-15={44 + d},{44 + d}-75={-31 + d} \\boxed{{{-31 + d}}}" for d in STEP_SLIPS}
    expected |= {f"59-15=44,44-75={-31 + d} \\boxed{{{-31 + d}}}" for d in STEP_SLIPS}
    assert len(expected) == 12
    assert draws(gen, CHAIN, "step", 400) == expected
    # a product later in the chain is recomputed from the slipped value: 3+4=8 -> 8*5=40 -> 40-2=38
    three = "3+4=7,7*5=35,35-2=33 \\boxed{33}"
    assert "3+4=8,8*5=40,40-2=38 \\boxed{38}" in draws(gen, three, "step", 400)
    assert "3+4=7,7*5=35,35-2=43 \\boxed{43}" in draws(gen, three, "step", 400)


def test_copy_and_final_kinds():
    gen = ChainRewrite(BoxedVerifier(), seed=1)
    assert draws(gen, CHAIN, "copy") == {"59-15=44,44-75=-31 \\boxed{44}"}
    assert draws(gen, "7+5=12 \\boxed{12}", "copy") == {"7+5=12 \\boxed{7}", "7+5=12 \\boxed{5}"}  # operands
    # final: the chain untouched, the final line a near miss of -31 (+-1, +-2, +-10, doubled, sign, digit swap)
    near = {-30, -32, -29, -33, -21, -41, -62, 31, -13}
    assert draws(gen, CHAIN, "final") == {f"59-15=44,44-75=-31 \\boxed{{{v}}}" for v in near}
    # GSM8K style
    assert draws(gen, "59-15=44,44-75=-31 #### -31", "copy") == {"59-15=44,44-75=-31 #### 44"}
    # a text that is not a clean chain gets the final kind only
    assert draws(gen, "so the answer is \\boxed{12}", "step") == {None}
    assert draws(gen, "so the answer is \\boxed{12}", "copy") == {None}
    assert None not in draws(gen, "so the answer is \\boxed{12}", "final")
    assert draws(gen, "no answer", "final") == {None}


def test_generate_keeps_the_first_verified_wrong_and_counts_kinds():
    gen = ChainRewrite(BoxedVerifier(), seed=3, kinds=("copy",))
    out = gen.generate([(Prompt("a", "59-15-75=", "-31"), CHAIN), (Prompt("b", "q", "4"), "no answer here")])
    assert out == ["59-15=44,44-75=-31 \\boxed{44}", None]
    assert gen.stats == {"requested": 2, "accepted": 1, "no_answer": 1, "rejected": 0, "not_a_chain": 1,
                         "accepted_step": 0, "accepted_copy": 1, "accepted_final": 0, "accepted_form_boxed": 1,
                         "accepted_form_boxed_period": 0, "accepted_form_none": 0}
    vetoed = ChainRewrite(AlwaysCorrect(), seed=0)
    assert vetoed.generate([(Prompt("a", "59-15-75=", "-31"), CHAIN)]) == [None]
    assert vetoed.stats["rejected"] == 1 and vetoed.stats["accepted"] == 0
    # candidates are distinct and of the kinds asked for
    many = ChainRewrite(BoxedVerifier(), seed=0, num_candidates=3)
    cands = many.candidates(CHAIN)
    assert len(cands) == 3 and len({t for _, t in cands}) == 3 and all(t != CHAIN for _, t in cands)
    assert make_negative_generator("rewrite", BoxedVerifier()).source == "rewrite"


class AlwaysWrong:
    def verify_batch(self, golds, preds):
        return [Verdict(False) for _ in preds]


def test_every_rewrite_changes_the_value():
    """A slip that a later ``* 0`` undoes keeps the value: it is dropped even where the verifier could not
    veto it (here one that calls everything wrong, as math-verify does an answer it cannot read)."""
    from cooper_mcore.data.mathgen import answer_value

    zero = "3+4=7,7*0=0 \\boxed{0}"
    gen = ChainRewrite(AlwaysWrong(), seed=0, kinds=("step",), num_candidates=3)
    for form in (None, "boxed", "boxed_period"):
        made = [t for _ in range(100) for _, t in gen.candidates(zero, form)]
        assert made and all(answer_value(t) != 0 for t in made)  # slips of step 2 stay
        assert not any(t.startswith("3+4=7,") is False for t in made)  # slips of step 1 are undone: dropped


def test_the_paper_rule_check():
    """A rewrite is kept when the positive verifies against the gold and the rewrite does not verify
    against the positive (gold side first); a positive that does not verify gets no negative."""
    gen = ChainRewrite(BoxedVerifier(), seed=0, kinds=("final",))
    assert gen.generate([(Prompt("a", "59-15-75=", "-30"), CHAIN)]) == [None]  # the positive is not correct
    assert gen.stats["rejected"] == 1
    calls = []

    class Recording(BoxedVerifier):
        def verify_batch(self, golds, preds):
            calls.append((list(golds), list(preds)))
            return super().verify_batch(golds, preds)

    rec = ChainRewrite(Recording(), seed=0, kinds=("final",), num_candidates=2)
    (neg,) = rec.generate([(Prompt("a", "59-15-75=", "-31"), CHAIN)] * 2)[:1]
    assert calls[0] == (["-31"], [CHAIN])  # the (distinct) positive against the gold
    assert calls[1][0] == [CHAIN, CHAIN] and neg == calls[1][1][0]  # the first candidates against the positive
    assert len(calls) == 2  # both passed: no second round


def test_rewrites_in_the_forms_of_the_rollouts():
    """forms="rollouts": the final answer is written in the form of one of the prompt's rollouts, the
    ``\\boxed{N.}`` form included; forms="positive" (the default) keeps the positive's."""
    from cooper_mcore.data.mathgen import answer_form, answer_value
    from cooper_mcore.types import RolloutGroup, Sample

    prompt = Prompt("a", "59-15-75=", "-31")
    group = RolloutGroup(prompt, [Sample("a", [], "59-15=44,44-75=-31 \\boxed{-31.}"),
                                  Sample("a", [], "59-15=44,44-75=-30 \\boxed{-30.}"), Sample("a", [], "no answer")])
    gen = ChainRewrite(BoxedVerifier(), seed=0, forms="rollouts")
    gen.set_groups([group])
    negs = gen.generate([(prompt, CHAIN)] * 20)
    assert all(answer_form(n) == "boxed_period" and answer_value(n) not in (None, -31) for n in negs)
    assert gen.stats["accepted_form_boxed_period"] == 20
    plain = ChainRewrite(BoxedVerifier(), seed=0)
    plain.set_groups([group])
    assert all(answer_form(n) == "boxed" for n in plain.generate([(prompt, CHAIN)] * 20))
    with pytest.raises(ValueError, match="forms"):
        ChainRewrite(BoxedVerifier(), forms="gold")


def test_bad_arguments():
    with pytest.raises(ValueError, match="kinds"):
        ChainRewrite(BoxedVerifier(), kinds=("swap",))
    with pytest.raises(ValueError, match="kinds"):
        ChainRewrite(BoxedVerifier(), kinds=())
    with pytest.raises(ValueError, match="num_candidates"):
        ChainRewrite(BoxedVerifier(), num_candidates=0)


@pytest.fixture(scope="module")
def rule_verifier():
    from cooper_mcore.verify.rule import RuleVerifier

    with RuleVerifier(timeout_s=5.0, num_workers=1) as v:
        yield v


def test_rewrites_of_worked_solutions_are_wrong_for_math_verify(rule_verifier):
    problems = generate_problems(12, MathTaskConfig(num_steps=3, operators=("+", "-", "*"), max_operand=20), seed=4)
    items = [(Prompt(f"p{i}", p.question, str(p.answer)), worked_solution(p, style))
             for i, p in enumerate(problems) for style in ("boxed", "gsm8k")]
    golds = [p.answer for p, _ in items]
    assert [v.correct for v in rule_verifier.verify_batch(golds, [t for _, t in items])] == [True] * len(items)
    for kind in ("step", "copy", "final"):
        gen = ChainRewrite(rule_verifier, seed=0, kinds=(kind,))
        negs = gen.generate(items)
        made = [(g, n) for g, n in zip(golds, negs) if n is not None]
        # a step slip can cancel out (e.g. before a "* 0"), and an intermediate can equal the answer:
        # those are vetoed, the rest must be made
        assert len(made) >= len(items) - 2, (kind, gen.stats)
        assert gen.stats[f"accepted_{kind}"] == len(made)
        assert [v.correct for v in rule_verifier.verify_batch([g for g, _ in made], [n for _, n in made])] \
            == [False] * len(made)
