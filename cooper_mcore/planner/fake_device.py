"""The one seam of the memory simulation: the trainer's own code run on fake tensors, one rank of a
real layout in one process.

Two pieces stand in for the cluster:

* **A fake process group** (torch's ``"fake"`` backend, :func:`simulated_world`): this process is
  rank ``r`` of a ``world_size`` job; megatron's groups are made as on the cluster; collectives move
  no data (the backend's rule: every other rank holds what this one holds).
* **A simulated device** (:func:`simulated_device`): every tensor is a ``FakeTensor`` (shape, dtype and
  storage size, no data), so a 30B model's rank is built and stepped in a few GiB of host memory.

The trainer reads some device values on the host: lengths and masks, the micro-batch plan, the
routers' expert counts, a finite-loss check, the reward model's scores. So small tensors keep real
values beside their fake ones (FakeTensor's ``constant``, computed for real whenever every input has
one, as FakeTensorMode does for its constants; here up to :data:`SMALL_NUMEL` elements). A small
tensor computed from a large one (a loss from the logits, a router's logits from the hidden states)
gets placeholder values instead: uniform in [0.5, 1.5), so logarithms, square roots and divisions
stay finite and top-k routing spreads evenly; half-precision results get them only when read (the
model's own activations are never read). Reads that bypass the dispatcher (``torch.tensor`` of a
list of tensors, ``Tensor.numpy``) are answered from those values. Placeholders are not the model's
numbers: the simulation measures memory, never values.

What else it takes, all here:

* collectives on fake tensors are not sent (the backend would reject storage-less tensors): the same
  call runs on empty stand-ins, for the ``Work`` its caller waits on; on host values they run as the
  backend runs them;
* object collectives (pickles) run outside the fake tensors; an object this rank would receive
  from a rank the simulation does not run comes from ``remote_objects`` (else a clear error);
  host values broadcast by a rank simulated before reach the later ones (:class:`BroadcastLog`);
* every simulated rank is its model-parallel group's source of host objects (the rollouts and the
  reward model's pairs are made and broadcast by a group's first rank): a simulated later pipeline
  stage makes them itself with the same stand-ins;
* storages resized in place (offloading) and host copies of device state (allocated by the
  functions in ``host_functions``) are reported to the :class:`~cooper_mcore.planner.memory_tracker.MemoryTracker`.

Why not fake tensors of device ``"cuda"``: a CPU build of torch makes them, but its autograd engine
asks the CUDA runtime for streams when it back-propagates through them, and there is none. The
simulation runs the trainer's CPU path (gloo mode, :mod:`cooper_mcore.compat.cpu`), the one the CPU
tests run; the GPU-only branches (Transformer Engine, varlen flash attention, pinned host memory,
SGLang's per-TP-rank weight payloads) are not exercised (docs/planner.md lists what differs).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any, Optional
from unittest import mock

import torch
import torch._subclasses.fake_tensor as fake_tensor_module
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from cooper_mcore import collectives
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.planner.memory_tracker import MemoryTracker

__all__ = ["SMALL_NUMEL", "BroadcastLog", "HostValues", "SimulatedDevice", "simulated_device", "simulated_world"]

SMALL_NUMEL = 1 << 20
"""Tensors of at most this many elements keep host values (4 MiB in fp32): the step's token ids and
masks of a data-parallel rank, a micro-batch's per-token values, a router's logits."""
_HALF = (torch.bfloat16, torch.float16)
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_aten = torch.ops.aten


class HostValues:
    """Placeholder values for small tensors computed from fake ones: uniform in [0.5, 1.5) for
    floating point, 0 for integers, True for booleans (see the module docstring).

    Args:
        seed: seed of the uniform pool the values are drawn from.
    """

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        with unset_fake_temporarily():
            self._pool = torch.rand(SMALL_NUMEL, generator=generator) + 0.5
        self._at = 0

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """Real placeholder values of ``t``'s shape and dtype (on the host)."""
        with unset_fake_temporarily():
            if t.dtype.is_floating_point:
                n = t.numel()
                start = self._at if self._at + n <= SMALL_NUMEL else 0
                self._at = start + n
                return self._pool[start:start + n].view(t.shape).to(t.dtype, copy=True)
            if t.dtype == torch.bool:
                return torch.ones(t.shape, dtype=torch.bool)
            return torch.zeros(t.shape, dtype=t.dtype)

    @staticmethod
    def scalar(t: torch.Tensor) -> Any:
        """A placeholder for ``t.item()``."""
        return True if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 0


