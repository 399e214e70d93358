"""Live bytes of a simulated GPU, by kind, and the peak of each phase of a step.

The simulation (:mod:`cooper_mcore.planner.simulate`) runs the trainer on fake tensors
(:mod:`cooper_mcore.planner.fake_device`), which allocate nothing; every storage a fake tensor of the
simulated device gets is reported here when it is made (:meth:`MemoryTracker.saw`), its size
followed when it is resized (offloading frees a storage by resizing it to 0 bytes) and dropped when
it dies (a finalizer on the storage). The total of the live storages is what the caching allocator
would have to hold at that moment (live bytes, not the allocator's reserved blocks: its rounding
and fragmentation are not seen).

Each storage has a kind, the planner's component names where they match (:data:`KINDS`):

* the models' state, labelled after they are built (:meth:`MemoryTracker.label`) from what their
  offloaders hold: ``policy_params``, ``policy_grads``, ``policy_optimizer``, and the same for
  ``rm_``; ``other`` for the rest made while building (rotary tables, RNG state);
* transients made later: ``logits`` (a last dimension of a model's vocabulary slice: the logits, their
  gradient, the loss's chunk temporaries), ``buffers`` (made during ``weight_sync``: the gathered
  weights and their buckets), ``activations`` (everything else: what autograd keeps, workspace, the
  optimizer step's temporaries);
* host copies (the reference weights, offloaded state) are counted apart (:attr:`MemoryTracker.host`).

A phase's peak is the most the live total reached while it ran (nested phases count toward the
enclosing ones, as :class:`~cooper_mcore.metrics.PhaseTimer` does), with the bytes of every kind at
that moment.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from cooper_mcore.metric_names import Phase

__all__ = ["KINDS", "STATE_KINDS", "MemoryTracker", "PhasePeak"]

#: the trained models' state, named as the planner's components
STATE_KINDS = ("policy_params", "policy_grads", "policy_optimizer", "rm_params", "rm_grads", "rm_optimizer")
#: every kind of device memory the tracker tells apart
KINDS = STATE_KINDS + ("other", "activations", "logits", "buffers")


@dataclass
class PhasePeak:
    """The most a phase held: ``total`` live bytes, and each kind's bytes at that moment."""

    phase: str
    total: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


class MemoryTracker:
    """Live bytes of the simulated device by kind, per-phase peaks, and host bytes.

    Args:
        vocab_widths: last dimensions that mark a tensor as logits (each model's vocabulary slice on
            this rank).
    """

    def __init__(self, vocab_widths: Iterable[int] = ()) -> None:
        self.vocab_widths = set(vocab_widths)
        self.by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.host = 0
        self.host_peak = 0
        self.peaks: dict[str, PhasePeak] = {}
        self._live: dict[int, tuple[int, str]] = {}  # storage id -> (bytes, kind or "host")
        self._active: list[str] = []
        self._interval = 0

    def saw(self, tensor: torch.Tensor, state: bool = False, host: bool = False) -> None:
        """Count the storage of a new tensor of the simulated device (once; later views add nothing).

        Args:
            tensor: a fake tensor just made.
            state: made while the models are built (labelled later by :meth:`label`).
            host: a host copy of device state.
        """
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        kind = "host" if host else "other" if state else self._transient_kind(tensor)
        self._live[key] = (0, kind)
        self._set(key, storage.nbytes())
        weakref.finalize(storage, self._died, key)

    def _transient_kind(self, tensor: torch.Tensor) -> str:
        if Phase.WEIGHT_SYNC in self._active:
            return "buffers"
        if tensor.dim() and tensor.shape[-1] in self.vocab_widths:
            return "logits"
        return "activations"

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Follow a storage resized in place (offload frees a storage by resizing it to 0 bytes)."""
        if storage._cdata in self._live:
            self._set(storage._cdata, storage.nbytes())

    def label(self, kind: str, storages: Iterable[torch.UntypedStorage]) -> None:
        """Give ``kind`` (one of :data:`STATE_KINDS`) to storages already counted (a model's state)."""
        assert kind in STATE_KINDS, kind
        for storage in storages:
            entry = self._live.get(storage._cdata)
            if entry is None or entry[1] == "host":
                continue
            nbytes, old = entry
            self.by_kind[old] -= nbytes
            self.by_kind[kind] += nbytes
            self._live[storage._cdata] = (nbytes, kind)

    def _set(self, key: int, nbytes: int) -> None:
        old, kind = self._live[key]
        self._live[key] = (nbytes, kind)
        if kind == "host":
            self.host += nbytes - old
            self.host_peak = max(self.host_peak, self.host)
            return
        self.by_kind[kind] += nbytes - old
        self.total += nbytes - old
        self._interval = max(self._interval, self.total)
        for name in self._active:
            if self.total > self.peaks[name].total:
                self.peaks[name] = PhasePeak(name, self.total, dict(self.by_kind))

    def _died(self, key: int) -> None:
        if key in self._live:
            self._set(key, 0)
            del self._live[key]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of the block as phase ``name`` (a phase entered again keeps its highest peak)."""
        peak = self.peaks.setdefault(name, PhasePeak(name))
        if self.total > peak.total or not peak.kinds:
            self.peaks[name] = PhasePeak(name, self.total, dict(self.by_kind))
        self._active.append(name)
        try:
            yield
        finally:
            self._active.remove(name)

    def interval_peak(self) -> int:
        """The most the live total reached since the last call (a
        :class:`~cooper_mcore.metrics.PhaseTimer`'s ``peak_memory``)."""
        peak, self._interval = self._interval, self.total
        return peak
