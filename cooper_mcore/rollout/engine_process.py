"""The transformers engine in a process of its own: the disaggregated placement on CPU (and on a GPU
of its own), with weights pushed over a weight group as to a remote SGLang server.

:class:`EngineProcess` is a :class:`~cooper_mcore.rollout.base.RolloutEngine` whose model lives in a
spawned child (:func:`serve`), so that generation runs beside training instead of in turn with it.
Requests go over a pipe; weights go over a :class:`~cooper_mcore.rollout.weight_group.WeightGroup`
(gloo on CPU), in SGLang's order: the group is made once (``init_weights_update_group``), then each
push announces every bucket's names, dtypes and shapes and broadcasts its tensors
(``update_weights_from_distributed``), carrying the policy version.

A child that dies (killed, out of memory, a crash) is noticed by the next request, or while one
waits, within a second: :class:`EngineLost` names its pid and exit code and the request it was
serving; nothing hangs. The child ignores the stop signals a scheduler or a Ctrl-C sends the whole job
(:data:`STOP_SIGNALS`): the trainer writes its checkpoint, with the rollouts the engine generated ahead,
and then shuts the child down; a trainer that dies closes the pipe, and the child exits.
``COOPER_FAULT=engine_generate@<n>`` kills the child as it takes its n-th generate request
(:mod:`cooper_mcore.train.faults`; the fault tests).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from cooper_mcore.data.tokenizer import load_tokenizer
from cooper_mcore.rollout.base import EngineLost, GenerateOutput, Prompts, SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.rollout.weight_group import WeightGroup, WeightGroupSpec, free_port, specs_of
from cooper_mcore.train.faults import fault_point

logger = logging.getLogger(__name__)

__all__ = ["EngineLost", "EngineProcess", "EngineSpec", "serve"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_POLL_S = 1.0  # how often a waiting request checks that the child is alive
#: what a scheduler or a Ctrl-C sends every process of the job; the child ignores them (the trainer's to act on)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class EngineSpec:
    """What the child builds.

    Attributes:
        hf_path: the policy's Hugging Face folder (tokenizer, and the weights unless ``hf_config``).
        hf_config: build the model from this config with undefined weights (``model.init: random``);
            the first push fills them. None: load the folder's weights.
        dtype: ``float32`` or ``bfloat16``.
        device: ``cpu`` or ``cuda:<i>`` (a GPU of the engine's own).
        threads: CPU threads of the child's torch (0: torch's default).
        trust_remote_code: let the folder's code run.
    """

    hf_path: str
    hf_config: Optional[dict[str, Any]] = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0
    trust_remote_code: bool = False


def _build(spec: EngineSpec) -> HFEngine:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    dtype = _DTYPES[spec.dtype]
    if spec.hf_config is not None:
        tok = load_tokenizer(spec.hf_path, trust_remote_code=spec.trust_remote_code)
        return HFEngine.from_config(spec.hf_config, tok, dtype=dtype, device=spec.device)
    return HFEngine.from_pretrained(spec.hf_path, dtype=dtype, device=spec.device,
                                    trust_remote_code=spec.trust_remote_code)


def serve(conn: Connection, spec: EngineSpec) -> None:
    """The child's loop: build the engine, answer ``ready``, then serve requests until ``shutdown``
    or a closed pipe. A request that fails answers ``("error", traceback)`` and the loop goes on."""
    logging.basicConfig(level=logging.WARNING, format="[engine %(process)d] %(levelname)s %(message)s")
    for sig in STOP_SIGNALS:  # sent to the whole job: the trainer decides, writes its checkpoint, then stops this
        signal.signal(sig, signal.SIG_IGN)
    try:
        engine = _build(spec)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    group: Optional[WeightGroup] = None
    generated = 0  # generate requests served: the fault point's count (``COOPER_FAULT=engine_generate@<n>``)
    conn.send(("ok", None))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "shutdown":
                conn.send(("ok", None))
                return
            if op == "init_weights_update_group":
                group = WeightGroup(args[0], rank=1, device=spec.device)
                result: Any = None
            elif op == "update_weights_from_distributed":
                assert group is not None, "init_weights_update_group first"
                buckets = _received_buckets(conn, group)
                try:
                    engine.update_weights(buckets, version=args[0])
                finally:  # the sender broadcasts every bucket: receive them all, or it would wait
                    for _ in buckets:
                        pass
                result = engine.weight_version
            elif op == "generate":
                generated += 1
                fault_point("engine_generate", generated)
                result = engine.generate(*args)
            else:
                result = getattr(engine, op)(*args)
            conn.send(("ok", result))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(("error", traceback.format_exc()))


def _received_buckets(conn: Connection, group: WeightGroup) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets of one push as they arrive: each announced on the pipe, then broadcast."""
    while True:
        op, specs = conn.recv()
        if op == "end":
            return
        assert op == "bucket", op
        yield group.receive(specs)


