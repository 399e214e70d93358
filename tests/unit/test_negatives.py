"""Negatives for the reward model: the assistant LLM (through a real local chat server), the CPU
alternatives, and preference-pair building with masking."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.negatives.assistant import LLMAssistant, clean_assistant_output, rewrite_messages
from cooper_mcore.negatives.pairs import (
    NEGATIVE_KINDS,
    AnswerPerturbation,
    PolicyWrongNegatives,
    RandomOtherResponse,
    build_pairs,
    final_answer_span,
    first_correct,
    group_verdicts,
    make_negative_generator,
    number_variants,
    pair_stats,
)
from cooper_mcore.types import Prompt, RolloutGroup, Sample
from tests.chat_server import ChatServer

pytestmark = pytest.mark.timeout(60)
NAN = float("nan")


@dataclass
class Verdict:
    correct: Optional[bool]


class FakeVerifier:
    """Compares the last \\boxed{...}, else the token after '####', to the gold string; None if neither."""

    def __init__(self):
        self.calls: list[tuple[list[str], list[str]]] = []

    @staticmethod
    def extract(text: str) -> Optional[str]:
        start = text.rfind("\\boxed{")
        if start >= 0:
            depth, i = 0, start + len("\\boxed")
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
        m = re.findall(r"####\s*(\S+)", text)
        return m[-1] if m else None

    def verify_batch(self, golds, preds):
        assert len(golds) == len(preds)
        self.calls.append((list(golds), list(preds)))
        out = []
        for g, p in zip(golds, preds):
            ans = self.extract(p)
            out.append(Verdict(None if ans is None else ans.replace(",", "") == g.replace(",", "")))
        return out


class ScriptedClient:
    """A chat client whose answers come from a list per call."""

    def __init__(self, *rounds: list[Optional[str]]):
        self.rounds = list(rounds)
        self.calls: list[tuple[list, float, list]] = []

    def chat_batch(self, batch, temperature=0.7, max_tokens=512):
        self.calls.append((list(batch), temperature, list(max_tokens)))
        answers = self.rounds.pop(0)
        assert len(answers) == len(batch)
        return answers


def prompt(pid: str, answer: str = "4", question: str = "") -> Prompt:
    return Prompt(id=pid, question=question or f"Question {pid}: compute it.", answer=answer)


def group(pid: str, *samples: tuple[str, Optional[bool]], answer: str = "4") -> RolloutGroup:
    return RolloutGroup(prompt(pid, answer), [Sample(pid, [], text, rule_correct=c) for text, c in samples])


POSITIVE = "We add two and two to get four, so the answer is \\boxed{4}."  # 13 words

CANNED = {
    "Q-wrong": "Adding gives 2 + 2 = 7 by the carry rule, so the answer is \\boxed{7}.",
    "Q-correct": "Two plus two is four, so \\boxed{4}.",
    "Q-unverifiable": "The answer is clear from symmetry.",
    "Q-think": "<think>\nmake it wrong\n</think>\n\nSo 2 + 2 = 5 and \\boxed{5}.",
}


def canned_answer(body: dict) -> str:
    user = body["messages"][-1]["content"]
    return next(text for key, text in CANNED.items() if key in user)


# ---------------------------------------------------------------------------------------------
# LLMAssistant


def test_assistant_through_server_keeps_only_verified_wrong():
    items = [(prompt(k, question=f"{k}: what is 2+2?"), POSITIVE) for k in CANNED]
    verifier = FakeVerifier()
    with ChatServer(canned=canned_answer) as srv, \
            OpenAIChatClient(srv.url, "assistant-model", api_key_env=None, backoff_s=0.01) as client:
        gen = LLMAssistant(client, verifier)
        out = gen.generate(items)
    assert out == [CANNED["Q-wrong"], None, None, "So 2 + 2 = 5 and \\boxed{5}."]
    # the default is the reference's 3 requests per prompt: the two rejected items are asked twice more
    assert gen.stats == {"requested": 4, "accepted": 2, "rejected_correct": 3, "rejected_unverifiable": 3,
                         "failed_requests": 0, "empty": 0, "reasked": 4}
    assert verifier.calls[0][0] == ["4"] * 4  # gold first
    assert [len(c[0]) for c in verifier.calls] == [4, 2, 2]
    assert len(srv.requests) == 4 + 2 + 2
    for req in srv.requests:
        body = req.body
        assert body["model"] == "assistant-model" and body["temperature"] == 0.7
        assert body["max_tokens"] == len(POSITIVE.split()) + 500 == 513
        user = body["messages"][-1]["content"]
        assert POSITIVE in user and "what is 2+2?" in user and "wrong" in user


def test_assistant_failed_requests_counted_and_max_tokens_per_item():
    verifier = FakeVerifier()
    # round 1: a fails after the client's retries, b answers nothing, c is accepted; round 2 asks b only
    client = ScriptedClient([None, "", "so \\boxed{3}"], ["so \\boxed{7}"])
    gen = LLMAssistant(client, verifier, temperature=0.5, extra_tokens=100)
    items = [(prompt("a"), "one two three"), (prompt("b"), "x"), (prompt("c"), "1 2 3 4 5 6")]
    assert gen.generate(items) == [None, "so \\boxed{7}", "so \\boxed{3}"]
    assert gen.last_failed == [True, False, False]
    assert gen.stats["failed_requests"] == 1 and gen.stats["empty"] == 1 and gen.stats["accepted"] == 2
    assert gen.stats["reasked"] == 1 and len(client.calls) == 2
    _, temperature, limits = client.calls[0]
    assert temperature == 0.5 and limits == [103, 101, 106]
    assert client.calls[1][2] == [101]


def test_assistant_rounds_reask_rejected_items_only():
    client = ScriptedClient(["\\boxed{4}", "\\boxed{9}"], ["\\boxed{8}"])
    gen = LLMAssistant(client, FakeVerifier(), rounds=2)
    items = [(prompt("a"), POSITIVE), (prompt("b"), POSITIVE)]
    assert gen.generate(items) == ["\\boxed{8}", "\\boxed{9}"]
    assert len(client.calls) == 2 and len(client.calls[1][0]) == 1
    assert gen.stats["rejected_correct"] == 1 and gen.stats["accepted"] == 2


def test_rewrite_messages_and_cleaning():
    msgs = rewrite_messages("  What is 1+1?\n", "1+1=2, \\boxed{2}", "2")
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "What is 1+1?" in msgs[1]["content"] and "1+1=2, \\boxed{2}" in msgs[1]["content"]
    assert "\\boxed{...}" in msgs[1]["content"]  # braces of the template survive formatting
    assert clean_assistant_output("<think>a\nb</think>\n Final \\boxed{3} ") == "Final \\boxed{3}"
    assert clean_assistant_output("No think. <think>x</think>") == "No think. <think>x</think>"


def test_assistant_argument_checks():
    with pytest.raises(ValueError, match="extra_tokens"):
        LLMAssistant(ScriptedClient(), FakeVerifier(), extra_tokens=0)
    with pytest.raises(ValueError, match="rounds"):
        LLMAssistant(ScriptedClient(), FakeVerifier(), rounds=0)
    with pytest.raises(ValueError, match="'socratic'"):
        LLMAssistant(ScriptedClient(), FakeVerifier(), prompt="socratic")


def test_reference_prompt_has_no_gold_answer():
    question, solution = "Tom has 17 apples and buys 25 more. How many?", "17 + 25 = 42, so \\boxed{42}"
    ref = rewrite_messages(question, solution, "7311")  # a gold that appears nowhere else
    user = ref[1]["content"]
    assert question in user and solution in user and "7311" not in user
    assert "completely incorrect" in user and "misleading" in user
    assert rewrite_messages(question, solution) == ref  # the answer is not needed
    gold = rewrite_messages(question, solution, "7311", prompt="with_gold")[1]["content"]
    assert "the correct final answer is 7311" in gold and solution in gold
    with pytest.raises(ValueError, match="gold answer"):
        rewrite_messages(question, solution, prompt="with_gold")


def test_assistant_defaults_to_reference_prompt_and_three_rounds():
    # a rewrite that stays correct is asked again, up to 3 requests in all
    client = ScriptedClient(["\\boxed{4}"], ["\\boxed{4}"], ["still \\boxed{4}"])
    gen = LLMAssistant(client, FakeVerifier())
    assert gen.rounds == 3 and gen.prompt == "reference"
    assert gen.generate([(prompt("a", "4"), POSITIVE)]) == [None]
    assert len(client.calls) == 3 and gen.stats["rejected_correct"] == 3 and gen.stats["reasked"] == 2
    assert gen.last_failed == [False]  # rejected, not failed: no stop under on_assistant_failure=stop
    assert all("correct final answer is" not in c[0][0][1]["content"] for c in client.calls)
    # the third round's wrong rewrite is kept
    client = ScriptedClient(["\\boxed{4}"], ["\\boxed{4}"], ["so \\boxed{5}"])
    assert LLMAssistant(client, FakeVerifier()).generate([(prompt("a", "4"), POSITIVE)]) == ["so \\boxed{5}"]
    # the variant with the gold answer, one round
    client = ScriptedClient(["\\boxed{4}"])
    gen = LLMAssistant(client, FakeVerifier(), rounds=1, prompt="with_gold")
    assert gen.generate([(prompt("a", "4"), POSITIVE)]) == [None] and len(client.calls) == 1
    assert "the correct final answer is 4" in client.calls[0][0][0][1]["content"]


# ---------------------------------------------------------------------------------------------
# AnswerPerturbation


PERTURB_CASES = [  # the first line mentions the answer but is not part of the final statement
    ("We need 18 in all.\nEach costs 3, so 6 * 3 = 18.\nThe total is \\boxed{18}.", "18", "."),
    ("She needs 18 eggs.\nShe makes 9 * 2 = 18 dollars.\n#### 18", "18", None),
    ("There are 1,234 apples.\nTotal: 1,234 apples.\n#### 1,234", "1234", None),
    ("We get 3/4 here.\nThus\nSo $x = \\boxed{\\frac{3}{4}}$", "\\frac{3}{4}", "$"),
]


@pytest.mark.parametrize("text, gold, tail", PERTURB_CASES)
def test_perturbation_is_verified_wrong_and_keeps_the_rest(text, gold, tail):
    verifier = FakeVerifier()
    gen = AnswerPerturbation(verifier, seed=1)
    [neg] = gen.generate([(prompt("p", gold), text)])
    assert neg is not None and neg != text
    assert verifier.verify_batch([gold], [neg])[0].correct is False
    assert FakeVerifier.extract(neg) != FakeVerifier.extract(text)
    # only the final statement (its line and the one before) changes
    assert neg.splitlines()[0] == text.splitlines()[0] and len(neg.splitlines()) == 3
    if tail:
        assert neg.endswith(tail)
    assert gen.stats == {"requested": 1, "accepted": 1, "no_answer": 0, "rejected": 0}


def test_perturbation_changes_the_stated_answer_consistently():
    text = "She makes 9 * 2 = 18 dollars.\n#### 18"
    for cand in AnswerPerturbation(FakeVerifier(), num_candidates=8).candidates(text):
        m = re.fullmatch(r"She makes 9 \* 2 = (-?\d+) dollars\.\n#### (-?\d+)", cand)
        assert m and m.group(1) == m.group(2) != "18"


def test_perturbation_last_number_and_letters():
    gen = AnswerPerturbation(FakeVerifier(), num_candidates=4)
    cands = gen.candidates("The result is 12 and 41.5 is the answer")
    assert len(cands) == 4
    for c in cands:
        m = re.fullmatch(r"The result is 12 and (-?[\d.]+) is the answer", c)
        assert m and m.group(1) != "41.5"
    letters = gen.candidates("The answer is \\boxed{(C)}")
    assert len(letters) == 4 and all(re.fullmatch(r"The answer is \\boxed\{\([ABDE]\)\}", c) for c in letters)
    assert gen.candidates("no final answer here") == []


def test_perturbation_none_when_no_answer_or_every_variant_correct():
    class AlwaysCorrect:
        def verify_batch(self, golds, preds):
            return [Verdict(True) for _ in preds]

    gen = AnswerPerturbation(AlwaysCorrect())
    assert gen.generate([(prompt("a"), "\\boxed{4}"), (prompt("b"), "words only")]) == [None, None]
    assert gen.stats["rejected"] == 1 and gen.stats["no_answer"] == 1 and gen.stats["accepted"] == 0


def test_perturbation_seeded():
    text = "so \\boxed{250}"
    a = AnswerPerturbation(FakeVerifier(), seed=5).candidates(text)
    b = AnswerPerturbation(FakeVerifier(), seed=5).candidates(text)
    assert a == b and len(a) == 3


@pytest.mark.parametrize("token", ["0", "7", "18", "-3", "2.50", "1,050", "100"])
def test_number_variants_differ_and_stay_close(token):
    value = float(token.replace(",", ""))
    variants = number_variants(token, random.Random(0))
    assert len(variants) >= 5 and len(set(variants)) == len(variants)
    for v in variants:
        x = float(v.replace(",", ""))
        assert x != value and (abs(x - value) <= 10 or x in (-value, 2 * value) or sorted(v) == sorted(token))
        assert ("," in v) == ("," in token and abs(x) >= 1000)
    same_sign = number_variants(token, random.Random(0), allow_sign_change=False)
    assert all((float(v.replace(",", "")) < 0) == (value < 0) and float(v.replace(",", "")) != 0 for v in same_sign)


def test_final_answer_span():
    t = "a \\boxed{\\frac{1}{2}} b"
    s, e = final_answer_span(t)
    assert t[s:e] == "\\frac{1}{2}"
    t = "x\n####  42 \n"
    s, e = final_answer_span(t)
    assert t[s:e] == "42"
    t = "it is 3 or -5."
    s, e = final_answer_span(t)
    assert t[s:e] == "-5"
    assert final_answer_span("none") is None


# ---------------------------------------------------------------------------------------------
# PolicyWrongNegatives and RandomOtherResponse


def test_policy_wrong_negatives():
    groups = [group("a", ("right \\boxed{4}", True), ("unverified", None), ("wrong1", False), ("wrong2", False)),
              group("b", ("right", True), ("unverified", None))]
    gen = PolicyWrongNegatives(groups, seed=0)
    items = [(groups[0].prompt, "right"), (groups[1].prompt, "right")]
    picks = {gen.generate(items)[0] for _ in range(30)}
    assert picks == {"wrong1", "wrong2"}
    assert gen.generate(items)[1] is None and gen.stats["no_wrong_rollout"] == 31
    with pytest.raises(ValueError, match="'zzz'"):
        gen.generate([(prompt("zzz"), "x")])
    gen1, gen2 = PolicyWrongNegatives(groups, seed=7), PolicyWrongNegatives(groups, seed=7)
    assert [gen1.generate(items)[0] for _ in range(10)] == [gen2.generate(items)[0] for _ in range(10)]


def scored_group(pid: str, *samples: tuple[str, Optional[bool], float]) -> RolloutGroup:
    return RolloutGroup(prompt(pid), [Sample(pid, [], text, rule_correct=c, reward=r) for text, c, r in samples])


def test_policy_wrong_negatives_hardest_and_first():
    # wrong rollouts scored 0.3, 0.8, 0.6 by the RM; the unverified one scores highest and is never used
    g = scored_group("a", ("right", True, 0.9), ("w1", False, 0.3), ("w2", False, 0.8), ("u", None, 0.99),
                     ("w3", False, 0.6))
    items = [(g.prompt, "right")] * 4
    hardest = PolicyWrongNegatives([g], negative_pick="hardest")
    assert hardest.generate(items) == ["w2", "w3", "w1", None]  # distinct, highest score first
    assert hardest.stats == {"requested": 4, "accepted": 3, "no_wrong_rollout": 1}
    assert PolicyWrongNegatives([g], negative_pick="first").generate(items[:2]) == ["w1", "w2"]
    # scores given to set_groups override Sample.reward
    gen = PolicyWrongNegatives(negative_pick="hardest")
    gen.set_groups([g], torch.tensor([[0.0, 5.0, 1.0, 0.0, 2.0]]))
    assert gen.generate(items[:1]) == ["w1"]
    with pytest.raises(ValueError, match="unknown negative_pick"):
        PolicyWrongNegatives(negative_pick="easiest")
    unscored = group("b", ("right", True), ("bad", False))
    with pytest.raises(ValueError, match="needs a finite score"):
        PolicyWrongNegatives([unscored], negative_pick="hardest").generate([(unscored.prompt, "right")])


def answered_group(pid: str, *samples: tuple[str, Optional[bool], Optional[bool], float]) -> RolloutGroup:
    """Samples (text, rule_correct, rule_answered, RM score)."""
    return RolloutGroup(prompt(pid, "14"), [Sample(pid, [], text, rule_correct=c, rule_answered=a, reward=r)
                                            for text, c, a, r in samples])


def test_unanswered_wrong_rollout_is_never_a_negative():
    """A rollout the rule marked wrong without reading an answer (``rule_answered`` False, e.g.
    ``\\boxed{14.}``: possibly correct) is unverifiable for pairing; one whose answer it read and found
    different is a negative; ``rule_answered`` None (unknown) keeps the plain verdict."""
    g = answered_group("a", ("right \\boxed{14}", True, True, 0.1), ("unread \\boxed{14.}", False, False, 0.99),
                       ("read \\boxed{15}", False, True, 0.5), ("unknown 13", False, None, 0.3))
    assert group_verdicts([g]).tolist() == [[1, -1, 0, 0]]  # codes: 1 right, 0 wrong, -1 unverifiable
    # every pick, many seeds: the unread rollout (the RM's favourite, 0.99) is never selected
    items = [(g.prompt, "right \\boxed{14}")] * 3
    for pick in ("random", "hardest", "first"):
        for seed in range(10):
            out = PolicyWrongNegatives([g], seed=seed, negative_pick=pick).generate(items)
            assert "unread \\boxed{14.}" not in out and sorted(out[:2]) == ["read \\boxed{15}", "unknown 13"], out
            assert out[2] is None
    assert PolicyWrongNegatives([g], negative_pick="hardest").generate(items[:1]) == ["read \\boxed{15}"]
    pairs = build_pairs([g], PolicyWrongNegatives(negative_pick="hardest"), pairs_per_prompt=3)
    assert [(p.rejected, p.rejected_index) for p in pairs] == [("read \\boxed{15}", 2), ("unknown 13", 3),
                                                                 (None, None)]
    # a group whose only wrong rollout is unread has no negative; an unread rollout is no positive either
    only_unread = answered_group("b", ("right", True, True, 0.0), ("unread", False, False, 0.0))
    assert [p.valid for p in build_pairs([only_unread], PolicyWrongNegatives())] == [False]
    assert first_correct(answered_group("c", ("unread", False, False, 0.0))) is None


def test_random_other_response_from_items_and_groups():
    items = [(prompt(p), f"answer of {p}") for p in "abcd"]
    out = RandomOtherResponse(seed=3).generate(items)
    assert all(o is not None and o != f"answer of {p}" and o.startswith("answer of ") for (pr, _), o, p in
               zip(items, out, "abcd"))
    assert out == RandomOtherResponse(seed=3).generate(items)
    assert RandomOtherResponse().generate(items[:1]) == [None]
    groups = [group("a", ("a1", True), ("a2", False)), group("b", ("b1", False), ("b2", None))]
    gen = RandomOtherResponse(seed=0, groups=groups)
    drawn = {gen.generate([(groups[0].prompt, "a1")])[0] for _ in range(40)}
    assert drawn == {"b1", "b2"}


def test_random_other_response_verifier_drops_accidentally_correct():
    items = [(prompt("a", "4"), "\\boxed{4}"), (prompt("b", "4"), "\\boxed{4}"), (prompt("c", "9"), "\\boxed{9}")]
    gen = RandomOtherResponse(seed=0, verifier=FakeVerifier())
    for _ in range(10):
        for (p, _), o in zip(items, gen.generate(items)):
            assert o is None or FakeVerifier.extract(o) != p.answer
    assert gen.stats["rejected_correct"] > 0 and gen.stats["accepted"] > 0


# ---------------------------------------------------------------------------------------------
# build_pairs


class RecordingGenerator:
    source = "test"

    def __init__(self, answers):
        self.answers = answers
        self.items = None

    def generate(self, items):
        self.items = items
        return self.answers[: len(items)]


def test_build_pairs_masking_and_order():
    groups = [
        group("a", ("unverified", None), ("bad", False), ("good-a", True), ("good-a2", True)),
        group("b", ("bad", False), ("unverified", None)),
        group("c", ("good-c", True)),
    ]
    gen = RecordingGenerator(["neg-a", None])
    pairs = build_pairs(groups, gen)
    assert [(p.prompt.id, p.chosen, p.rejected, p.source, p.valid) for p in pairs] == [
        ("a", "good-a", "neg-a", "test", True),
        ("b", None, None, "", False),
        ("c", "good-c", None, "", False),
    ]
    assert [(p.id, t) for p, t in gen.items] == [("a", "good-a"), ("c", "good-c")]
    assert pair_stats(pairs) == {"total": 3, "valid": 1, "no_positive": 1, "no_negative": 1, "failed": 0}


def test_build_pairs_rejects_wrong_length_and_handles_no_positive():
    groups = [group("a", ("good", True))]
    with pytest.raises(ValueError, match="RecordingGenerator"):
        build_pairs(groups, RecordingGenerator([]))
    gen = RecordingGenerator(["x"])
    assert [p.valid for p in build_pairs([group("b", ("bad", False))], gen)] == [False]
    assert gen.items is None  # not called without positives


def test_build_pairs_hands_groups_to_policy_generator():
    gen = PolicyWrongNegatives()
    step1 = [group("a", ("good", True), ("bad-a", False))]
    step2 = [group("b", ("good", True), ("bad-b", False))]
    assert [p.rejected for p in build_pairs(step1, gen)] == ["bad-a"]
    pairs = build_pairs(step2, gen)
    assert [(p.rejected, p.source, p.valid) for p in pairs] == [("bad-b", "policy", True)]


def test_build_pairs_k_pairs_hardest_policy_negatives():
    a = scored_group("a", ("ra1", True, 0.7), ("wa1", False, 0.2), ("ra2", True, 0.4), ("wa2", False, 0.9),
                     ("wa3", False, 0.5))
    b = scored_group("b", ("wb1", False, 0.1), ("wb2", False, 0.3))  # no positive
    c = scored_group("c", ("rc1", True, 0.6), ("wc1", False, 0.0), ("uc", None, 0.0))
    gen = PolicyWrongNegatives(negative_pick="hardest")
    pairs = build_pairs([a, b, c], gen, pairs_per_prompt=2, positive_pick="hardest")
    assert [(p.prompt.id, p.chosen, p.rejected, p.chosen_index, p.rejected_index, p.valid) for p in pairs] == [
        ("a", "ra2", "wa2", 2, 3, True),  # lowest-scored positive vs highest-scored negative
        ("a", "ra1", "wa3", 0, 4, True),
        ("b", None, None, None, None, False),
        ("b", None, None, None, None, False),
        ("c", "rc1", "wc1", 0, 1, True),
        ("c", "rc1", None, 0, None, False),  # one wrong rollout: the second slot is masked
    ]
    assert {p.source for p in pairs if p.valid} == {"policy"}
    assert pair_stats(pairs) == {"total": 6, "valid": 3, "no_positive": 2, "no_negative": 1, "failed": 0}
    assert gen.stats == {"requested": 4, "accepted": 3, "no_wrong_rollout": 1}
    # RM scores passed explicitly (e.g. the logits) take precedence over Sample.reward
    logits = torch.tensor([[0.0, 3.0, -1.0, 0.0, 0.0], [0.0, 0.0, NAN, NAN, NAN], [0.0, 0.0, 0.0, NAN, NAN]])
    pairs = build_pairs([a, b, c], PolicyWrongNegatives(negative_pick="hardest"), logits, positive_pick="hardest")
    assert [(p.chosen, p.rejected) for p in pairs] == [("ra2", "wa1"), (None, None), ("rc1", "wc1")]


def test_build_pairs_k_pairs_with_written_negatives_and_picks():
    a = scored_group("a", ("wrong", False, 0.9), ("r1", True, 0.8), ("r2", True, 0.1))
    b = scored_group("b", ("bad", False, 0.5))
    gen = RecordingGenerator(["n1", "n2", "n3"])
    pairs = build_pairs([a, b], gen, pairs_per_prompt=3)  # "first": r1, r2, then r1 again
    assert [(p.id, t) for p, t in gen.items] == [("a", "r1"), ("a", "r2"), ("a", "r1")]
    assert [(p.chosen, p.rejected, p.chosen_index, p.valid) for p in pairs] == [
        ("r1", "n1", 1, True), ("r2", "n2", 2, True), ("r1", "n3", 1, True),
        (None, None, None, False), (None, None, None, False), (None, None, None, False)]
    gen = RecordingGenerator(["n"])
    build_pairs([a], gen, positive_pick="hardest")
    assert gen.items[0][1] == "r2"
    picks = {build_pairs([a], RecordingGenerator(["n"]), positive_pick="random", seed=s)[0].chosen for s in range(20)}
    assert picks == {"r1", "r2"}
    with pytest.raises(ValueError, match="scores must be"):
        build_pairs([a], gen, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="pairs_per_prompt"):
        build_pairs([a], gen, pairs_per_prompt=0)
    with pytest.raises(ValueError, match="positive_pick"):
        build_pairs([a], gen, positive_pick="easiest")
    with pytest.raises(ValueError, match="needs a finite score"):
        build_pairs([group("c", ("right", True))], gen, positive_pick="hardest")


def test_first_correct_goes_through_algo_and_skips_blank():
    g = group("a", ("  ", True), ("bad", False), ("good", True))
    assert first_correct(g) == "good"
    assert first_correct(group("b", ("bad", False), ("?", None))) is None


class MathVerifyVerifier:
    """math-verify directly (what the rule verifier is built on), gold first."""

    def verify_batch(self, golds, preds):
        from math_verify import parse, verify

        return [Verdict(bool(verify(parse(f"${g}$"), parse(p)))) for g, p in zip(golds, preds)]


def test_perturbations_are_wrong_for_math_verify():
    mv = MathVerifyVerifier()
    cases = [(t, g) for t, g, _ in PERTURB_CASES] + [("The answer is \\boxed{0.5}", "1/2")]
    golds = [g for _, g in cases]
    assert [v.correct for v in mv.verify_batch(golds, [t for t, _ in cases])] == [True] * len(cases)
    gen = AnswerPerturbation(mv, seed=0)
    negs = gen.generate([(prompt(f"p{i}", g), t) for i, (t, g) in enumerate(cases)])
    assert all(n is not None for n in negs), gen.stats
    assert [v.correct for v in mv.verify_batch(golds, negs)] == [False] * len(cases)


def test_make_negative_generator():
    v = FakeVerifier()
    kinds = {k: make_negative_generator(k, v, client=ScriptedClient()) for k in NEGATIVE_KINDS}
    assert {k: type(g).__name__ for k, g in kinds.items()} == {
        "assistant": "LLMAssistant", "policy": "PolicyWrongNegatives", "perturb": "AnswerPerturbation",
        "rewrite": "ChainRewrite", "random": "RandomOtherResponse"}
    assert (kinds["assistant"].rounds, kinds["assistant"].prompt) == (3, "reference")
    assert kinds["policy"].negative_pick == "random"
    custom = make_negative_generator("assistant", v, client=ScriptedClient(), assistant_rounds=1,
                                     assistant_prompt="with_gold")
    assert (custom.rounds, custom.prompt) == (1, "with_gold")
    assert make_negative_generator("policy", v, negative_pick="hardest").negative_pick == "hardest"
    assert make_negative_generator("rewrite", v, rewrite_kinds=("copy",)).kinds == ("copy",)
    assert all(g.source == k for k, g in kinds.items())
    with pytest.raises(ValueError, match="client"):
        make_negative_generator("assistant", v)
    with pytest.raises(ValueError, match="'judge'"):
        make_negative_generator("judge", v)


# ---------------------------------------------------------------------------------------------
# With the real rule verifier


@pytest.fixture(scope="module")
def rule_verifier():
    from cooper_mcore.verify.rule import RuleVerifier

    with RuleVerifier(timeout_s=5.0, num_workers=1) as v:
        yield v


@pytest.mark.timeout(120)
def test_real_verifier_filters_assistant_and_perturbation(rule_verifier):
    items = [(prompt(k, question=f"{k}: what is 2+2?"), POSITIVE) for k in ("Q-wrong", "Q-correct", "Q-think")]
    with ChatServer(canned=canned_answer) as srv, \
            OpenAIChatClient(srv.url, "m", api_key_env=None, backoff_s=0.01) as client:
        gen = LLMAssistant(client, rule_verifier)
        out = gen.generate(items)
    assert out == [CANNED["Q-wrong"], None, "So 2 + 2 = 5 and \\boxed{5}."]
    assert gen.stats["rejected_correct"] == 3  # asked 3 times (the default rounds), correct each time

    texts = [("\\boxed{4}", "4"), ("So she earns 9 * 2 = 18 dollars.\n#### 18", "18"),
             ("Hence $x = \\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"), ("The answer is \\boxed{0.5}", "1/2")]
    pert = AnswerPerturbation(rule_verifier, seed=0)
    negs = pert.generate([(prompt(f"p{i}", gold), t) for i, (t, gold) in enumerate(texts)])
    assert all(n is not None for n in negs), pert.stats
    golds = [g for _, g in texts]
    assert [o.correct for o in rule_verifier.verify_batch(golds, negs)] == [False] * 4
    assert [o.correct for o in rule_verifier.verify_batch(golds, [t for t, _ in texts])] == [True] * 4
