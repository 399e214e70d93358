"""The memory simulation's peaks beside ``cooper plan``'s prediction, phase by phase and kind by kind
(``cooper plan --simulate``; the table of docs/planner.md).

For every phase the planner plans, on every pipeline stage simulated: each kind the simulation sees
(the models' parameters, gradients and optimizer state, activations, logits, buffers) at the phase's
simulated peak beside the planner's component, and their sum beside the planner's sum of the same
components: that ratio is what the planner is held to. The planner's terms the simulation cannot see
are listed with the planner's value kept and marked ``not simulated``: the rollout engine's and the
assistant's weights, KV cache and workspace (other processes' memory), the CUDA contexts, the flat
overhead (NCCL buffers, the allocator's fragmentation). For the engine's terms the simulation does
see whether the trainer had resumed that memory in the phase (:attr:`RankSimulation.engine_resident`),
and says so when the plan counts a term the trainer had released, or the reverse.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from cooper_mcore.config.model_shapes import ModelShape
from cooper_mcore.config.schema import CooperConfig
from cooper_mcore.planner.memory_tracker import STATE_KINDS
from cooper_mcore.planner.plan import Evaluation, PhaseMemory, PlanOptions, plan
from cooper_mcore.planner.simulate import RankSimulation, simulate
from cooper_mcore.planner.sizes import GIB

__all__ = ["NOT_SIMULATED", "SIMULATED", "TOLERANCE", "KindCheck", "PhaseCheck", "SimulationCheck", "check_plan",
           "checks_to_dict", "compare", "format_checks"]

#: the planner's components the simulation measures
SIMULATED = STATE_KINDS + ("activations", "logits", "buffers")
#: the planner's components it cannot see (kept as planned)
NOT_SIMULATED = ("routing_margin", "engine_weights", "engine_kv", "engine_workspace", "assistant_weights",
                 "assistant_kv", "assistant_workspace", "contexts", "overhead")
#: the engine memory (the trainer's resume/release tags) each engine component is
_ENGINE_TAGS = {"engine_weights": "weights", "engine_kv": "kv_cache", "engine_workspace": "cuda_graph"}
TOLERANCE = 0.15
"""How far a phase's simulated total may be from the plan's (relative): the planner's goal."""
_NEGLIGIBLE = 16 * 2**20  # what the simulation holds beside a plan of nothing (rotary tables, RNG state)


@dataclass
class KindCheck:
    """One kind of one phase: the simulated bytes at the phase's peak and the planner's component.

    Attributes:
        kind: the component (:data:`SIMULATED` or :data:`NOT_SIMULATED`, or ``other``).
        simulated: bytes at the simulated peak; None for a term the simulation cannot see.
        planned: the planner's bytes (0 for a kind it does not plan).
        note: what to know (``not simulated``, the engine's memory as the trainer left it).
    """

    kind: str
    simulated: Optional[int]
    planned: int
    note: str = ""

    @property
    def ratio(self) -> Optional[float]:
        """Simulated over planned (None when either is missing or the plan is 0)."""
        return self.simulated / self.planned if self.simulated is not None and self.planned else None


@dataclass
class PhaseCheck:
    """One phase of one pipeline stage: the simulated kinds' sum beside the planner's.

    Attributes:
        phase / stage: which.
        simulated: the simulated peak (every simulated kind at that moment).
        planned: the planner's sum of the components the simulation sees.
        unseen: the planner's terms the simulation cannot see (kept as planned).
        kinds: kind by kind.
    """

    phase: str
    stage: int
    simulated: int
    planned: int
    unseen: int
    kinds: list[KindCheck] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Simulated over planned (of what the simulation sees; 1 when both are 0: all offloaded)."""
        if not self.planned:
            return 1.0 if self.simulated <= _NEGLIGIBLE else float("inf")
        return self.simulated / self.planned

    @property
    def within(self) -> bool:
        """Whether the ratio is within :data:`TOLERANCE` of 1."""
        return abs(self.ratio - 1) <= TOLERANCE

    @property
    def total(self) -> int:
        """The phase as the simulation sees it plus the planner's unseen terms."""
        return self.simulated + self.unseen


def _engine_note(component: str, planned: int, resident: Optional[Sequence[str]]) -> str:
    if component == "routing_margin":
        return "not simulated: the allowance for uneven routing (the simulation routes evenly)"
    tag = _ENGINE_TAGS.get(component)
    if tag is None or resident is None:
        return "not simulated"
    held = tag in resident
    if held == bool(planned):
        return "not simulated; the trainer had it " + ("resumed" if held else "released")
    return ("not simulated; PLANNED but the trainer had it released" if planned
            else "not simulated; NOT PLANNED but the trainer had it resumed")