@dataclass(frozen=True)
class _OpInfo:
    """What the dispatch rules need to know of an operator (cached per operator)."""

    mutated: Optional[int]  # the position of the argument it writes, if any
    mutated_name: str
    aliasing: bool  # an output is a view of an input (no new storage)
    inplace_view: bool  # changes an input's shape in place (squeeze_, transpose_, ...)
    collective: bool


@functools.cache
def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    schema = func._schema
    mutated = next((i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write),
                   None)
    return _OpInfo(mutated, schema.arguments[mutated].name if mutated is not None else "",
                   any(r.alias_info is not None for r in schema.returns),
                   torch.Tag.inplace_view in func.tags, func.namespace == "c10d")


def _fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


def _known(t: Any) -> bool:
    """A host value or a fake tensor whose values are known."""
    return not _fake(t) or t.constant is not None


class SimulatedDevice(TorchDispatchMode):
    """The dispatch rules of the simulated device (above a ``FakeTensorMode``; see the module docstring).

    Args:
        tracker: where new storages, resizes and host copies are reported.
        values: the placeholder values.
        host_functions: functions that allocate host copies of device state.
    """

    def __init__(self, tracker: MemoryTracker, values: HostValues, host_functions: Sequence[Callable] = ()) -> None:
        super().__init__()
        self.tracker = tracker
        self.values = values
        self.building = False
        self._host_code: set[CodeType] = {f.__code__ for f in host_functions}

    @contextlib.contextmanager
    def building_state(self) -> Iterator[None]:
        """Inside, every new storage is device state (the models, their gradients and optimizers)."""
        self.building = True
        try:
            yield
        finally:
            self.building = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            return self._item(args[0])
        info = _op_info(func)
        flat = pytree.tree_leaves((args, kwargs))
        for t in flat:  # a value left behind by `.data =` (set_data is not dispatched) no longer fits
            if _fake(t) and t.constant is not None and (t.constant.shape != t.shape or t.constant.dtype != t.dtype):
                t.constant = None
        if info.collective:
            return self._collective(func, args, kwargs, flat)
        target = None
        if info.mutated is not None:
            target = args[info.mutated] if info.mutated < len(args) else kwargs.get(info.mutated_name)
        if (_fake(target) and target.constant is not None
                and not all(_known(t) or t.device.type == "meta" for t in flat)):
            # a host value written from device values: placeholders keep it known
            args, kwargs = pytree.tree_map_only(FakeTensor, self._known_copy, (args, kwargs))
        out = func(*args, **kwargs)
        if info.inplace_view and _fake(target) and target.constant is not None:
            # FakeTensorMode leaves a known value's shape behind on in-place views: follow it
            rest = pytree.tree_map_only(FakeTensor, lambda t: t.constant if t.constant is not None else t,
                                        (args[1:], kwargs))
            with unset_fake_temporarily():
                func(target.constant, *rest[0], **rest[1])
        if not info.aliasing:
            self._settle(func, args, kwargs, out, not any(isinstance(t, torch.Tensor) for t in flat))
        return out

    def _item(self, t: torch.Tensor) -> Any:
        if _fake(t) and t.constant is None:
            return HostValues.scalar(t)
        with unset_fake_temporarily():
            return (t.constant if _fake(t) else t).item()

    def _known_copy(self, t: FakeTensor) -> FakeTensor:
        if t.constant is not None:
            return t
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return FakeTensor(t.fake_mode, meta, t.device, constant=self.values.like(t))

    def _settle(self, func, args, kwargs, out, factory: bool) -> None:
        """Report new storages of the device to the tracker (what the models' construction makes, and
        anything computed from the device's tensors; host values made from host values are not the
        device's); then give new small tensors their values."""
        for o in pytree.tree_leaves(out):
            if not _fake(o):
                continue
            if self.building or (o.constant is None and not factory):
                self.tracker.saw(o, state=self.building)
            elif factory and o.constant is None and o.numel() > SMALL_NUMEL:
                self.tracker.saw(o, host=self._allocating_host_copy())
            if o.constant is not None or o.numel() > SMALL_NUMEL or o.device.type == "meta":
                continue  # a byte view of a storage (offload.py) has no values
            if factory and not (self.building and o.dtype.is_floating_point):  # weights are the device's
                with unset_fake_temporarily():
                    o.constant = func(*args, **kwargs)
                    if func in (_aten.empty.memory_format, _aten.empty_strided.default):
                        o.constant.zero_()  # deterministic: sizes may be read from it
            elif not factory and o.dtype not in _HALF:
                o.constant = self.values.like(o)

    def _allocating_host_copy(self) -> bool:
        frame = sys._getframe(1)
        for _ in range(12):
            if frame is None:
                return False
            if frame.f_code in self._host_code:
                return True
            frame = frame.f_back
        return False

    @staticmethod
    def _collective(func, args, kwargs, flat) -> Any:
        """Collectives: on host values as the fake backend runs them; otherwise nothing is sent, and
        the same call on empty stand-ins gives the ``Work`` the caller waits on."""
        if all(_known(t) for t in flat if isinstance(t, torch.Tensor)):
            back: dict[int, FakeTensor] = {}

            def value(t: FakeTensor) -> torch.Tensor:
                back[id(t.constant)] = t
                return t.constant

            with unset_fake_temporarily():
                a, k = pytree.tree_map_only(FakeTensor, value, (args, kwargs))
                out = func(*a, **k)
            return pytree.tree_map_only(torch.Tensor, lambda r: back.get(id(r), r), out)

        def empty(t: FakeTensor) -> torch.Tensor:
            return t.constant if t.constant is not None else torch.empty(0, dtype=t.dtype)

        with unset_fake_temporarily():
            a, k = pytree.tree_map_only(FakeTensor, empty, (args, kwargs))
            if func is torch.ops.c10d.alltoall_base_.default:  # no rows: no split sizes to check
                a = (*a[:3], [], [], *a[5:])
            out = func(*a, **k)
        return (args[0], *out[1:]) if isinstance(out, tuple) else out


