"""Rollouts generated ahead of training with bounded staleness (``rollout.max_staleness``), from an
engine apart from the trainer (``rollout.placement: disaggregated``).

A thread on each model-parallel group leader (:class:`RolloutPipeline`) drives the group's engine:
it generates and verifies the rollouts of step ``s`` with the policy of version
``max(s - k, start)`` exactly (``k`` = ``rollout.max_staleness``), while the trainer trains on the
steps before. So a run is deterministic for its seed whatever the timing, every sample's staleness
(the step that trains on it minus the version that generated it) is ``k`` after the first ``k`` steps
and never above it, and ``k = 0`` is the synchronous order (the engine waits for each update).

The trainer's side is collective and on the main thread only: after each policy update
:meth:`RolloutPipeline.publish` gathers the new weights (Hugging Face names, on the leader's host) and
hands them to the thread, which pushes each version in order over the engine's weight group; the
prompts of the next steps are drawn on every rank (:meth:`RolloutPipeline.feed`), so the data position
stays the same on every rank; :meth:`RolloutPipeline.take` waits for a step's rollouts on the leader
and shares them with the group, after the world agrees that no leader's thread failed.

Evaluation runs on the thread between two generations (:meth:`RolloutPipeline.generate_with`) with the
newest published version; the next generation pushes its own version again.

A checkpoint after step ``r`` holds the rollouts already generated for steps ``r .. r + k - 1``
(:meth:`RolloutPipeline.pending`, JSON in each leader's rank state): a resumed run trains on exactly
the rollouts the uninterrupted run would have (bitwise at every ``k``, as a colocated run at 0).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from megatron.core import parallel_state

from cooper_mcore.collectives import any_rank, is_group_leader
from cooper_mcore.data.iterator import PromptIterator
from cooper_mcore.rl.results import PipelineStats
from cooper_mcore.rl.rollouts import generate_groups, share_groups
from cooper_mcore.rollout.base import EngineLost, GenerateOutput, Prompts, RolloutEngine, SamplingParams, bucketize
from cooper_mcore.rollout.weight_sync import hf_named_tensors
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.types import Prompt, RolloutGroup, Sample
from cooper_mcore.verify.protocols import BatchVerifier

logger = logging.getLogger(__name__)

__all__ = ["RolloutPipeline", "RolloutsFailed", "groups_from_json", "groups_to_json", "publish_policy",
           "staleness_of"]

Weights = list[tuple[str, torch.Tensor]]


class RolloutsFailed(RuntimeError):
    """A leader's rollout thread failed (its engine died, its verifier broke): raised on every rank."""


def staleness_of(groups: Sequence[RolloutGroup], step: int, bound: int) -> tuple[float, int]:
    """Mean and largest staleness (``step - weight_version``) of the groups' samples.

    Raises:
        AssertionError: a sample above ``bound`` or from a version after ``step`` (the pipeline's invariant).
    """
    ages = [step - s.weight_version for g in groups for s in g.samples]
    assert ages and 0 <= min(ages) and max(ages) <= bound, (step, bound, ages)
    return sum(ages) / len(ages), max(ages)


def groups_to_json(groups: Sequence[RolloutGroup]) -> list[dict[str, Any]]:
    """JSON-able form of rollout groups (no routed experts: refused with this placement)."""
    out = []
    for g in groups:
        d = asdict(g)
        for s in d["samples"]:
            assert s.pop("routed_experts") is None
        out.append(d)
    return out


def groups_from_json(rows: Sequence[dict[str, Any]]) -> list[RolloutGroup]:
    """The inverse of :func:`groups_to_json`."""
    return [RolloutGroup(prompt=Prompt(**r["prompt"]), samples=[Sample(**s) for s in r["samples"]],
                         gold_unreadable=r["gold_unreadable"]) for r in rows]


@dataclass
class _Job:
    """A request run on the thread between two generations (evaluation)."""

    run: Callable[[RolloutEngine], Any]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Optional[BaseException] = None


