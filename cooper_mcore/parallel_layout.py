"""The model-parallel layout of a run (TP, PP, EP, expert TP, sequence parallelism): the config
section :class:`ParallelConfig`, which every job's config holds and :mod:`cooper_mcore.parallel`
builds process groups from.

Standard library only, so that the job configs (:mod:`cooper_mcore.config.schema`) load without
torch or megatron-core: ``cooper config KEY`` answers in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ParallelConfig:
    """Model-parallel layout. Data parallelism is whatever is left of the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): the experts of each MoE layer are split over ep ranks."""
    etp: Optional[int] = None
    """Expert tensor-parallel size: each expert's weights are split over etp ranks; null: tp (megatron's default)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in tensor-parallel regions (needs tp > 1)."""
    timeout_minutes: int = 20
    """How long a rank waits in a collective for the others before the job ends with exit 69 (docs/reliability.md)."""

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect: ``etp``, or ``tp`` when it is not set."""
        return self.tp if self.etp is None else self.etp

    def expert_drift_problem(self) -> Optional[str]:
        """Why a mixture-of-experts model cannot train at this layout, or None.

        At ``ep == 1`` megatron treats expert weights as ordinary parameters, reduced over the
        data-parallel group only. With ``etp != tp`` the ranks of a TP group then hold copies (or
        other shards) of the same experts, computed from different tokens under sequence
        parallelism, that nothing reduces: they drift apart from the first step.
        """
        if self.ep == 1 and self.expert_tp != self.tp:
            return (f"parallel.etp={self.expert_tp} with parallel.tp={self.tp} at parallel.ep=1 would let the "
                    f"experts' copies on the TP ranks drift apart (megatron reduces expert gradients over the "
                    f"data-parallel group only at ep=1): set parallel.etp={self.tp} (or leave it unset) or "
                    f"parallel.ep > 1")
        return None

    def validate(self, world_size: int) -> None:
        """Raise ValueError if the layout cannot be built on ``world_size`` processes."""
        if min(self.tp, self.pp, self.ep, self.expert_tp) < 1:
            raise ValueError(f"tp, pp, ep and etp must be >= 1, got tp={self.tp} pp={self.pp} "
                             f"ep={self.ep} etp={self.etp}")
        if world_size % (self.tp * self.pp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp}"
            )
        if world_size % (self.expert_tp * self.ep * self.pp) != 0:
            raise ValueError(f"world size {world_size} is not divisible by the expert layout etp*ep*pp = "
                             f"{self.expert_tp}*{self.ep}*{self.pp}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
