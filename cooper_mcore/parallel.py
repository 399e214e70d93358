"""Distributed initialisation with the parallel layout shared by the policy and the reward model
(:class:`~cooper_mcore.parallel_layout.ParallelConfig`, the config section, lives in
:mod:`cooper_mcore.parallel_layout` and is imported from here too).

On machines with CUDA this uses NCCL; without it, gloo and the megatron-core CPU mode
(:mod:`cooper_mcore.compat.cpu`). Works under ``torchrun`` (reads ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``) and in a plain single process (world size 1 on a free local port).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import socket
import traceback
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from cooper_mcore.compat.cpu import enable_cpu_mode
from cooper_mcore.parallel_layout import ParallelConfig

logger = logging.getLogger(__name__)


def device() -> torch.device:
    """The device this process computes on (its local GPU, or the CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Initialise torch.distributed and megatron-core's model-parallel groups.

    Args:
        parallel: the TP/PP layout and the collective timeout.
        seed: base seed for megatron's model-parallel RNG tracker.
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        enable_cpu_mode()
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:  # torchrun / SLURM launcher
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a plain single process
            dist.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0, world_size=1, timeout=timeout,
            )
    parallel.validate(dist.get_world_size())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.expert_tp,
            create_gloo_process_groups=False,
            # megatron's groups otherwise keep its 30-minute default, whatever the world group has
            distributed_timeout_minutes=parallel.timeout_minutes,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    logger.debug(
        "rank %d/%d: tp=%d pp=%d ep=%d etp=%d dp=%d",
        dist.get_rank(), dist.get_world_size(), parallel.tp, parallel.pp, parallel.ep, parallel.expert_tp,
        parallel_state.get_data_parallel_world_size(),
    )


def destroy_distributed() -> None:
    """Tear down the model-parallel groups and the default process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def owned_world() -> Iterator[None]:
    """Tear down, on exit, whatever of the distributed world the body creates.

    The default process group and megatron's model-parallel groups that exist on entry (under
    torchrun's caller, or a test's) are left alone; those made inside are destroyed, so an
    in-process job (a test, a notebook) does not leave a world behind. When the body raises in a
    world of several processes nothing is destroyed: the process is going down, and destroying an
    NCCL group waits for the collectives that the other ranks may never join.
    """
    owned_pg = not dist.is_initialized()
    owned_mp = not parallel_state.model_parallel_is_initialized()

    def teardown() -> None:
        if owned_mp:
            parallel_state.destroy_model_parallel()
        if owned_pg and dist.is_initialized():
            dist.destroy_process_group()

    try:
        yield
    except BaseException as e:
        timeout = collective_timeout(e)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            teardown()
        if timeout is not None:
            raise timeout from e
        raise
    teardown()


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``parallel.timeout_minutes`` for the other ranks of its group.

    The message names this rank, the call (``torch.distributed.<op>``), the group's ranks and where
    it was called from; ``rank``, ``op`` and ``ranks`` hold them too. Every job's world
    (:func:`owned_world`) turns torch's timeout error into this, so the CLI reports one line.
    """

    def __init__(self, message: str, rank: int, op: str, ranks: Optional[list[int]]) -> None:
        super().__init__(message)
        self.rank, self.op, self.ranks = rank, op, ranks


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_TORCH = os.path.dirname(torch.__file__) + os.sep


def collective_timeout(e: BaseException) -> Optional[CollectiveTimeout]:
    """``e`` as a :class:`CollectiveTimeout` when it is torch.distributed's timeout of a collective
    (gloo: ``RuntimeError: ... Timed out waiting 5000ms for recv operation``; NCCL: a
    ``DistBackendError`` naming the watchdog's timeout), else None.

    The call and the group come from the traceback: the outermost frame in torch's
    ``distributed_c10d`` (its function, its ``group`` argument) and the innermost frame outside
    torch that called it.
    """
    if not isinstance(e, RuntimeError) or isinstance(e, CollectiveTimeout) or not _TIMED_OUT.search(str(e)):
        return None
    op, ranks, callers = None, None, []
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        path = frame.f_code.co_filename
        if path.endswith(_C10D) and frame.f_code.co_name not in ("wrapper", "inner"):
            op = frame.f_code.co_name
            group = frame.f_locals.get("group")
            try:
                ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            except Exception:  # noqa: BLE001 - the ranks only decorate the message
                ranks = None
            break
        if not path.startswith(_TORCH):
            callers.append(f"{_short(path)}:{lineno} ({frame.f_code.co_name})")
    if op is None:  # not raised by a collective of torch.distributed
        return None
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    caller = " <- ".join(reversed(callers[-3:]))
    message = (f"rank {rank} of {world}: torch.distributed.{op} over ranks {ranks if ranks is not None else '?'} "
               f"timed out{f', called from {caller}' if caller else ''}: another rank of that group never joined "
               "it (it failed, hangs, or is far slower: see the other ranks' logs first); the limit is "
               f"parallel.timeout_minutes. torch: {first[:300]}")
    return CollectiveTimeout(message, rank, op, ranks)


def _short(path: str) -> str:
    """``path`` from its package folder on (``cooper_mcore/rl/loop.py``, ``megatron/core/...``)."""
    parts = path.split(os.sep)
    for root in ("cooper_mcore", "megatron", "tests"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return path


@contextlib.contextmanager
def single_process_world(parallel: ParallelConfig | None = None, seed: int = 1234):
    """A world of one process (TP=PP=1) for tools such as the converter.

    If torch.distributed is already initialised, it is used as it is and left alone.
    """
    if dist.is_initialized():
        yield
        return
    with owned_world():
        init_distributed(parallel or ParallelConfig(), seed=seed)
        yield


def launched_world_size() -> int:
    """The number of processes of this job: the initialised world's, else what the launcher set (``WORLD_SIZE``)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def job_world(parallel: ParallelConfig, seed: int = 1234) -> Iterator[None]:
    """The distributed world of a job (SFT, VerifyRM training or evaluation).

    Uses what is initialised (under torchrun, or inside a caller's world) and sets up, then tears
    down on exit, only what is missing: the default process group (a plain process gets a world
    of one) and megatron's model-parallel groups.

    Raises:
        ValueError: model-parallel groups exist with another TP/PP layout.
    """
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (parallel.tp, parallel.pp):
            raise ValueError(f"model-parallel groups are already initialised with tp={have[0]} pp={have[1]}, "
                             f"not the requested tp={parallel.tp} pp={parallel.pp}")
    with owned_world():
        if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
            init_distributed(parallel, seed=seed)
        yield
