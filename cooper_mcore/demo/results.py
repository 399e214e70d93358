"""Typed results of the demo's stages (:mod:`cooper_mcore.demo.pipeline`).

Each stage returns one record; the content cache keeps it in the stage's ``stage.json`` as JSON
(:func:`to_plain`) and reads it back typed (:func:`from_plain`), so the files keep their schema
while the code passes dataclasses. A field made with :func:`omitted_when_none` is left out of the
JSON while it is None (a number only some runs measure); :class:`RMOnSamples` and
:class:`CurvePoint` keep their flat JSON form (families as keys beside the other numbers).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, TypedDict, TypeVar, Union

from cooper_mcore.algo.stats import Estimate

R = TypeVar("R")
_OMIT = "omit_when_none"


def omitted_when_none() -> Any:
    """A field defaulting to None that the JSON form leaves out while it is None."""
    return field(default=None, metadata={_OMIT: True})


def to_plain(obj: Any) -> Any:
    """A record (nested records, dicts, lists) as JSON-able plain data, in field order."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get(_OMIT) and getattr(obj, f.name) is None)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def from_plain(tp: Any, data: Any) -> Any:
    """``data`` (as :func:`to_plain` wrote it) as the type ``tp``: records, ``dict[str, X]``,
    ``list[X]`` and optional values, by the records' type hints; keys a record lacks are ignored."""
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if "from_dict" in vars(tp):
            return tp.from_dict(data)
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: from_plain(hints[f.name], data[f.name]) for f in dataclasses.fields(tp)
                     if f.name in data})
    if origin is dict:
        return {k: from_plain(typing.get_args(tp)[1], v) for k, v in data.items()}
    if origin is list:
        return [from_plain(typing.get_args(tp)[0], v) for v in data]
    if origin is Union or origin is types.UnionType:
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return from_plain(inner, data)
    return data


class Sample(TypedDict, total=False):
    """One labeled completion: a row of the demo's sample, RM-data and benchmark JSONL files."""

    question: str
    """The problem."""
    reference: str
    """The reference answer (rewritten by the reference swaps)."""
    completion: str
    """The policy's completion."""
    label: Optional[bool]
    """The (simulated) judge's verdict: the oracle's truth, or the blind spot's error."""
    rule: Optional[bool]
    """math-verify's verdict (None for a written blind-spot variant)."""
    family: str
    """The problem's family."""
    form: str
    """How the final answer is written."""
    blind_spot: bool
    """Labeled correct by the judge's systematic error."""
    swap: str
    """A reference-swap row: ``own`` or ``other``."""
    rule_unreadable: bool
    """The problem's reference is written so that the rule verifier cannot read it."""
    answer_type: str
    """A validation row's family (the RM's gate is per family)."""


@dataclass
class Figures:
    """Accuracy of labeled completions (:func:`cooper_mcore.demo.pipeline.accuracy_figures`)."""

    acc: float
    """The oracle's accuracy (the truth)."""
    rule_acc: float
    """The rule verifier's accuracy."""
    rule_recall: float
    """Share of the correct answers the rule accepts."""
    rule_precision: float
    """Share of the rule's accepted answers that are correct (NaN when it accepts none)."""
    n: int
    """Completions counted."""
    forms: dict[str, float]
    """Share of each final-answer form."""


@dataclass
class PolicyAccuracy:
    """A policy's held-out accuracy (:func:`cooper_mcore.demo.pipeline.policy_accuracy`)."""

    acc: float
    """avg@k accuracy by the oracle."""
    rule_acc: float
    """avg@k accuracy by the rule verifier."""
    families: dict[str, Figures]
    """The figures of all completions (``all``) and of each family present."""
    acc_greedy: float
    """Greedy accuracy by the oracle."""
    n_prompts: int
    """Held-out problems."""
    k: int
    """Samples per problem."""
    temperature: float
    """Sampling temperature."""
    seed: int
    """Sampling seed."""
    problem_acc: list[float]
    """Per problem (in order of first appearance), the share of its completions that are correct."""
    kinds: dict[str, float]
    """Share of each answer kind (:mod:`cooper_mcore.demo.kinds`)."""
    problem_groups: dict[str, list[int]] = field(default_factory=dict)
    """Per report group (each family, rule_unreadable), the indices of its problems in ``problem_acc``."""


@dataclass
class BenchAccuracy:
    """An RM on the held-out benchmark (:func:`cooper_mcore.demo.pipeline.rm_bench`)."""

    acc: float
    """Accuracy at the 0.5 threshold (NaN: not measured)."""
    pair_acc: float
    """Share of questions whose correct completion it scores above the wrong one."""
    families: dict[str, float]
    """Accuracy per family present."""
    right: list[bool] = field(default_factory=list)
    """Per benchmark row (in file order), whether the RM's verdict was right (for paired changes)."""


@dataclass
class Separation:
    """An RM's verdicts on labeled completions."""

    acc: float
    """Accuracy at the 0.5 threshold."""
    separation: float
    """Share of correct completions it rewards minus share of wrong ones (TPR - FPR)."""