def _phase_check(sim: RankSimulation, plan: PhaseMemory) -> PhaseCheck:
    peak = sim.peaks[plan.phase]
    comps = plan.components
    kinds = [KindCheck(k, peak.kinds.get(k, 0), comps.get(k, 0)) for k in SIMULATED
             if peak.kinds.get(k, 0) or comps.get(k, 0)]
    if peak.kinds.get("other", 0):
        kinds.append(KindCheck("other", peak.kinds["other"], 0, "simulated only (rotary tables, RNG state)"))
    resident = sim.engine_resident.get(plan.phase)
    kinds += [KindCheck(k, None, comps[k], _engine_note(k, comps[k], resident)) for k in NOT_SIMULATED
              if comps.get(k) or (k in _ENGINE_TAGS and resident and _ENGINE_TAGS[k] in resident and sim.stage == 0)]
    planned = sum(comps.get(k, 0) for k in SIMULATED)
    return PhaseCheck(plan.phase, sim.stage, peak.total, planned, sum(comps.get(k, 0) for k in NOT_SIMULATED), kinds)


def compare(sims: Sequence[RankSimulation], given: Evaluation) -> list[PhaseCheck]:
    """Every planned phase of every simulated stage beside the plan of that stage (``given``: the
    plan's evaluation of the simulated config, with its per-stage phases)."""
    out = []
    for sim in sims:
        stage = given.stages[sim.stage] if given.stages else given.phases
        for planned in stage:
            if planned.phase in sim.peaks:
                out.append(_phase_check(sim, planned))
    return out


def _gib(n: Optional[int]) -> str:
    return f"{n / GIB:9.2f}" if n is not None else f"{'-':>9}"


def _row(kind: str, simulated: Optional[int], planned: int, note: str = "") -> str:
    ratio = f"{simulated / planned:6.2f}" if simulated is not None and planned else f"{'':>6}"
    return f"{'':<19}  {kind:<16}{_gib(simulated)} {_gib(planned)} {ratio}  {note}".rstrip()


def _phase_rows(c: PhaseCheck) -> list[str]:
    """A phase's rows: each model's state (parameters, gradients, optimizer), the other kinds seen,
    their sum, and the planner's unseen terms in one row."""
    kinds = {k.kind: k for k in c.kinds}
    rows = []
    for model in ("policy", "rm"):
        parts = [kinds[f"{model}_{x}"] for x in ("params", "grads", "optimizer") if f"{model}_{x}" in kinds]
        if parts:
            rows.append(_row(f"{model} state", sum(k.simulated or 0 for k in parts), sum(k.planned for k in parts),
                             ", ".join(f"{k.kind.split('_')[-1]} {(k.simulated or 0) / GIB:.2f}" for k in parts)))
    for name in ("activations", "logits", "buffers", "other"):
        if name in kinds and (name != "other" or (kinds[name].simulated or 0) > _NEGLIGIBLE):
            k = kinds[name]
            rows.append(_row(name, k.simulated, k.planned, k.note))
    mark = "" if c.within else f"  OFF by more than {TOLERANCE:.0%}"
    rows.append(f"{'':<19}  {'seen (sum)':<16}{_gib(c.simulated)} {_gib(c.planned)} {c.ratio:6.2f}{mark}")
    unseen = [k for k in c.kinds if k.simulated is None]
    if unseen:
        engine = [k for k in unseen if k.kind in _ENGINE_TAGS]
        held = sorted({_ENGINE_TAGS[k.kind] for k in engine if "resumed" in k.note})
        parts = [f"{k.kind} {k.planned / GIB:.2f}" for k in unseen if k.kind not in _ENGINE_TAGS]
        if engine:
            parts.insert(0, f"engine {sum(k.planned for k in engine) / GIB:.2f} (the trainer had "
                            f"{', '.join(held) if held else 'none of it'} resumed)")
        warn = [k.note for k in unseen if "PLANNED" in k.note]
        rows.append(_row("not simulated", None, c.unseen, "; ".join(parts + warn)))
    return rows


def format_checks(checks: Sequence[PhaseCheck], title: str = "") -> str:
    """The table: per phase and stage the kinds the simulation sees beside the plan (GiB), their sum
    and its ratio, then the planner's terms it cannot see."""
    lines = [title] if title else []
    head = f"{'phase':<14}{'stage':>5}  {'kind':<16}{'simulated':>9} {'plan':>9} {'ratio':>6}"
    lines += [head, "-" * len(head)]
    for c in checks:
        rows = _phase_rows(c)
        lines.append(f"{c.phase:<14}{c.stage:>5}" + rows[0][19:])
        lines += rows[1:]
    if checks:
        worst = max(checks, key=lambda c: abs(c.ratio - 1))
        verdict = "every phase within" if all(c.within for c in checks) else "NOT every phase within"
        lines.append(f"{verdict} {TOLERANCE:.0%} of the plan (furthest: {worst.phase}, stage {worst.stage}, "
                     f"ratio {worst.ratio:.2f})")
    return "\n".join(lines)


