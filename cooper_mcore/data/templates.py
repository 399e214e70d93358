"""Prompt templates for the policy and the VerifyRM input format of the reward model.

Policy prompts are made from a question by a *format template*, a string in which the literal
placeholder ``{question}`` is replaced (no other braces are interpreted, so LaTeX such as
``\\boxed{}`` can be written as is), optionally followed by the tokenizer's chat template
(one user turn, generation prompt added).

The reward model (VerifyRM, Cooper paper) reads::

    <question>{q}</question>
    <reference_answer>{ref}</reference_answer>
    <completion>{c}</completion>

As in the reference implementation, a completion *and a reference answer* longer than 1500
characters are cut to their first 500 and last 1000 characters (``truncate_reference=False`` cuts
the completion only). The reference implementation's ``{q}`` is the problem as the policy is asked
it: the dataset question passed through the format template, instruction suffix included, without
the chat template; :func:`rm_input` writes that when given the policy's template
(``question_template``, see :func:`rm_question`), and the bare question without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from cooper_mcore.data.datasets import read_prompts
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


def longest_prompt_tokens(path: str, template: str, tokenizer: Any, use_chat_template: bool = False,
                          question_key: str = "question", answer_key: str = "answer",
                          skip_malformed: bool = False) -> int:
    """The most tokens of a prompt file's prompts once templated as the trainer templates them
    (:func:`template_prompts`): what ``cooper plan --prompt-tokens`` should be told for a run on it.

    Raises:
        ValueError: as :func:`cooper_mcore.data.datasets.read_prompts` and :func:`template_prompts`.
    """
    prompts, _ = read_prompts(path, question_key=question_key, answer_key=answer_key, skip_malformed=skip_malformed)
    template_prompts(prompts, template, tokenizer, use_chat_template, tokenize=True)
    return max((len(p.token_ids) for p in prompts), default=1)


def truncate_completion(
    completion: str, max_chars: int = RM_MAX_CHARS, head: int = RM_HEAD_CHARS, tail: int = RM_TAIL_CHARS
) -> str:
    """A text longer than ``max_chars`` cut to its first ``head`` + last ``tail`` characters.

    Texts of at most ``max_chars`` characters are returned unchanged. Used for the completion and the
    reference answer of the reward model's input (and the judge's).
    """
    assert head + tail <= max_chars, (head, tail, max_chars)
    if len(completion) <= max_chars:
        return completion
    return completion[:head] + completion[len(completion) - tail:]


def rm_question(question: str, template: Optional[str] = None) -> str:
    """The ``<question>`` of the reward model's input.

    Args:
        question: the dataset's problem statement.
        template: the policy's format template (``data.template``, e.g. ``"{question}\nPlease reason step
            by step, and put your final answer within \\boxed{}."``): the question as the policy is asked
            it, instruction included, without the chat template (the reference implementation's). None:
            the bare question.

    Raises:
        ValueError: the template lacks ``{question}``.
    """
    if template is None:
        return question
    return apply_prompt_template(question, template)


def rm_input(
    question: str,
    reference: str,
    completion: str,
    truncate: bool = True,
    *,
    question_template: Optional[str] = None,
    truncate_reference: bool = True,
) -> str:
    """The reward model's input text (VerifyRM format, see the module docstring).

    Args:
        question: the problem statement.
        reference: the reference answer.
        completion: the policy's completion to score.
        truncate: apply the paper's truncation (first 500 + last 1000 characters of a text longer than
            1500 characters) to the completion and, with ``truncate_reference``, to the reference.
        question_template: pass ``question`` through this format template first (see :func:`rm_question`);
            None keeps it as given.
        truncate_reference: with ``truncate``, cut the reference answer too, as the reference
            implementation does; False cuts the completion only (cooper_mcore's earlier behaviour).

    Raises:
        ValueError: ``question_template`` lacks ``{question}``.
    """
    question = rm_question(question, question_template)
    if truncate:
        completion = truncate_completion(completion)
        if truncate_reference:
            reference = truncate_completion(reference)
    # Plain concatenation, not str.format: the texts may contain braces.
    return (
        "<question>" + question + "</question>\n<reference_answer>" + reference
        + "</reference_answer>\n<completion>" + completion + "</completion>"
    )
