"""The arithmetic task's ground-truth oracle: a verifier that reads every answer form the task writes.

The rule verifier (math-verify) is precise but brittle: it misses correct answers written in a form
it does not parse, such as ``\\boxed{14.}``. On the arithmetic task of
:mod:`cooper_mcore.data.mathgen` the truth is known exactly: :func:`~cooper_mcore.data.mathgen.answer_value`
reads the final answer in each form the task's conventions produce. :class:`ArithmeticOracle` wraps
it in the rule verifier's interface (:class:`~cooper_mcore.verify.protocols.BatchVerifier`), so that
the trainer's evaluation (``eval.verifier=arithmetic_oracle``) and the CPU demo measure held-out
accuracy by the truth while the rule verifier still gives the rule reward and picks the positives.
"""

from __future__ import annotations

from collections.abc import Sequence

from cooper_mcore.data.mathgen import answer_value, reference_value
from cooper_mcore.verify.rule import VerifyOutcome

__all__ = ["ArithmeticOracle", "oracle_correct"]


def oracle_correct(gold: str, completion: str) -> bool:
    """Whether ``completion``'s final answer (any of the task's forms) equals the integer ``gold``
    (bare, or in one of the task's boxed forms: :func:`~cooper_mcore.data.mathgen.reference_value`).

    Raises:
        ValueError: ``gold`` is no integer (the oracle knows only the arithmetic task).
    """
    want = reference_value(gold)
    if want is None:
        raise ValueError(f"the arithmetic oracle needs integer gold answers (bare or boxed), got {gold!r}")
    return answer_value(completion) == want


class ArithmeticOracle:
    """:func:`oracle_correct` as a batch verifier (instant, in-process; nothing to close)."""

    def verify_batch(self, golds: Sequence[str], preds: Sequence[str]) -> list[VerifyOutcome]:
        """One outcome per pair; ``answered`` says whether the completion has a final answer at all.

        Raises:
            ValueError: the lists differ in length, or a gold answer is no integer.
        """
        if len(golds) != len(preds):
            raise ValueError(f"{len(golds)} gold answers for {len(preds)} completions")
        return [VerifyOutcome(oracle_correct(g, p), 0.0, "ok", answered=answer_value(p) is not None)
                for g, p in zip(golds, preds)]

    def close(self) -> None:
        """Nothing to release (the rule verifier's interface)."""

    def __enter__(self) -> ArithmeticOracle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