def checks_to_dict(checks: Sequence[PhaseCheck]) -> dict[str, Any]:
    """The JSON form: ``within`` (every phase within :data:`TOLERANCE`) and each phase's kinds in GiB."""
    def gib(n: Optional[int]) -> Optional[float]:
        return round(n / GIB, 3) if n is not None else None

    return {"tolerance": TOLERANCE, "within": all(c.within for c in checks),
            "phases": [{"phase": c.phase, "stage": c.stage, "simulated_gib": gib(c.simulated),
                        "planned_gib": gib(c.planned), "ratio": round(c.ratio, 3), "within": c.within,
                        "unseen_planned_gib": gib(c.unseen),
                        "kinds": [{"kind": k.kind, "simulated_gib": gib(k.simulated), "planned_gib": gib(k.planned),
                                   "ratio": round(k.ratio, 3) if k.ratio is not None else None, "note": k.note}
                                  for k in c.kinds]} for c in checks]}



@dataclass
class SimulationCheck:
    """A run's simulated step beside its plan.

    Attributes:
        checks: every planned phase of every simulated stage.
        sims: the simulated ranks.
        host_peak / host_planned: host memory per GPU, simulated (the reference's copy, offloaded
            state) and planned.
        host_engine: of ``host_planned``, the released transformers engine's weights (not simulated).
        notes: what the simulation changed or could not see.
        seconds: the simulation's wall seconds.
    """

    checks: list[PhaseCheck]
    sims: list[RankSimulation]
    host_peak: int
    host_planned: int
    host_engine: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def within(self) -> bool:
        """Whether every phase is within :data:`TOLERANCE` of the plan."""
        return all(c.within for c in self.checks)

    def format(self) -> str:
        """The table with its header and notes."""
        ranks = ", ".join(f"{s.rank} (stage {s.stage})" for s in self.sims)
        lines = [format_checks(self.checks, f"simulated step (fake tensors, rank {ranks}; GiB per GPU, live bytes at "
                                            f"each phase's peak):")]
        engine = (f", of it the released engine's {self.host_engine / GIB:.2f}: not simulated" if self.host_engine
                  else "")
        lines.append(f"host memory per GPU (reference copy, offloaded state): simulated {self.host_peak / GIB:.2f}, "
                     f"plan {self.host_planned / GIB:.2f} GiB{engine}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"simulated in {self.seconds:.0f} s")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``cooper plan --simulate --json``'s ``simulation``)."""
        return {**checks_to_dict(self.checks), "ranks": [s.rank for s in self.sims],
                "host_peak_gib": round(self.host_peak / GIB, 3), "host_planned_gib": round(self.host_planned / GIB, 3),
                "host_engine_gib": round(self.host_engine / GIB, 3),
                "notes": list(self.notes), "seconds": round(self.seconds, 1)}


def check_plan(cfg: CooperConfig, policy: ModelShape, rm: Optional[ModelShape], opts: PlanOptions) -> SimulationCheck:
    """Simulate ``cfg``'s step on ``opts``'s cluster (:func:`~cooper_mcore.planner.simulate.simulate`) and
    set it beside the plan of the same (simulated) config; notes where the plan at the run's own batch differs.

    Raises:
        ValueError: an impossible layout or setting (as the planner), or a torch.distributed world exists.
    """
    if opts.recompute:
        raise ValueError("--simulate runs the trainer, which does not recompute activations: leave out --recompute")
    start = time.perf_counter()
    sims, sim_cfg, notes = simulate(cfg, policy, rm, opts.world_size, opts.prompt_tokens)
    rm_arch = rm.arch if rm is not None else None
    given = plan(sim_cfg, policy.arch, rm_arch, opts).given
    run = plan(cfg, policy.arch, rm_arch, opts).given
    for ours, theirs in zip(given.phases, run.phases):
        if abs(ours.total - theirs.total) > 0.01 * theirs.total:
            notes.append(f"the plan of the run's own batch differs in {ours.phase}: {theirs.total / GIB:.2f} GiB "
                         f"(simulated batch: {ours.total / GIB:.2f})")
    engine = given.engine.weights if not given.engine.is_sglang and given.offload.release_engine else 0
    return SimulationCheck(compare(sims, given), sims, max(s.host_peak for s in sims), given.host_per_gpu, engine,
                           notes, time.perf_counter() - start)
