"""Cooper's assistant LLM: it rewrites a verified-correct solution into a convincing wrong one.

An instruct model behind an OpenAI-compatible API (:class:`~cooper_mcore.negatives.protocols.ChatBatchClient`)
is asked, as in the reference implementation, with the problem and the correct response and no gold
answer (``prompt="reference"``; ``"with_gold"`` also states the answer to avoid), up to ``rounds``
times per item; a rewrite is kept only when the rule verifier, gold first, says it is wrong.
:mod:`cooper_mcore.negatives.pairs` builds the reward model's pairs from these and the CPU
alternatives.
"""

from __future__ import annotations

import logging
import re
from typing import Literal, Optional

from cooper_mcore.negatives.protocols import ChatBatchClient
from cooper_mcore.types import Prompt
from cooper_mcore.verify.protocols import BatchVerifier

__all__ = ["ASSISTANT_PROMPTS", "AssistantPrompt", "LLMAssistant", "clean_assistant_output", "rewrite_messages"]

logger = logging.getLogger(__name__)


AssistantPrompt = Literal["reference", "with_gold"]
ASSISTANT_PROMPTS: tuple[str, ...] = ("reference", "with_gold")

REWRITE_SYSTEM_PROMPT = (
    "You write realistic flawed solutions to math problems. They are used to train a grader that must learn to "
    "tell correct solutions from convincing wrong ones, so the flaws must be hard to spot."
)

#: the reference implementation's request: the problem and the correct response, no gold answer.
REFERENCE_USER_TEMPLATE = """Below are a math problem and a correct response to it. Write a completely incorrect \
but misleading response to the same problem:
- use flawed reasoning that leads to a wrong final result;
- keep a similar length, structure and level of detail as the correct response;
- make every claim look plausible and state it confidently; never hint that anything is wrong;
- end with the final answer in the same format as the correct response (for example \\boxed{{...}}).
Output only the incorrect response and its final answer, with no preamble.

Problem:
{question}

Correct response:
{solution}"""

#: a variant that also states the gold answer, which the rewrite must avoid.
WITH_GOLD_USER_TEMPLATE = """Below are a math problem and a correct solution to it. Rewrite the solution into one \
that is completely wrong but convincing:
- introduce flawed reasoning (for example a subtle arithmetic slip, a misapplied formula, a wrong case analysis or an \
unjustified step) that leads to a different, incorrect final result; the correct final answer is {answer}, so your \
final answer must differ from it;
- keep a similar length, structure and level of detail as the original;
- state every step confidently and plausibly; never hint that anything is wrong and do not add notes about the errors;
- end with the final answer in the same format as the original (for example \\boxed{{...}}).
Output only the rewritten solution and its final answer, with no preamble.

Problem:
{question}

Correct solution:
{solution}"""

#: kept for callers of the earlier name
REWRITE_USER_TEMPLATE = WITH_GOLD_USER_TEMPLATE

_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


