"""Prompt templates for the policy and the VerifyRM input format of the reward model.

Policy prompts are made from a question by a *format template*, a string in which the literal
placeholder ``{question}`` is replaced (no other braces are interpreted, so LaTeX such as
``\\boxed{}`` can be written as is), optionally followed by the tokenizer's chat template
(one user turn, generation prompt added).

The reward model (VerifyRM, Cooper paper) reads::

    <question>{q}</question>
    <reference_answer>{ref}</reference_answer>
    <completion>{c}</completion>

where a completion longer than 1500 characters is cut to its first 500 and last 1000 characters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from cooper_mcore.types import Prompt

QUESTION_PLACEHOLDER = "{question}"
DEFAULT_TEMPLATE = QUESTION_PLACEHOLDER
RM_TEMPLATE = "<question>{q}</question>\n<reference_answer>{ref}</reference_answer>\n<completion>{c}</completion>"
RM_MAX_CHARS = 1500
RM_HEAD_CHARS = 500
RM_TAIL_CHARS = 1000


def validate_template(template: str) -> None:
    """Check that a format template contains ``{question}``.

    Raises:
        ValueError: it does not.
    """
    if QUESTION_PLACEHOLDER not in template:
        raise ValueError(f"prompt template {template!r} has no {QUESTION_PLACEHOLDER} placeholder")


def apply_prompt_template(
    question: str,
    template: str = DEFAULT_TEMPLATE,
    tokenizer: Any = None,
    use_chat_template: bool = False,
    system_prompt: Optional[str] = None,
) -> str:
    """The policy's prompt text for ``question``.

    Args:
        question: the problem statement.
        template: format template; every ``{question}`` is replaced by ``question``.
        tokenizer: a transformers tokenizer; needed only with ``use_chat_template``.
        use_chat_template: wrap the formatted text as one user message with the tokenizer's
            chat template, ``add_generation_prompt=True``.
        system_prompt: with ``use_chat_template``, a system message placed before the user turn.

    Returns:
        The prompt text (not tokenised).

    Raises:
        ValueError: the template lacks ``{question}``; a system prompt without the chat
            template; the chat template asked for without a tokenizer that has one.
    """
    validate_template(template)
    content = template.replace(QUESTION_PLACEHOLDER, question)
    if not use_chat_template:
        if system_prompt is not None:
            raise ValueError("system_prompt is only used with use_chat_template=True")
        return content
    if tokenizer is None:
        raise ValueError("use_chat_template=True needs a tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"tokenizer {name!r} has no chat template; use a format template instead")
    messages = [{"role": "user", "content": content}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str), type(text)
    return text


def template_prompts(
    prompts: Iterable[Prompt],
    template: str = DEFAULT_TEMPLATE,
    tokenizer: Any = None,
    use_chat_template: bool = False,
    system_prompt: Optional[str] = None,
    tokenize: bool = False,
) -> list[Prompt]:
    """Fill ``text`` (and, with ``tokenize``, ``token_ids``) of each prompt in place.

    Chat-templated text is tokenised without adding special tokens (the chat template already
    holds them); plain text with the tokenizer's defaults (e.g. a BOS token where it adds one).

    Args:
        prompts: the prompts.
        template, tokenizer, use_chat_template, system_prompt: as for :func:`apply_prompt_template`.
        tokenize: also fill ``token_ids`` (needs ``tokenizer``).

    Returns:
        The same prompt objects, as a list.

    Raises:
        ValueError: as :func:`apply_prompt_template`; ``tokenize`` without a tokenizer.
    """
    if tokenize and tokenizer is None:
        raise ValueError("tokenize=True needs a tokenizer")
    out = list(prompts)
    for p in out:
        p.text = apply_prompt_template(p.question, template, tokenizer, use_chat_template, system_prompt)
        if tokenize:
            p.token_ids = list(tokenizer(p.text, add_special_tokens=not use_chat_template)["input_ids"])
    return out


def truncate_completion(
    completion: str, max_chars: int = RM_MAX_CHARS, head: int = RM_HEAD_CHARS, tail: int = RM_TAIL_CHARS
) -> str:
    """A completion longer than ``max_chars`` cut to its first ``head`` + last ``tail`` characters.

    Completions of at most ``max_chars`` characters are returned unchanged.
    """
    assert head + tail <= max_chars, (head, tail, max_chars)
    if len(completion) <= max_chars:
        return completion
    return completion[:head] + completion[len(completion) - tail:]


def rm_input(question: str, reference: str, completion: str, truncate: bool = True) -> str:
    """The reward model's input text (VerifyRM format, see the module docstring).

    Args:
        question: the problem statement.
        reference: the reference answer.
        completion: the policy's completion to score.
        truncate: apply the paper's truncation (first 500 + last 1000 characters of a completion
            longer than 1500 characters).
    """
    if truncate:
        completion = truncate_completion(completion)
    # Plain concatenation, not str.format: the texts may contain braces.
    return (
        "<question>" + question + "</question>\n<reference_answer>" + reference
        + "</reference_answer>\n<completion>" + completion + "</completion>"
    )