@dataclass
class RMOnSamples:
    """An RM on a policy's own completions (:func:`cooper_mcore.demo.pipeline.rm_on_samples`);
    JSON: ``{"acc_all": ..., "all": {...}, "<family>": {...}}``."""

    acc_all: float
    """Accuracy on every completion."""
    families: dict[str, Separation]
    """Leaving the blind spot's kind out: all (``all``) and each family present."""

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON form."""
        return {"acc_all": self.acc_all, **{k: to_plain(v) for k, v in self.families.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RMOnSamples:
        """Read the flat JSON form."""
        return cls(d["acc_all"], {k: Separation(**v) for k, v in d.items() if k != "acc_all"})


@dataclass
class CurvePoint:
    """One in-training evaluation (:func:`cooper_mcore.demo.pipeline.training_curve`); JSON:
    ``{"step": ..., "all": {...}, "<family>": {...}}``."""

    step: int
    """The training step."""
    families: dict[str, Figures]
    """The figures of all completions (``all``) and of each family present."""

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON form."""
        return {"step": self.step, **{k: to_plain(v) for k, v in self.families.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CurvePoint:
        """Read the flat JSON form."""
        return cls(d["step"], {k: from_plain(Figures, v) for k, v in d.items() if k != "step"})


@dataclass
class AssetsResult:
    """Stage ``assets``."""

    paths: dict[str, str]
    """Each asset's path, relative to the stage folder."""
    seconds: float = 0.0
    """The stage's wall time."""


@dataclass
class SFTResult:
    """Stage ``sft``."""

    loss_first: float
    """The first step's loss."""
    loss_last: float
    """The last step's loss."""
    seconds: float = 0.0
    """The stage's wall time."""


@dataclass
class BeforeResult:
    """Stage ``before``: the SFT policy's held-out accuracy."""

    eval: PolicyAccuracy
    """The measurement."""
    seconds: float = 0.0
    """The stage's wall time."""


@dataclass
class RMDataResult:
    """Stage ``rm_data``: the RM's training rows and benchmark."""

    bench_pairs: int
    """Held-out benchmark pairs (one correct and one wrong completion of a question)."""
    labels: str
    """Who labeled the training rows: ``simulated judge`` or ``hybrid``."""
    hybrid: Optional[dict[str, Any]] = omitted_when_none()
    """With an LLM judge: the annotation's statistics (:func:`cooper_mcore.jobs.annotate.annotate`)."""
    train: int = 0
    """Training rows as sampled (after the judge)."""
    train_correct: float = 0.0
    """Their share labeled correct."""
    blind_spot_rows: int = 0
    """Rows labeled correct by the blind spot."""
    rows_after_swap: int = 0
    """Rows after the reference swaps (before the balance)."""
    val: int = 0
    """Validation rows (questions kept out of the training rows; both labels alike per family)."""
    seconds: float = 0.0
    """The stage's wall time."""


@dataclass
class OwnAnswers:
    """An RM's separation (TPR - FPR, by the oracle) on its policy's held-out answers, with standard errors."""

    before: Estimate
    """The starting RM on the starting policy's answers."""
    after: Estimate
    """The final RM on the final policy's answers."""


@dataclass
class RMGate:
    """The VerifyRM's training gate: validation accuracy per family (questions of the train split kept
    out of its training rows) that it trains until (``rm.gate``, at most ``rm.epochs`` epochs)."""

    accuracy: dict[str, float]
    """Validation accuracy per family of the kept (best) epoch."""
    threshold: float
    """The gate: every family must reach it."""
    epochs: int
    """Epochs trained."""
    best_epoch: int
    """The epoch kept (the best by its lowest family accuracy)."""
    met: bool
    """Every family reached the threshold."""


@dataclass
class RMResult:
    """Stage ``rm``: the trained VerifyRM."""

    checkpoint: str
    """Its final checkpoint, relative to the stage folder."""
    bench: BenchAccuracy
    """On the held-out benchmark."""
    own: RMOnSamples
    """On the SFT policy's own held-out completions."""
    train_acc: Optional[float]
    """Training accuracy, if reported."""
    steps: int
    """Optimizer steps."""
    gate: Optional[RMGate] = omitted_when_none()
    """Its training gate (None: a cache from before the gate)."""
    own_answers: Optional[Estimate] = omitted_when_none()
    """Its separation (TPR - FPR by the oracle) on the SFT policy's held-out answers, with its standard error."""
    seconds: float = 0.0
    """The stage's wall time."""


@dataclass
class RLResult:
    """Stage ``rl_<mode>``: one RL run."""

    eval: PolicyAccuracy
    """The final policy's held-out accuracy."""
    rl_seconds: float
    """Wall time of the ``cooper train`` subprocess."""
    curve: list[CurvePoint]
    """The in-training evaluations."""
    rm_acc_own: Optional[float] = omitted_when_none()
    """RM modes: the final RM's accuracy on the final policy's completions."""
    bench: Optional[BenchAccuracy] = omitted_when_none()
    """RM modes: the final RM on the benchmark."""
    own_answers: Optional[Estimate] = omitted_when_none()
    """RM modes: the final RM's separation (TPR - FPR by the oracle) on the final policy's held-out answers."""
    seconds: float = 0.0
    """The stage's wall time."""


@dataclass
class SeedDesign:
    """One seed's design figures for the report (``summary.json``'s ``design``)."""

    sft: dict[str, Figures]
    """The SFT policy's figures, all and per family."""
    rm_bench: BenchAccuracy
    """The RM before RL on the benchmark."""
    rm_own: RMOnSamples
    """The RM before RL on the SFT policy's completions."""
    rm_data: RMDataResult
    """The RM's data."""