def rewrite_messages(question: str, solution: str, answer: Optional[str] = None,
                     prompt: AssistantPrompt = "reference") -> list[dict[str, str]]:
    """The chat that asks the assistant for a wrong-but-convincing rewrite of ``solution``.

    Args:
        question: the problem statement.
        solution: a correct solution (the positive).
        answer: the gold answer; stated in the request only with ``prompt="with_gold"``.
        prompt: "reference" (the reference implementation's request: problem and correct response, no
            gold answer) or "with_gold" (also tells the assistant the answer to avoid).

    Raises:
        ValueError: unknown ``prompt``, or "with_gold" without ``answer``.
    """
    if prompt == "reference":
        user = REFERENCE_USER_TEMPLATE.format(question=question.strip(), solution=solution.strip())
    elif prompt == "with_gold":
        if answer is None:
            raise ValueError("rewrite prompt 'with_gold' needs the gold answer")
        user = WITH_GOLD_USER_TEMPLATE.format(question=question.strip(), solution=solution.strip(),
                                              answer=answer.strip())
    else:
        raise ValueError(f"unknown assistant prompt {prompt!r}; expected one of {ASSISTANT_PROMPTS}")
    return [{"role": "system", "content": REWRITE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def clean_assistant_output(text: str) -> str:
    """Strip a leading ``<think>...</think>`` block (reasoning models) and surrounding whitespace."""
    return _THINK.sub("", text, count=1).strip()


class LLMAssistant:
    """Assistant-written negatives (Cooper): an instruct LLM rewrites the positive into a wrong one.

    Each request asks for ``len(positive.split()) + extra_tokens`` tokens at ``temperature``; a
    rewrite is kept only when ``verifier.verify_batch([gold], [rewrite])`` (gold first) says
    ``correct is False``. Verdicts True and None (unverifiable) and empty answers reject it, and the
    item is asked again in the next round, up to ``rounds`` requests per item (the reference
    implementation asks up to 3 times). A request that failed after the client's own retries
    (transport errors, 5xx) is not asked again: the item is marked failed (:attr:`last_failed`).

    Args:
        client: an OpenAI-compatible chat client (retries and concurrency are its business).
        verifier: the rule verifier.
        temperature: sampling temperature of the assistant.
        extra_tokens: tokens allowed beyond the positive's word count.
        rounds: requests per item at most, >= 1.
        prompt: "reference" (default, no gold answer in the request) or "with_gold"
            (see :func:`rewrite_messages`).

    Attributes:
        stats: cumulative counters: requested (items), accepted, rejected_correct,
            rejected_unverifiable, failed_requests, empty, reasked (requests after an item's first).
        last_failed: per item of the last :meth:`generate` call, whether it got no negative
            because its last request failed after the client's retries.
    """

    source = "assistant"

    def __init__(self, client: ChatBatchClient, verifier: BatchVerifier, temperature: float = 0.7,
                 extra_tokens: int = 500, rounds: int = 3, prompt: AssistantPrompt = "reference"):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if extra_tokens < 1:
            raise ValueError(f"extra_tokens must be >= 1, got {extra_tokens}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if prompt not in ASSISTANT_PROMPTS:
            raise ValueError(f"unknown assistant prompt {prompt!r}; expected one of {ASSISTANT_PROMPTS}")
        self.client = client
        self.verifier = verifier
        self.temperature = float(temperature)
        self.extra_tokens = int(extra_tokens)
        self.rounds = int(rounds)
        self.prompt: AssistantPrompt = prompt
        self.stats = dict.fromkeys(("requested", "accepted", "rejected_correct", "rejected_unverifiable",
                                    "failed_requests", "empty", "reasked"), 0)
        self.last_failed: list[bool] = []

    def max_tokens_for(self, positive: str) -> int:
        """The completion budget for rewriting ``positive``: its word count plus ``extra_tokens``."""
        return len(positive.split()) + self.extra_tokens

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """One verified-wrong rewrite per (prompt, positive), or None.

        Args:
            items: (prompt, correct completion) pairs.
        """
        self.stats["requested"] += len(items)
        out: list[Optional[str]] = [None] * len(items)
        request_failed = [False] * len(items)
        pending = list(range(len(items)))
        for round_ in range(self.rounds):
            if not pending:
                break
            if round_:
                self.stats["reasked"] += len(pending)
            chats = [rewrite_messages(items[i][0].question, items[i][1], items[i][0].answer, self.prompt)
                     for i in pending]
            limits = [self.max_tokens_for(items[i][1]) for i in pending]
            texts = self.client.chat_batch(chats, temperature=self.temperature, max_tokens=limits)
            assert len(texts) == len(pending), f"client returned {len(texts)} answers for {len(pending)} chats"
            idx: list[int] = []
            candidates: list[str] = []
            for i, text in zip(pending, texts):
                request_failed[i] = text is None
                if text is None:
                    self.stats["failed_requests"] += 1
                    continue
                text = clean_assistant_output(text)
                if not text:
                    self.stats["empty"] += 1
                    continue
                idx.append(i)
                candidates.append(text)
            if candidates:
                verdicts = self.verifier.verify_batch([items[i][0].answer for i in idx], candidates)
                assert len(verdicts) == len(candidates), "verifier returned the wrong number of verdicts"
                for i, text, verdict in zip(idx, candidates, verdicts):
                    if verdict.correct is False:
                        out[i] = text
                        self.stats["accepted"] += 1
                    elif verdict.correct is True:
                        self.stats["rejected_correct"] += 1
                    else:
                        self.stats["rejected_unverifiable"] += 1
            pending = [i for i in pending if out[i] is None and not request_failed[i]]
        self.last_failed = [out[i] is None and request_failed[i] for i in range(len(items))]
        logger.debug("assistant negatives: %s", self.stats)
        return out
