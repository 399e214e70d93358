"""Rule verification: whether a completion's final answer is the gold answer.

* :mod:`~cooper_mcore.verify.rule`: the rule verifier (math-verify, gold first, a hard per-item
  timeout in worker processes) and ``cooper verify``'s JSONL verification.
* :mod:`~cooper_mcore.verify.extract`: the final answer of a completion or reference when
  math-verify finds none itself.
* :mod:`~cooper_mcore.verify.oracle`: the arithmetic task's ground truth behind the same interface.
* :mod:`~cooper_mcore.verify.protocols`: that interface, as the rollouts and the negative
  generators use it.
"""