class _HostReads(TorchFunctionMode):
    """Reads of tensor values that bypass the dispatcher, answered from the known values."""

    def __init__(self, values: HostValues) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], (list, tuple)):
            data = pytree.tree_map_only(FakeTensor, lambda t: t.item() if t.dim() == 0 else t.tolist(), args[0])
            args = (data, *args[1:])
        elif func is torch.Tensor.numpy and _fake(args[0]):
            t = args[0]
            with unset_fake_temporarily():
                return (t.constant if t.constant is not None else self.values.like(t)).numpy()
        return func(*args, **kwargs)


def _keep_freed_memory_small() -> None:
    """Let glibc return the host values' buffers to the system: its growing mmap threshold would keep
    freed megabyte buffers in the heap, and the simulation makes many (best effort; glibc only)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, not adapted to freed sizes
            libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


@contextlib.contextmanager
def simulated_device(tracker: MemoryTracker, seed: int = 0,
                     host_functions: Sequence[Callable] = ()) -> Iterator[SimulatedDevice]:
    """Inside, every tensor is fake and every storage of the device is reported to ``tracker`` (see
    the module docstring); yields the :class:`SimulatedDevice` (its :meth:`~SimulatedDevice.building_state`
    marks the models' construction).

    Args:
        tracker: the memory tracker.
        seed: seed of the placeholder values.
        host_functions: functions that allocate host copies of device state (counted apart).
    """
    _keep_freed_memory_small()
    device = SimulatedDevice(tracker, HostValues(seed), host_functions)
    resize = torch.UntypedStorage.resize_

    def tracked_resize(storage: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
        out = resize(storage, nbytes)
        tracker.resized(storage)
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(fake_tensor_module, "CONSTANT_NUMEL_LIMIT", SMALL_NUMEL))
        stack.enter_context(mock.patch.object(torch.UntypedStorage, "resize_", tracked_resize))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False))
        stack.enter_context(device)
        stack.enter_context(_HostReads(device.values))
        yield device


class BroadcastLog:
    """The host values each simulated rank broadcast, in order, per source and group, replayed to the
    ranks simulated after it: a later pipeline stage's sums reach an earlier one as on the cluster.

    A value the receiver cannot have (its source not simulated yet, or not a host value) leaves the
    receiver's tensor without values (reads give placeholders).
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[int, tuple[int, ...]], list[Optional[torch.Tensor]]] = {}
        self._read: dict[tuple[int, tuple[int, ...]], int] = {}

    def send(self, key: tuple[int, tuple[int, ...]], tensor: torch.Tensor) -> None:
        """Record what this rank broadcasts as ``key``'s source."""
        value = tensor.constant if _fake(tensor) else tensor
        with unset_fake_temporarily():
            self._streams.setdefault(key, []).append(None if value is None else value.clone())

    def receive(self, key: tuple[int, tuple[int, ...]], tensor: torch.Tensor) -> None:
        """Give ``tensor`` the next value ``key``'s source sent (or no values)."""
        stream, at = self._streams.get(key, []), self._read.get(key, 0)
        self._read[key] = at + 1
        value = stream[at] if at < len(stream) else None
        if _fake(tensor):
            fits = value is not None and value.shape == tensor.shape and value.dtype == tensor.dtype
            with unset_fake_temporarily():
                tensor.constant = value.clone() if fits else None


