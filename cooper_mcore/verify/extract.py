"""Final-answer extraction from model completions and reference answers.

:func:`extract_answer` returns the final answer of a text as a LaTeX/plain string, trying in order:

1. the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces; also ``\\boxed 5``);
2. the last GSM8K marker ``#### <answer>``;
3. the last answer phrase: ``The (final) answer is X``, ``Answer: X``, ``**Answer:** X``;
4. the whole text when it is itself a bare answer (a single line that is not prose: ``1/2``,
   ``\\frac{1}{2}``, ``(0,1]``, ``x = 3``, ``Monday``);
5. the content of the last math environment (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``);
6. the last number in the text (``-1,234.5``, ``3/4``).

The answer is cleaned: math delimiters, markdown bold, stray currency ``$`` and trailing punctuation are
removed, and trailing unit words after a number are dropped (``18 dollars`` -> ``18``).

Pure regular expressions and linear scans, no sympy: cheap enough to call in the trainer process, and
the verifier calls it again inside its killable worker processes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Optional

__all__ = ["extract_answer", "last_boxed"]

# Markers. Each is searched for its last usable occurrence.
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE_RE = re.compile(r"\\boxed[ \t]+([^\s${}\\][^\s$]*)")
_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
_PHRASE_RE = re.compile(r"(?i)\banswer\b\**[ \t]*(?:(?:is|would be|will be)\b|[:=])[ \t]*:?\**[ \t]*([^\n]*)")
_DELIM_RE = re.compile(r"\\\$|\$\$|\$|\\\(|\\\)|\\\[|\\\]")
_CLOSER = {"$$": "$$", "$": "$", "\\(": "\\)", "\\[": "\\]"}
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")

# Cleaning.
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"), ("`", "`"))
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)|[;!?]|,\s+(?=[A-Za-z]{3})|\s+(?:since|because|as|so|which)\s")
_UNITS_RE = re.compile(r"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s+(?:[A-Za-z]{3,}\.?\s*){1,3}")
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")

# Prose detection: words of 3+ letters outside LaTeX commands, \text{...} and subscripts (``S_{MBCN}`` names a
# quantity), other than function names and the connective "and" (``1 and 2``, a list of answers).
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname|mbox)\s*\{[^{}]*\}|_\{[^{}]*\}")
_LATEX_CMD_RE = re.compile(r"\\[A-Za-z]+")
_WORD_RE = re.compile(r"[A-Za-z]{3,}")
_MATH_WORDS = frozenset(
    "sin cos tan cot sec csc sinh cosh tanh arcsin arccos arctan log exp sqrt max min lim det gcd lcm mod inf "
    "and".split()
)
# Words that follow "the answer is" in reasoning without being an answer ("check if the answer is correct").
_PHRASE_STOPWORDS = frozenset("correct incorrect wrong right not that this the clear unclear".split())
_MAX_BOXED_TRIES = 32


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` with balanced braces.

    Escaped braces (``\\{``, ``\\}``) inside do not count. ``\\boxed 5`` (no braces) is also accepted
    when it comes after every braced box.

    Args:
        text: Any text.

    Returns:
        The box content stripped of surrounding whitespace, or None if there is no complete box.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    braced: Optional[tuple[int, str]] = None
    for start in reversed(starts[-_MAX_BOXED_TRIES:]):
        end = _matching_brace(text, start)
        if end is not None:
            braced = (start, text[start:end].strip())
            break
    bare = None
    for m in _BOXED_BARE_RE.finditer(text):
        bare = m
    if bare is not None and (braced is None or bare.start() > braced[0]):
        return bare.group(1).strip()
    return braced[1] if braced is not None else None


def _matching_brace(text: str, start: int) -> Optional[int]:
    """Index of the ``}`` closing the group whose ``{`` precedes ``start``; None if unbalanced."""
    depth = 1
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _strip_wrappers(s: str) -> str:
    """Remove whole-string math delimiters / markdown emphasis, repeatedly, and trailing punctuation."""
    prev = None
    while s != prev:
        prev = s
        s = s.strip().rstrip(".,;:!?").strip()
        for left, right in _WRAPPERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : len(s) - len(right)]
                break
        if s.startswith(":"):
            s = s[1:]
    return s


def _clean(ans: str) -> Optional[str]:
    """Normalize an extracted answer string; None if nothing is left."""
    s = _strip_wrappers(ans)
    s = _UNESCAPED_DOLLAR_RE.sub("", s).replace("**", "")  # stray currency signs, inner bold
    s = _strip_wrappers(s)
    m = _UNITS_RE.fullmatch(s)
    if m:
        s = m.group(1)
    return s or None


def _looks_like_answer(s: str) -> bool:
    """True if ``s`` is math (no prose words) or a single word such as ``Monday``."""
    if re.fullmatch(r"[A-Za-z]+", s):
        return True
    stripped = _LATEX_CMD_RE.sub(" ", _LATEX_TEXT_RE.sub(" ", s))
    return all(w.lower() in _MATH_WORDS for w in _WORD_RE.findall(stripped))


def _from_boxed(text: str) -> Optional[str]:
    box = last_boxed(text)
    return _clean(box) if box is not None else None


def _from_gsm8k(text: str) -> Optional[str]:
    for m in reversed(list(_GSM8K_RE.finditer(text))):
        ans = _clean(m.group(1))
        if ans:
            return ans
    return None


def _from_phrase(text: str) -> Optional[str]:
    for m in reversed(list(_PHRASE_RE.finditer(text))):
        tail = m.group(1).strip()
        if tail.startswith(("$", "\\(", "\\[")):
            env = _first_math_env(tail)
            if env is not None:
                tail = env
        else:
            cut = _SENTENCE_END_RE.search(tail)
            if cut:
                tail = tail[: cut.start()]
        ans = _clean(tail)
        if ans and ans.lower() not in _PHRASE_STOPWORDS and _looks_like_answer(ans):
            return ans
    return None


def _from_bare(text: str) -> Optional[str]:
    s = text.strip()
    if not s or "\n" in s:
        return None
    ans = _clean(s)
    return ans if ans and _looks_like_answer(ans) else None


def _math_envs(text: str) -> list[tuple[int, str]]:
    """(start, content) of each math environment, in order; one linear pass over the delimiters.

    An opener without its closer (a currency ``$``) swallows the rest of the text, whose content is
    then usually prose and rejected by the callers.
    """
    envs = []
    opener: Optional[str] = None
    start = body = 0
    for m in _DELIM_RE.finditer(text):
        tok = m.group()
        if opener is None:
            if tok in _CLOSER:
                opener, start, body = tok, m.start(), m.end()
        elif tok == _CLOSER[opener]:
            envs.append((start, text[body : m.start()]))
            opener = None
    return envs


def _first_math_env(s: str) -> Optional[str]:
    """Content of the math environment that starts ``s``, if ``s`` starts with one."""
    envs = _math_envs(s)
    return envs[0][1] if envs and envs[0][0] == 0 else None


def _from_math_env(text: str) -> Optional[str]:
    for _, content in reversed(_math_envs(text)):
        ans = _clean(content)
        if ans and _looks_like_answer(ans):
            return ans
    return None


def _from_last_number(text: str) -> Optional[str]:
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m
    return last.group(0) if last is not None else None


_STRATEGIES: tuple[Callable[[str], Optional[str]], ...] = (
    _from_boxed,
    _from_gsm8k,
    _from_phrase,
    _from_bare,
    _from_math_env,
    _from_last_number,
)


def extract_answer(text: str) -> Optional[str]:
    """The final answer string of a completion (or of a reference answer / solution).

    See the module docstring for the order of strategies. A bare answer (``1/2``, ``\\frac{1}{2}``)
    is returned as is, so golds and predictions can be either full texts or answers.

    Args:
        text: A model completion, a GSM8K/MATH solution, or a bare answer.

    Returns:
        The answer without math delimiters (``\\frac{1}{2}``, ``72``, ``(0,1]``), or None if the text
        holds no recognizable answer (empty, or prose without any number).
    """
    if not text or not text.strip():
        return None
    for strategy in _STRATEGIES:
        ans = strategy(text)
        if ans:
            return ans
    return None
