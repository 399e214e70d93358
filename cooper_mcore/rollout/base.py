"""The rollout-engine contract shared by the SGLang and transformers engines.

An engine generates completions with per-token log-probabilities, receives new weights as
named Hugging Face tensors in buckets, and can release and resume its memory around training
phases when colocated with the Megatron models.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import torch


class EngineLost(RuntimeError):
    """The engine's process is gone (killed, out of memory, crashed): what a caller may start again."""


@dataclass
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: completion length limit.
        temperature: 0 means greedy.
        top_p: nucleus sampling mass (1.0 = off).
        stop: strings that end a completion (not included in the returned text).
        seed: per-request seed for reproducible sampling (engines that support it).
        logprobs: return per-token log-probabilities of the sampled tokens.
        routed_experts: return the experts a mixture-of-experts model routed each position to
            (:attr:`GenerateOutput.routed_experts`), for rollout routing replay.
    """

    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None
    logprobs: bool = True
    routed_experts: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerateOutput:
    """One completion.

    Attributes:
        token_ids: generated tokens (without the prompt; truncated at a stop string).
        text: decoded ``token_ids``.
        logprobs: log-probability of each generated token under the engine's weights.
        finish_reason: "stop" or "length".
        routed_experts: with :attr:`SamplingParams.routed_experts`, int32 ``[P + n - 1, layers * top_k]``:
            for each position the engine ran (the ``P`` prompt tokens and the ``n`` generated ones but
            the last, which is never fed back) the experts it was routed to, layer-major (columns
            ``l * top_k`` to ``(l + 1) * top_k - 1`` are layer ``l``'s), -1 in a dense layer; SGLang's
            ``return_routed_experts`` layout.
    """

    token_ids: list[int]
    text: str
    logprobs: Optional[list[float]]
    finish_reason: str
    routed_experts: Optional[torch.Tensor] = None


Prompts = Union[Sequence[str], Sequence[Sequence[int]]]

#: Memory an engine releases and resumes separately (SGLang's torch_memory_saver tags): the weights
#: are resumed first and refilled by a weight push, the KV cache (and CUDA graphs) only then.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def memory_tags(tags: Optional[Sequence[str]]) -> list[str]:
    """``tags`` checked against :data:`MEMORY_TAGS` (None: all of them).

    Raises:
        ValueError: an unknown tag.
    """
    if tags is None:
        return list(MEMORY_TAGS)
    if unknown := [t for t in tags if t not in MEMORY_TAGS]:
        raise ValueError(f"unknown memory tags {unknown}; expected some of {MEMORY_TAGS}")
    return list(tags)


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    weight_version: int

    def generate(self, prompts: Prompts, params: SamplingParams) -> list[GenerateOutput]:
        """Complete each prompt (text or token ids) once; outputs in input order."""

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """Load new weights given as buckets of ``(hf_name, tensor)``; then report ``version``."""

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free device memory while training runs: the ``tags`` of :data:`MEMORY_TAGS` (all by
        default). Released weights are lost (SGLang keeps no copy unless told to): after
        resuming them, every weight must be pushed again before generating."""

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take device memory back (the ``tags``, all by default) before pushing weights or generating."""

    def flush_cache(self) -> None:
        """Drop cached prefixes (they were computed with the old weights)."""

    def shutdown(self) -> None:
        """Stop the engine and free everything."""


def bucketize(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes`` (a tensor larger
    than that gets a bucket of its own). Order is preserved."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