def _logged_broadcast(fn: Callable, log: BroadcastLog) -> Callable:
    """``torch.distributed.broadcast`` that records this rank's host values as a source, or replays a source's."""

    @functools.wraps(fn)
    def call(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, *args: Any, **kwargs: Any) -> Any:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        source = src if src is not None else ranks[kwargs.get("group_src", 0)]
        key = (source, ranks)
        if source == dist.get_rank():
            log.send(key, tensor)
        else:
            log.receive(key, tensor)
        return fn(tensor, src, group, *args, **kwargs)

    return call


def _outside_fake_tensors(fn: Callable, remote_objects: dict[int, Any]) -> Callable:
    """An object collective run on real tensors; a broadcast from a rank the simulation does not run
    is answered from ``remote_objects``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if fn.__name__ == "broadcast_object_list":
            objects, src = args[0], kwargs.get("src", args[1] if len(args) > 1 else 0)
            if src != dist.get_rank():
                if src not in remote_objects:
                    raise ValueError(f"the simulated rank {dist.get_rank()} would receive an object from rank {src}, "
                                     "which the simulation does not run")
                objects[:] = [remote_objects[src]] * len(objects)
                return None
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return call


_REAL_GROUP_AND_SRC = collectives.model_parallel_group_and_src


def _own_group_source() -> tuple[Any, int]:
    """This rank's model-parallel group with this rank as its first: a simulated rank makes the
    group's host objects (rollouts, pairs) itself."""
    group, _ = _REAL_GROUP_AND_SRC()
    return group, dist.get_rank()


@contextlib.contextmanager
def simulated_world(parallel: ParallelConfig, world_size: int, rank: int, seed: int = 1234,
                    remote_objects: Optional[dict[int, Any]] = None,
                    broadcasts: Optional[BroadcastLog] = None) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake process group, megatron's
    groups of ``parallel`` made as on the cluster (see the module docstring); torn down on exit.

    Args:
        parallel: the layout.
        world_size / rank: the job and the rank this process is.
        seed: megatron's model-parallel RNG seed.
        remote_objects: objects other ranks broadcast to this one, by source rank.
        broadcasts: the host values simulated ranks broadcast (recorded and replayed; default: a log of
            this rank alone).

    Raises:
        ValueError: a process group exists already, or the layout does not fit ``world_size``.
    """
    if dist.is_initialized():
        raise ValueError("simulated_world: torch.distributed is initialised already; the simulation needs a "
                         "process of its own")
    if not 0 <= rank < world_size:
        raise ValueError(f"simulated_world: rank {rank} is not in a world of {world_size}")
    parallel.validate(world_size)
    remote = dict(remote_objects or {})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with contextlib.ExitStack() as stack:
            for name in _OBJECT_COLLECTIVES:
                stack.enter_context(mock.patch.object(dist, name, _outside_fake_tensors(getattr(dist, name), remote)))
            stack.enter_context(mock.patch.object(dist, "broadcast", _logged_broadcast(dist.broadcast,
                                                                                    broadcasts or BroadcastLog())))
            stack.enter_context(mock.patch.object(collectives, "model_parallel_group_and_src", _own_group_source))
            init_distributed(parallel, seed=seed)
            yield
    finally:
        destroy_distributed()
