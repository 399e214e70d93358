"""Offload a trained model's state to CPU memory between phases, and swap in the reference model.

Cooper colocates the policy, its frozen reference, the reward model and the rollout engine on the
same GPUs, so each model's training state must leave the device while another phase runs:

* :class:`ModelOffloader` moves a megatron-DDP model's parameters, gradients and optimizer state
  (fp32 main params, Adam moments) to (pinned) CPU memory and frees the device memory, then back.
* :class:`ReferenceSwap` keeps a CPU copy of the reference weights and, for the body of a
  ``with ref.swapped():`` block, copies them into the policy's own parameters, so the reference
  needs no device memory of its own.

How device memory is freed: every tensor involved lives in a *storage*. DDP keeps all parameters
(and all gradients) of a dtype in one contiguous buffer and every ``param`` is a view into it; the
distributed optimizer's fp32 main params are either views into that buffer (fp32 models) or
separate tensors (bf16 models). Rather than rebinding ``.data`` (which would break those views),
each storage is copied byte for byte into a CPU tensor and then resized to 0 bytes in place. Every
tensor that views it stays the same Python object with the same shape and offset, but holds no
memory. Onload resizes the storage back and copies the bytes in, so restoration is bitwise and
nothing that holds a reference (DDP buckets, ``param.main_grad``, the optimizer's ``state`` dict
keyed by parameter) notices. The same happens on CPU (gloo tests): the state is copied into a
separate CPU tensor and the original storage really shrinks to 0 bytes.

megatron-core 0.16 has similar helpers (``_ParamAndGradBuffer.offload_to_cpu``,
``DistributedDataParallel.offload_grad_buffers``, ``MegatronOptimizer.offload_to_cpu``); they are
not used because they drop the gradients, rebind the optimizer's main params with ``p.data =
p.data.cpu()`` (and the fp32 main params of the distributed optimizer are views into the DDP
buffer), and on a CPU-only machine ``.cpu()`` returns the very tensor that is then freed. Only
their storage-resize technique is reused here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CATEGORIES = ("params", "grads", "optimizer")


@dataclass
class TransferStats:
    """What one offload/onload/swap moved.

    Attributes:
        bytes: bytes copied between device and host (0 for state that was only freed or zeroed).
        seconds: wall-clock seconds, including device synchronisation.
    """

    bytes: int = 0
    seconds: float = 0.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor for a copy of device state (pinned for asynchronous copies when ``pin``): every
    host copy of this module is made here (the memory simulation counts them apart from the device)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _StorageStash:
    """One device storage and the host tensor that holds its bytes while it is offloaded.

    The host tensor is allocated at the first offload and kept for later ones (pinned
    allocations are slow); ``nbytes`` is the storage's size when it was last allocated.
    """

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host: torch.Tensor | None = None

    def copy_out(self, pin: bool) -> int:
        """Start copying the storage into the host tensor; returns the bytes copied."""
        assert self.storage.nbytes() == self.nbytes > 0, "storage is not allocated"
        if self.host is None or self.host.numel() != self.nbytes:
            self.host = host_buffer((self.nbytes,), torch.uint8, pin)
        self.host.copy_(_byte_view(self.storage), non_blocking=pin)
        return self.nbytes

    def release(self) -> None:
        """Free the device memory; every view of the storage stays valid but empty."""
        self.storage.resize_(0)

    def restore(self, copy: bool, pin: bool) -> int:
        """Reallocate the storage and copy the saved bytes back (or zero it); returns bytes copied."""
        assert self.storage.nbytes() == 0, "storage was reallocated while offloaded"
        self.storage.resize_(self.nbytes)
        view = _byte_view(self.storage)
        if not copy:
            view.zero_()
            return 0
        assert self.host is not None and self.host.numel() == self.nbytes
        view.copy_(self.host, non_blocking=pin)
        return self.nbytes


def _unique_storages(tensors: Iterable[torch.Tensor], device: torch.device,
                     exclude: set[int]) -> list[torch.UntypedStorage]:
    """The distinct, allocated storages on ``device`` behind ``tensors``, minus ``exclude``.

    Storages are identified by their ``StorageImpl`` address (``_cdata``), which does not change
    when a storage is resized, and which is shared by every view of it.
    """
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or t.device != device:
            continue
        s = t.untyped_storage()
        if s._cdata in exclude or s._cdata in out or s.nbytes() == 0:
            continue
        out[s._cdata] = s
    return list(out.values())


def _sub_optimizers(optimizer) -> list:
    """The optimizers inside ``optimizer`` (itself, or a megatron ChainedOptimizer's members)."""
    if optimizer is None:
        return []
    subs = getattr(optimizer, "chained_optimizers", None)
    return list(subs) if subs is not None else [optimizer]


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Every tensor held by the torch optimizer(s) inside a megatron (or plain torch) optimizer.

    That is the main params (fp32 shards for the distributed optimizer) and their ``.grad``, and
    every tensor of the per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``, ...).
    """
    for sub in _sub_optimizers(optimizer):
        inner = sub if isinstance(sub, torch.optim.Optimizer) else getattr(sub, "optimizer", None)
        if inner is None or getattr(sub, "is_stub_optimizer", False):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


class ModelOffloader:
    """Move a megatron-DDP model's parameters, gradients and optimizer state off the device and back.

    Three categories can be moved independently: ``params`` (DDP's contiguous param buffers, plus
    any parameter outside them), ``grads`` (DDP's grad buffers, i.e. every ``param.main_grad``) and
    ``optimizer`` (main params not already in the param buffers, their grads, and the optimizer
    states). fp32 main params of the distributed optimizer are views into the param buffer, so
    they move with ``params``, not with ``optimizer``.

    Offloading a category that is already offloaded, or onloading one that is not, raises
    ``RuntimeError`` (nothing is moved then): a mismatched call is a bug in the phase logic.
    While a category is offloaded its tensors must not be used (they hold 0 bytes).

    The host copies are allocated at the first offload and kept for the next cycles (pinned
    allocation is slow), so host memory holds one copy of everything offloaded once;
    :meth:`free_host_copies` drops the copies of what is on the device now. A plain module with a
    plain ``torch.optim`` optimizer works too: its ``param.grad`` tensors then move with
    ``optimizer``.

    Example::

        offloader = ModelOffloader(ddp, optimizer)
        stats = offloader.offload()          # before rollout
        ...
        stats = offloader.onload()           # before the next train step

    Args:
        ddp: the megatron ``DistributedDataParallel`` wrapper (its ``buffers`` and
            ``expert_parallel_buffers``), or a plain module (each parameter is then its own storage).
        optimizer: its megatron optimizer (``ChainedOptimizer`` or a single one), or None.
        pin_memory: keep host copies in pinned memory (only on CUDA) for fast async copies.
        discard_grads: do not copy gradients to the host: offload only frees them and onload
            zeroes them (a train step zeroes them first anyway). Halves the grad traffic.
        empty_cache: on CUDA, return freed memory to the driver after offloading, so that
            another process (the rollout engine) can use it.
    """

    def __init__(self, ddp: torch.nn.Module, optimizer=None, pin_memory: bool = True,
                 discard_grads: bool = False, empty_cache: bool = True) -> None:
        self.ddp = ddp
        self.optimizer = optimizer
        self.discard_grads = discard_grads
        self.empty_cache = empty_cache
        # megatron DDP's lists of _ParamAndGradBuffer (a plain module's .buffers is a method)
        buffers = [b for attr in ("buffers", "expert_parallel_buffers")
                   if isinstance(getattr(ddp, attr, None), list) for b in getattr(ddp, attr)]
        module = getattr(ddp, "module", ddp)
        params = [b.param_data for b in buffers if b.param_data is not None]
        params += list(module.parameters())
        assert params, "the model has no parameters"
        self.device = params[0].device
        self._pin = pin_memory and self.device.type == "cuda"
        self._stashes: dict[str, list[_StorageStash]] = {
            "params": [_StorageStash(s) for s in _unique_storages(params, self.device, set())],
        }
        param_ids = {s.storage._cdata for s in self._stashes["params"]}
        grads = [b.grad_data for b in buffers if b.grad_data is not None]
        self._stashes["grads"] = [_StorageStash(s) for s in _unique_storages(grads, self.device, set())]
        grad_ids = {s.storage._cdata for s in self._stashes["grads"]}
        assert not param_ids & grad_ids, "params and grads share a buffer; not supported"
        self._ddp_ids = param_ids | grad_ids
        self._stashes["optimizer"] = []  # collected at offload: Adam creates its state lazily
        self._offloaded: set[str] = set()

    @property
    def offloaded(self) -> frozenset[str]:
        """The categories that are currently off the device."""
        return frozenset(self._offloaded)

    def device_bytes(self, category: str) -> int:
        """Bytes of ``category`` that the device holds now (0 while offloaded).

        For ``optimizer`` this looks at the optimizer's current tensors.
        """
        if category == "optimizer" and category not in self._offloaded:
            stashes = self._collect_optimizer()
        else:
            stashes = self._stashes[category]
        return sum(s.storage.nbytes() for s in stashes)

    def storages(self, category: str) -> list[torch.UntypedStorage]:
        """The device storages of ``category`` (one of :data:`CATEGORIES`): what :meth:`offload` moves."""
        stashes = self._collect_optimizer() if category == "optimizer" else self._stashes[category]
        return [s.storage for s in stashes]

    def free_host_copies(self) -> int:
        """Drop the host copies of the categories that are on the device now; returns bytes freed."""
        freed = 0
        for c in CATEGORIES:
            if c in self._offloaded:
                continue
            for s in self._stashes[c]:
                if s.host is not None:
                    freed += s.host.numel()
                    s.host = None
        return freed

    def _collect_optimizer(self) -> list[_StorageStash]:
        old = {s.storage._cdata: s for s in self._stashes["optimizer"]}
        out = []
        for storage in _unique_storages(_optimizer_tensors(self.optimizer), self.device, self._ddp_ids):
            stash = old.get(storage._cdata)
            if stash is None or stash.nbytes != storage.nbytes():
                stash = _StorageStash(storage)  # new or replaced state (e.g. after load_state_dict)
            else:
                stash.storage = storage
            out.append(stash)
        return out

    @staticmethod
    def _chosen(params: bool, grads: bool, optimizer: bool) -> list[str]:
        return [c for c, on in zip(CATEGORIES, (params, grads, optimizer)) if on]

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> TransferStats:
        """Copy the chosen state to host memory and free its device memory.

        Returns:
            Bytes copied to the host and seconds taken.

        Raises:
            RuntimeError: a chosen category is already offloaded.
        """
        chosen = self._chosen(params, grads, optimizer)
        if already := [c for c in chosen if c in self._offloaded]:
            raise RuntimeError(f"already offloaded: {already}")
        start = time.perf_counter()
        if "optimizer" in chosen:
            self._stashes["optimizer"] = self._collect_optimizer()
        moved = 0
        for c in chosen:
            if c == "grads" and self.discard_grads:
                continue
            moved += sum(s.copy_out(self._pin) for s in self._stashes[c])
        _synchronize(self.device)  # the host copies must be complete before the memory is freed
        for c in chosen:
            for s in self._stashes[c]:
                s.release()
            self._offloaded.add(c)
        if self.device.type == "cuda" and self.empty_cache:
            torch.cuda.empty_cache()
        stats = TransferStats(moved, time.perf_counter() - start)
        logger.debug("offloaded %s: %.1f MiB in %.3f s", chosen, moved / 2**20, stats.seconds)
        return stats

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> TransferStats:
        """Reallocate the chosen state on the device and copy it back bit for bit.

        With ``discard_grads``, gradients come back as zeros.

        Returns:
            Bytes copied to the device and seconds taken.

        Raises:
            RuntimeError: a chosen category is not offloaded.
        """
        chosen = self._chosen(params, grads, optimizer)
        if missing := [c for c in chosen if c not in self._offloaded]:
            raise RuntimeError(f"not offloaded: {missing}")
        start = time.perf_counter()
        moved = 0
        for c in chosen:
            copy = not (c == "grads" and self.discard_grads)
            moved += sum(s.restore(copy, self._pin) for s in self._stashes[c])
        _synchronize(self.device)
        self._offloaded.difference_update(chosen)
        stats = TransferStats(moved, time.perf_counter() - start)
        logger.debug("onloaded %s: %.1f MiB in %.3f s", chosen, moved / 2**20, stats.seconds)
        return stats


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module of DDP-style wrappers (``.module`` chains)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


class ReferenceSwap:
    """The frozen reference model as a CPU copy, swapped into the policy's own parameters on demand.

    Built once, before the first policy update, from the policy's current (initial) weights, or
    from given tensors. ``with ref.swapped(): ...`` saves the policy weights to a host stash,
    copies the reference weights into the policy's parameters, runs the body, and copies the
    policy weights back, bitwise, even if the body raises. Parameters are written in place
    (``copy_``), never rebound, so views into megatron DDP's contiguous buffer stay valid. Only
    the model parameters change; optimizer state (e.g. fp32 main params) is left untouched.

    Args:
        model: the policy: megatron DDP or the bare model (this rank's part of it).
        reference: the reference weights by parameter name (names of the unwrapped model,
            as in ``model.state_dict()``); default: a copy of ``model``'s current weights.
            Every parameter must be present with its shape; values are cast to its dtype.
        pin_memory: keep the host copies in pinned memory (only on CUDA).
    """

    def __init__(self, model: torch.nn.Module, reference: Mapping[str, torch.Tensor] | None = None,
                 pin_memory: bool = True) -> None:
        self._params = dict(_unwrap(model).named_parameters())
        assert self._params, "the model has no parameters"
        devices = {p.device for p in self._params.values()}
        assert len(devices) == 1, f"parameters on several devices: {devices}"
        self.device = devices.pop()
        self._pin = pin_memory and self.device.type == "cuda"
        source = reference if reference is not None else {n: p.detach() for n, p in self._params.items()}
        if missing := sorted(set(self._params) - set(source)):
            raise KeyError(f"reference lacks parameters: {missing[:5]}{'...' if len(missing) > 5 else ''}")
        self._ref: dict[str, torch.Tensor] = {}
        self._stash: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            if tuple(source[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: reference shape {tuple(source[name].shape)} != {tuple(p.shape)}")
            self._ref[name] = self._host_like(p)
            self._ref[name].copy_(source[name])
            self._stash[name] = self._host_like(p)
        self._active = False
        self.last_stats = TransferStats()
        logger.debug("reference copy: %d tensors, %.1f MiB", len(self._ref), self.nbytes / 2**20)

    def _host_like(self, p: torch.Tensor) -> torch.Tensor:
        return host_buffer(tuple(p.shape), p.dtype, self._pin)

    @property
    def nbytes(self) -> int:
        """Host bytes of the reference copy (the policy stash takes as much again)."""
        return sum(t.numel() * t.element_size() for t in self._ref.values())

    @property
    def active(self) -> bool:
        """Whether the reference weights are in the policy's parameters now."""
        return self._active

    def reference_state(self) -> dict[str, torch.Tensor]:
        """The host copy of the reference weights by name (do not modify)."""
        return dict(self._ref)

    @torch.no_grad()
    def _copy(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> int:
        moved = 0
        for name, d in dst.items():
            d.copy_(src[name], non_blocking=self._pin)
            moved += d.numel() * d.element_size()
        _synchronize(self.device)
        return moved

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Within the block the policy's parameters hold the reference weights.

        ``last_stats`` gets the bytes moved and seconds spent by the swaps in and out (the body
        excluded), for the trainer's timing metrics.

        Raises:
            RuntimeError: already inside ``swapped()``, or the parameters are offloaded.
        """
        if self._active:
            raise RuntimeError("the reference is already swapped in")
        if empty := [n for n, p in self._params.items() if p.untyped_storage().nbytes() == 0]:
            raise RuntimeError(f"parameters are offloaded (e.g. {empty[0]}); onload them first")
        params = {n: p.detach() for n, p in self._params.items()}
        start = time.perf_counter()
        moved = self._copy(self._stash, params)
        swap_in = 0.0
        self._active = True
        try:
            moved += self._copy(params, self._ref)
            swap_in = time.perf_counter() - start
            yield
        finally:
            start = time.perf_counter()
            moved += self._copy(params, self._stash)
            self._active = False
            self.last_stats = TransferStats(moved, swap_in + time.perf_counter() - start)