class RolloutPipeline:
    """The rollouts of the coming steps, generated ahead (see the module doc).

    Args:
        engine / verifier: the group leader's engine and rule verifier (None on the other ranks).
        data: this rank's prompt stream (drawn ahead by :meth:`feed`, on every rank).
        max_staleness: ``k``.
        group_size: completions per prompt.
        sampling: the sampling of a step's rollouts (its seed from the step).
        start: the first step to generate (a resumed run's step) and the version the trainer has.
        steps: the run's last step (nothing is generated for steps at or past it).
        bucket_bytes: size of the buckets pushed into the engine.
        restart: starts a new engine when the leader's dies (None: a dead engine stops the run).
        max_restarts: how many times in the run.
    """

    def __init__(self, engine: Optional[RolloutEngine], verifier: Optional[BatchVerifier], data: PromptIterator,
                 max_staleness: int, group_size: int, sampling: Callable[[int], SamplingParams], start: int, steps: int,
                 bucket_bytes: int, restart: Optional[Callable[[], RolloutEngine]] = None,
                 max_restarts: int = 0) -> None:
        self.engine, self.verifier, self.data, self.k = engine, verifier, data, max_staleness
        self.group_size, self.sampling, self.start, self.steps = group_size, sampling, start, steps
        self.bucket_bytes = bucket_bytes
        self._restart, self.max_restarts, self._restarts = restart, max_restarts, 0
        self._cv = threading.Condition()
        self._prompts: dict[int, list[Prompt]] = {}
        self._ready: dict[int, list[RolloutGroup]] = {}
        self._weights: dict[int, Weights] = {}  # published versions still needed
        self._published = -1
        self._engine_version: Optional[int] = None
        self._next = start  # the next step to generate
        self._jobs: collections.deque[_Job] = collections.deque()
        self._error: Optional[BaseException] = None
        self._eval_error: Optional[BaseException] = None  # an evaluation's, raised by :meth:`check`
        self._stop = False
        self._idle_s = self._push_s = 0.0
        self._fed = start  # every rank: the next step to draw prompts for
        self._states = {start - 1: data.state_dict()}  # every rank: the data position after drawing step s
        self._thread: Optional[threading.Thread] = None
        if engine is not None:
            self._thread = threading.Thread(target=self._loop, name="cooper-rollouts", daemon=True)
            self._thread.start()

    def version_for(self, step: int) -> int:
        """The policy version that generates step ``step``'s rollouts."""
        return max(step - self.k, self.start)

    # -- the trainer's side (main thread, every rank) -------------------------------------------
    def feed(self) -> None:
        """Draw the prompts of every step up to ``published + k`` not drawn yet (every rank: the data
        position stays the same everywhere; the leader hands them to the thread)."""
        last = min(max(self._published, self.start) + self.k, self.steps - 1)
        while self._fed <= last:
            prompts = self.data.next_batch()
            self._states[self._fed] = self.data.state_dict()
            if self._thread is not None:
                with self._cv:
                    self._prompts[self._fed] = prompts
                    self._cv.notify_all()
            self._fed += 1

    def publish(self, version: int, weights: Optional[Weights]) -> None:
        """The policy of ``version`` (its HF tensors on the leader, None elsewhere)."""
        with self._cv:
            self._published = version
            if self._thread is not None:
                assert weights is not None
                self._weights[version] = weights
                self._cv.notify_all()

    def take(self, step: int) -> tuple[list[RolloutGroup], PipelineStats]:
        """Step ``step``'s rollouts on every rank of the group (collective over the world).

        Raises:
            RolloutsFailed: on every rank, when a leader's thread failed (its message on that leader).
        """
        groups, wait, problem = None, 0.0, None
        if self._thread is not None:
            t0 = time.perf_counter()
            with self._cv:
                self._cv.wait_for(lambda: step in self._ready or self._error is not None)
                wait = time.perf_counter() - t0
                if self._error is not None:
                    problem = f"the rollout engine failed: {self._error}"
                else:
                    groups = self._ready.pop(step)
                idle, push = self._idle_s, self._push_s
                self._idle_s = self._push_s = 0.0
        self._agree(problem)
        groups = share_groups(groups)
        mean, most = staleness_of(groups, step, self.k)
        if self._thread is None:
            return groups, PipelineStats(mean, most)
        return groups, PipelineStats(mean, most, trainer_wait_s=wait, engine_idle_s=idle, weight_push_s=push)

    def data_state(self, step: int) -> dict[str, Any]:
        """The data position a checkpoint after ``step`` keeps: after the steps :meth:`pending` keeps."""
        last = step + self.kept_steps(step) - 1
        for s in [s for s in self._states if s < last]:  # older positions are never asked for again
            del self._states[s]
        return self._states[last]

    def pending(self, step: int) -> Optional[list[list[dict[str, Any]]]]:
        """The rollouts generated for steps ``step .. step + k - 1`` (below ``steps``), JSON-able, waiting
        for those still generating (collective over the world): a checkpoint after ``step`` keeps them
        (the leader's; None elsewhere).

        Raises:
            RolloutsFailed: on every rank, when a leader's thread failed.
        """
        kept, problem = None, None
        if self._thread is not None:
            wanted = range(step, step + self.kept_steps(step))
            with self._cv:
                self._cv.wait_for(lambda: all(s in self._ready for s in wanted) or self._error is not None)
                if self._error is not None:
                    problem = f"the rollout engine failed: {self._error}"
                else:
                    kept = [groups_to_json(self._ready[s]) for s in wanted]
        self._agree(problem)
        return kept

    def evaluation_failed(self, error: BaseException) -> None:
        """Record an evaluation's failure on this leader, for :meth:`check` to raise on every rank."""
        with self._cv:
            self._eval_error = error

    def check(self) -> None:
        """Raise on every rank when a leader's thread or evaluation failed (collective over the world).

        Raises:
            RolloutsFailed: naming the failure on its leader.
        """
        with self._cv:
            error = self._error or self._eval_error
        self._agree(None if error is None else f"the rollout engine failed: {error}")

    @staticmethod
    def _agree(problem: Optional[str]) -> None:
        if any_rank(problem is not None):
            raise RolloutsFailed(problem or "a rollout engine failed on another rank (see its log)")

    def restore(self, pending: Optional[Sequence[Sequence[dict[str, Any]]]], count: int) -> None:
        """Take back the rollouts a checkpoint kept for its next ``count`` steps (:meth:`pending`: the
        leader's; None elsewhere), the data position being after them, before the first :meth:`feed`. The
        thread generates from the step after them; the steps up to ``start + k - 1`` it has no rollouts for
        (a run whose ``max_staleness`` or ``steps`` grew) come from the checkpoint's policy."""
        assert self._thread is None or (pending is not None and len(pending) == count), (count, pending is None)
        with self._cv:
            if self._thread is not None:
                for i, rows in enumerate(pending):
                    self._ready[self.start + i] = groups_from_json(rows)
            self._next = self._fed = self.start + count
            self._states = {self._fed - 1: self.data.state_dict()}

    def kept_steps(self, step: int) -> int:
        """How many steps' rollouts a checkpoint after ``step`` keeps (:meth:`pending`)."""
        return max(min(step + self.k, self.steps) - step, 0)

    def generate_with(self, version: int) -> RolloutEngine:
        """An engine for evaluation: its ``generate`` runs on the thread with the weights of ``version``
        (published); None off the leader."""
        return _ThreadEngine(self, version) if self._thread is not None else None  # type: ignore[return-value]

    def call(self, fn: Callable[[RolloutEngine], Any], version: int) -> Any:
        """Run ``fn(engine)`` on the thread with the weights of ``version`` (the leader)."""
        job = _Job(fn, version)
        with self._cv:
            if self._error is not None:
                raise RolloutsFailed(f"the rollout engine failed: {self._error}")
            self._jobs.append(job)
            self._cv.notify_all()
        while not job.done.wait(1.0):
            with self._cv:
                if self._error is not None:
                    raise RolloutsFailed(f"the rollout engine failed: {self._error}")
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Stop the engine and the thread (the leader's) without waiting for a request in flight: a stopping
        trainer exits with its peers (its checkpoint already holds everything the engine had)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self.engine.shutdown()
            self._thread.join(timeout=0.1)  # a daemon: one still waiting on the engine ends with the process

    # -- the thread -----------------------------------------------------------------------------
    def _work(self) -> bool:
        if self._stop or (self._jobs and self._jobs[0].version <= self._published):
            return True
        return self._next in self._prompts and self.version_for(self._next) <= self._published

    def _loop(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cv:
                    self._cv.wait_for(self._work)
                    self._idle_s += time.perf_counter() - t0
                    if self._stop:
                        return
                    job = self._jobs.popleft() if self._jobs and self._jobs[0].version <= self._published else None
                    version = job.version if job else self.version_for(self._next)
                    step = self._next
                    prompts = None if job else self._prompts.pop(step)
                if job is not None:
                    self._serve(job)
                    continue
                groups = self._generate(step, prompts, version)
                with self._cv:
                    self._ready[step] = groups
                    self._next += 1
                    self._forget()
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which stops every rank
            with self._cv:
                if self._stop:  # the engine was shut down under a request: nothing to report
                    return
            logger.error("rollout thread: %s", e)
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _on_engine(self, version: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` once the engine has the weights of ``version``; a dead engine is started again (up to
        ``max_restarts`` times in the run), given those weights, and ``fn`` run again: the same seed, the
        same weights, so the same rollouts."""
        while True:
            try:
                self._push(version)
                return fn()
            except EngineLost as e:
                if self._stop or self._restart is None or self._restarts >= self.max_restarts:
                    raise EngineLost(f"{e}; rollout.engine_restarts={self.max_restarts} used up") from e
                self._restarts += 1
                logger.warning("%s: starting it again (restart %d of rollout.engine_restarts=%d)", e, self._restarts,
                               self.max_restarts)
                self.engine.shutdown()
                self.engine = self._restart()
                self._engine_version = None

    def _push(self, version: int) -> None:
        if version == self._engine_version:
            return
        with self._cv:
            weights = self._weights[version]
        t0 = time.perf_counter()
        self.engine.update_weights(bucketize(weights, self.bucket_bytes), version)
        self._engine_version = version
        with self._cv:
            self._push_s += time.perf_counter() - t0

    def _generate(self, step: int, prompts: list[Prompt], version: int) -> list[RolloutGroup]:
        return self._on_engine(version, lambda: generate_groups(
            self.engine, self.verifier, prompts, self.group_size, self.sampling(step), version, share=False))

    def _serve(self, job: _Job) -> None:
        """Run a job; its error is raised in its caller (an engine lost for good stops the thread too)."""
        try:
            job.result = self._on_engine(job.version, lambda: job.run(self.engine))
        except EngineLost as e:
            job.error = e
            raise
        except Exception as e:  # noqa: BLE001 - raised in the caller
            job.error = e
        finally:
            job.done.set()

    def _forget(self) -> None:
        """Drop published weights no generation or evaluation needs any more (under the lock)."""
        keep = min(self.version_for(self._next), self._published)
        for v in [v for v in self._weights if v < keep]:
            del self._weights[v]


class _ThreadEngine:
    """The pipeline's engine seen from the main thread: ``generate`` runs on the rollout thread."""

    def __init__(self, pipeline: RolloutPipeline, version: int) -> None:
        self.pipeline, self.weight_version = pipeline, version

    def generate(self, prompts: Prompts, params: SamplingParams) -> list[GenerateOutput]:
        """The completions, or on a failure empty ones: the evaluation's collectives go on, and
        :meth:`RolloutPipeline.check` after it stops every rank."""
        try:
            return self.pipeline.call(lambda e: e.generate(prompts, params), self.weight_version)
        except Exception as e:  # noqa: BLE001 - raised on every rank by check()
            self.pipeline.evaluation_failed(e)
            return [GenerateOutput(token_ids=[], text="", logprobs=None, finish_reason="stop") for _ in prompts]


def publish_policy(pipeline: RolloutPipeline, policy: ModelState, version: int) -> None:
    """Hand the policy of ``version`` to the pipeline and draw the prompts it may now generate for
    (collective over the model-parallel group: the weights are gathered to the leader's host, in
    Hugging Face names)."""
    with torch.no_grad():
        copies = [(n, t.detach().to("cpu", copy=True)) for n, t in hf_named_tensors(
            policy.model, policy.arch, parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_pipeline_model_parallel_group())]
    pipeline.publish(version, copies if is_group_leader() else None)
    pipeline.feed()