class EngineProcess:
    """A transformers engine in a spawned process (see the module doc).

    Args:
        spec: what the child builds.
        ready_timeout_s: how long to wait for the child to build its model.
        weight_backend: the weight group's backend (``gloo`` on CPU).
    """

    def __init__(self, spec: EngineSpec, ready_timeout_s: float = 600.0, weight_backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, spec), name="cooper-engine", daemon=True)
        self._proc.start()
        child.close()
        self.spec = spec
        self.weight_version = 0
        self.weight_backend = weight_backend
        self._group: Optional[WeightGroup] = None
        self._wait("start", ready_timeout_s)
        logger.info("rollout engine process %d ready (%s on %s)", self._proc.pid, spec.hf_path, spec.device)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return int(self._proc.pid)

    # -- requests -----------------------------------------------------------------------------
    def _lost(self, op: str) -> EngineLost:
        self._proc.join(timeout=1.0)
        return EngineLost(f"the rollout engine process (pid {self._proc.pid}) exited with code {self._proc.exitcode} "
                          f"during {op}; its log is above (stderr)")

    def _wait(self, op: str, timeout_s: Optional[float] = None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(_POLL_S):
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise self._lost(op)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the rollout engine process (pid {self._proc.pid}) did not answer {op} within "
                                   f"{timeout_s:.0f} s")
        try:
            status, result = self._conn.recv()
        except (EOFError, OSError):
            raise self._lost(op) from None
        if status == "error":
            raise RuntimeError(f"the rollout engine process failed in {op}:\n{result}")
        return result

    def _send(self, op: str, *args: Any) -> None:
        if not self._proc.is_alive():
            raise self._lost(op)
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, OSError):
            raise self._lost(op) from None

    def _call(self, op: str, *args: Any) -> Any:
        self._send(op, *args)
        return self._wait(op)

    def generate(self, prompts: Prompts, params: SamplingParams) -> list[GenerateOutput]:
        """Complete each prompt once in the child (outputs in input order)."""
        return self._call("generate", [list(p) if not isinstance(p, str) else p for p in prompts], params)

    # -- weights ------------------------------------------------------------------------------
    def init_weights_update_group(self, spec: Optional[WeightGroupSpec] = None) -> WeightGroupSpec:
        """Make the weight group with the child (this process is rank 0); return where it met."""
        spec = spec or WeightGroupSpec("127.0.0.1", free_port(), backend=self.weight_backend)
        self._send("init_weights_update_group", spec)
        self._group = WeightGroup(spec, rank=0)
        self._wait("init_weights_update_group")
        return spec

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """Push named HF tensors bucket by bucket over the weight group (made on first use); then the
        engine reports ``version``."""
        if self._group is None:
            self.init_weights_update_group()
        assert self._group is not None
        self._send("update_weights_from_distributed", version)
        for bucket in buckets:
            self._conn.send(("bucket", specs_of(bucket)))
            self._group.send(bucket)
        self._conn.send(("end", None))
        self.weight_version = int(self._wait("update_weights_from_distributed"))

    # -- memory and lifetime ------------------------------------------------------------------
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Release the child's memory (an engine on GPUs of its own has no reason to)."""
        self._call("release_memory", tags)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take the child's memory back."""
        self._call("resume_memory", tags)

    def flush_cache(self) -> None:
        """Nothing is cached between requests."""

    def shutdown(self) -> None:
        """Stop the child at once (SIGKILL: it holds nothing worth a graceful exit, and a request in flight
        is dropped rather than waited for, so that a stopping trainer exits with its peers)."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=5.0)
        if self._group is not None:
            self._group.close()
            self._group = None
        self._conn.close()

    def kill(self) -> None:
        """Kill the child at once (fault tests)."""
        os.kill(self.pid, 9)
