"""A process group between a trainer and a rollout engine that is not on its GPUs, for weights.

The same handshake as SGLang's ``init_weights_update_group`` / ``update_weights_from_distributed``
(and vLLM's, verl's, slime's): the trainer's sending rank is rank 0 of a small group of its own,
the engine's ranks follow it (``rank_offset``); the group is made from a TCP store at
``master_address:master_port`` apart from the trainer's world, so that neither side's default
group is involved. Each push names its tensors (``names``, ``dtypes``, ``shapes``) first; then
rank 0 broadcasts them one by one and every engine rank receives them into fresh buffers.

``backend``: ``gloo`` on CPU, ``nccl`` between GPUs (the tensors then live on the rank's device).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["WeightGroupSpec", "TensorSpec", "WeightGroup", "free_port", "specs_of", "DTYPE_NAMES"]

#: dtypes a push may carry, by the name each side writes
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the store binds it right after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where and how the weight group meets (SGLang's ``init_weights_update_group`` fields).

    Attributes:
        master_address / master_port: the TCP store the trainer's rank 0 hosts.
        world_size: 1 (the trainer's sender) + the engine's ranks.
        group_name: the group's name (a prefix in the store).
        backend: ``gloo`` or ``nccl``.
        timeout_s: how long a member waits for the others, in the handshake and in every transfer.
    """

    master_address: str
    master_port: int
    world_size: int = 2
    group_name: str = "cooper_weights"
    backend: str = "gloo"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be gloo or nccl, got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(f"a weight group needs the trainer and at least one engine rank, got world_size "
                             f"{self.world_size}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a push, as announced before the broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def specs_of(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The announcement of a bucket of ``(name, tensor)``.

    Raises:
        ValueError: a dtype the group does not carry (naming the tensor).
    """
    names = {v: k for k, v in DTYPE_NAMES.items()}
    out = []
    for name, t in bucket:
        if t.dtype not in names:
            raise ValueError(f"weight push: {name!r} has dtype {t.dtype}, expected one of {sorted(DTYPE_NAMES)}")
        out.append(TensorSpec(name, names[t.dtype], tuple(t.shape)))
    return out


class WeightGroup:
    """This process's membership of a weight group (rank 0: the trainer's sender).

    Args:
        spec: where the group meets.
        rank: this process's rank in it (0 hosts the store).
        device: where tensors are sent from and received into (``cpu`` with gloo, the rank's GPU with nccl).
    """

    def __init__(self, spec: WeightGroupSpec, rank: int, device: str = "cpu") -> None:
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.spec, self.rank, self.device = spec, rank, device
        self._store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0,
                                    timeout=timeout)
        # As SGLang's side makes it (its init_custom_process_group through torch's _new_process_group_helper):
        # under the group's name, then "<name>/", then "<device>/" of the first device type the backend serves
        # (torch makes one backend when one serves them all: gloo's "cpu/", NCCL's "cuda/").
        kind = dist.Backend.backend_capability[spec.backend][0]
        prefixed = dist.PrefixStore(f"{kind}/", dist.PrefixStore(f"{spec.group_name}/",
                                                                 dist.PrefixStore(spec.group_name, self._store)))
        if spec.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        else:  # pragma: no cover - needs GPUs
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([t], opts).wait()

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Broadcast a bucket's tensors in order (rank 0); return the bytes sent."""
        assert self.rank == 0, "only the trainer's rank 0 sends"
        sent = 0
        for _, t in bucket:
            t = t.to(self.device).contiguous()  # NCCL sends from the rank's GPU
            self._broadcast(t)
            sent += t.numel() * t.element_size()
        return sent

    def receive(self, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
        """Receive the announced tensors (an engine rank)."""
        assert self.rank > 0, "rank 0 sends"
        out = []
        for s in specs:
            t = torch.empty(s.shape, dtype=DTYPE_NAMES[s.dtype], device=self.device)
            self._broadcast(t)
            out.append((s.name, t))
        return out

    def close(self) -> None:
        """Leave the group (the store closes with its last reference)."""
        self._pg = None
        self._store = None
