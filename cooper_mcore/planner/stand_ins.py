"""The step's outside world, made of words, for the memory simulation (:mod:`cooper_mcore.planner.simulate`).

A Cooper step talks to a rollout engine, the rule verifier, the assistant LLM and a tokenizer; the
simulation needs what they hand the trainer, at full size, not what they compute:

* :class:`WordTokenizer`: one token per whitespace-separated word, so a text's token count is its
  word count (every word is one character: the reward model's 1,500-character cut of a completion,
  :func:`cooper_mcore.data.templates.truncate_completion`, leaves a 512-token one whole);
* :class:`StandInEngine`: every rollout runs to ``max_new_tokens`` (the planner's worst case), half of
  them ending in the gold answer, half in a wrong one, so every prompt has a reward-model pair;
  weight pushes are consumed bucket by bucket and dropped (the engine's own copy is its memory, not
  the trainer's), each bucket first made into SGLang's one flat buffer on the trainer's device when
  the run's engine is SGLang (:func:`~cooper_mcore.rollout.sglang_payload.flatten_bucket`, what its
  payloads hold: trainer memory);
* :class:`StandInVerifier`: a completion is right when its last word is the gold answer boxed;
* :class:`StandInAssistant`: every rewrite is the positive with its answer changed (as long as it);
* :func:`stand_in_prompts`: prompts of exactly ``prompt_tokens`` tokens whose reward-model input
  (question, gold answer, a full completion) is exactly ``prompt_tokens + max_new_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from cooper_mcore.data.templates import rm_input
from cooper_mcore.rollout.base import GenerateOutput, SamplingParams
from cooper_mcore.rollout.sglang_payload import flatten_bucket
from cooper_mcore.types import Prompt

__all__ = ["GOLD", "StandInAssistant", "StandInEngine", "StandInVerifier", "WordTokenizer", "stand_in_prompts"]

GOLD = "7"
WRONG = "8"
WORD = "w"
WORD_ID = 1


def boxed(answer: str) -> str:
    """A final answer as the completions write it (one word)."""
    return "\\boxed{" + answer + "}"


class WordTokenizer:
    """One token per whitespace-separated word (id 1; 0 pads), within a vocabulary of ``vocab_size``."""

    pad_token_id = 0
    eos_token_id = 0
    name_or_path = "the simulation's word tokenizer"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return 2

    def get_vocab(self) -> dict[str, int]:
        return {"<pad>": 0, WORD: WORD_ID}

    def __call__(self, texts: Sequence[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [[WORD_ID] * len(t.split()) for t in texts]}


@dataclass
class _Verdict:
    correct: Optional[bool]
    answered: bool = True
    status: str = "ok"


class StandInVerifier:
    """Right when the completion's last word is the gold answer boxed."""

    def verify_batch(self, golds: Sequence[str], preds: Sequence[str]) -> list[_Verdict]:
        return [_Verdict(bool(p.split()) and p.split()[-1] == boxed(g)) for g, p in zip(golds, preds)]

    def close(self) -> None:
        """Nothing to stop."""


class StandInEngine:
    """Completions of ``max_new_tokens`` words (every other one right); weight pushes consumed and dropped.

    Args:
        flatten: make each pushed bucket one flat buffer first, as SGLang's payloads do.
        routes: ``(layers, top_k, experts)`` of a mixture-of-experts policy whose routing is replayed:
            every position's experts, spread evenly (None: no routes).

    Attributes:
        resident: the memory tags the engine holds now (its memory is the planner's to count).
    """

    def __init__(self, flatten: bool = False, routes: Optional[tuple[int, int, int]] = None) -> None:
        self.flatten = flatten
        self.routes = routes
        self.weight_version = 0
        self.pushed_bytes = 0
        self.resident = {"weights", "kv_cache", "cuda_graph"}
        self._count = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerateOutput]:
        out = []
        for prompt in prompts:
            answer = GOLD if self._count % 2 == 0 else WRONG
            self._count += 1
            words = [WORD] * (params.max_new_tokens - 1) + [boxed(answer)]
            out.append(GenerateOutput([WORD_ID] * len(words), " ".join(words),
                                      [0.0] * len(words) if params.logprobs else None, "length",
                                      self._routes(len(prompt) + len(words) - 1) if params.routed_experts else None))
        return out

    def _routes(self, positions: int) -> Optional[torch.Tensor]:
        """``[positions, layers * top_k]`` experts, consecutive ones in each layer (an even spread)."""
        if self.routes is None:
            return None
        layers, top_k, experts = self.routes
        return torch.arange(positions * layers * top_k).remainder(experts).view(positions, -1).int()

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        for bucket in buckets:
            self.pushed_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            flat = flatten_bucket(bucket) if self.flatten else None
            del flat  # SGLang has loaded the bucket: its payload goes before the next is made
        self.weight_version = version

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self.resident -= set(tags or ("weights", "kv_cache", "cuda_graph"))

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self.resident |= set(tags or ("weights", "kv_cache", "cuda_graph"))

    def flush_cache(self) -> None:
        """No prefix cache."""

    def shutdown(self) -> None:
        """Nothing to stop."""


class StandInAssistant:
    """Every rewrite: the positive quoted in the request, its final answer changed."""

    def chat_batch(self, batch: Sequence[Sequence[dict[str, str]]], temperature: float = 0.7,
                   max_tokens: int | Sequence[int] = 512) -> list[Optional[str]]:
        out: list[Optional[str]] = []
        for chat in batch:
            words = chat[-1]["content"].split()
            out.append(" ".join([WORD] * (_quoted_words(words) - 1) + [boxed(WRONG)]))
        return out


def _quoted_words(words: list[str]) -> int:
    """The word count of the completion quoted at the end of a rewrite request (its run of words)."""
    n = 1
    while n < len(words) and words[-1 - n] == WORD:
        n += 1
    return n


def stand_in_prompts(n: int, prompt_tokens: int, max_new_tokens: int, question_template: Optional[str]) -> list[Prompt]:
    """``n`` prompts of ``prompt_tokens`` tokens whose reward-model input with a full completion is
    ``prompt_tokens + max_new_tokens`` tokens (the template's own words taken off the question).

    Raises:
        ValueError: ``prompt_tokens`` smaller than the reward model's template.
    """
    template = len(rm_input(WORD, GOLD, WORD, question_template=question_template).split()) - 2
    words = prompt_tokens - template
    if words < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens} is shorter than the reward model's input template "
                         f"({template} words)")
    question = " ".join([WORD] * words)
    return [Prompt(f"simulated-{i}", question, GOLD, text=question, token_ids=[WORD_ID] * prompt_tokens)
            for i in range(n)]
