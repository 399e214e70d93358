"""Run megatron-core 0.16 on CPU with the gloo backend.

megatron-core assumes CUDA in a handful of places. This module is the only place in
cooper_mcore that adapts it, and it does nothing when CUDA is available.

What it covers (see docs/training.md, "CPU mode"):

1. ``torch.cuda.current_device()``, ``device="cuda"`` literals, ``torch.cuda.synchronize``,
   streams and events inside megatron-core modules. Each imported ``megatron.core`` module
   that holds the ``torch`` module as a global gets a proxy of it instead: factory functions
   (``torch.zeros``, ``torch.empty``, ...) map CUDA devices to CPU, and ``proxy.cuda`` answers
   with the CPU device, no-op synchronisation and dummy streams/events. Code outside
   megatron-core keeps the real ``torch``.
2. The CUDA RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``):
   backed by the CPU generator (``torch.get_rng_state``/``set_rng_state``); its warning that the
   CPU generator moved inside a fork is filtered, as that generator is the forked one.
3. ``Tensor.type()`` string checks for ``torch.cuda.FloatTensor`` (optimizer wrappers, grad
   clipping) and ``Tensor.cuda()``: answered as if on CUDA, but only for callers inside
   ``megatron.core`` (the calling frame's module name is checked), so nothing else changes.
4. The MoE alltoall dispatcher's split sizes (expert parallelism): tensors off CUDA, which gloo's
   ``all_to_all_single`` rejects; ``_AllToAll`` gets them as lists.

Call :func:`enable_cpu_mode` once, after importing megatron-core and before building models.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Any

# the megatron-core modules the CPU paths use: imported here, so that enable_cpu_mode() proxies their torch
import megatron.core.dist_checkpointing  # noqa: F401
import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401
import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
import megatron.core.dist_checkpointing.strategies.fully_parallel  # noqa: F401
import megatron.core.dist_checkpointing.strategies.state_dict_saver  # noqa: F401
import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
import megatron.core.distributed  # noqa: F401
import megatron.core.models.gpt  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import megatron.core.optimizer.clip_grads  # noqa: F401
import megatron.core.parallel_state  # noqa: F401
import megatron.core.pipeline_parallel.p2p_communication  # noqa: F401
import megatron.core.pipeline_parallel.schedules  # noqa: F401
import megatron.core.tensor_parallel  # noqa: F401
import megatron.core.transformer  # noqa: F401
import torch
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.tensor_parallel.mappings import _AllToAll

logger = logging.getLogger(__name__)

_ENABLED = False
_PROXY = None
_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_strided", "as_tensor", "linspace",
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_factory(fn):
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper


class _DummyStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *a, **k: self

    def query(self) -> bool:
        return True


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as seen by megatron-core on a machine without CUDA."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.random = types.SimpleNamespace(
            get_rng_state=lambda device=None: torch.get_rng_state(),
            set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        )
        self.Stream = _DummyStream
        self.Event = _DummyStream

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def stream(*args: Any, **kwargs: Any):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _DummyStream:
        return _DummyStream()

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    max_memory_allocated = memory_allocated
    memory_reserved = memory_allocated

    @staticmethod
    def empty_cache() -> None:
        return None


class _TorchOnCpu(types.ModuleType):
    """The ``torch`` module as seen by megatron-core on CPU (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _called_from_megatron(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return frame.f_globals.get("__name__", "").startswith("megatron.core")


def _patch_tensor_methods() -> None:
    orig_type = torch.Tensor.type
    orig_cuda = torch.Tensor.cuda

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and _called_from_megatron():
            name = orig_type(self).replace("torch.meta.", "torch.")  # a fake tensor (memory simulation) is on meta
            if self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
                return "torch.cuda." + name[len("torch."):]
            return name
        return orig_type(self, dtype, non_blocking, **kwargs)

    def cuda_(self, *args, **kwargs):
        if _called_from_megatron():
            return self
        return orig_cuda(self, *args, **kwargs)

    torch.Tensor.type = type_
    torch.Tensor.cuda = cuda_


def _patch_rng() -> None:
    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    # the tracker's fork() warns when the CPU generator moved inside a "GPU" RNG context; here the
    # CUDA generator is the CPU one, so it always moves (every MoE layer's forward forks): not news
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())


def _proxy_megatron_modules(proxy: _TorchOnCpu) -> int:
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(mod, "torch", None) is torch:
            mod.torch = proxy
            n += 1
    return n


def _split_sizes(sizes: Any) -> Any:
    """Split sizes as a list of ints (gloo's ``all_to_all_single`` takes no tensor)."""
    return sizes.tolist() if torch.is_tensor(sizes) else sizes


def _patch_all_to_all() -> None:
    """The MoE alltoall dispatcher under expert parallelism keeps its split sizes as tensors when they
    are not on CUDA (``maybe_move_tensor_to_cpu`` converts only CUDA tensors to numpy); give
    ``_AllToAll`` lists instead."""
    forward = _AllToAll.forward

    def forward_with_lists(ctx, group, input, output_split_sizes, input_split_sizes):  # noqa: A002 (megatron's name)
        return forward(ctx, group, input, _split_sizes(output_split_sizes), _split_sizes(input_split_sizes))

    _AllToAll.forward = staticmethod(forward_with_lists)


def enable_cpu_mode(force: bool = False) -> bool:
    """Adapt megatron-core to CPU + gloo when CUDA is not available.

    Idempotent. Each call re-scans ``sys.modules``, so megatron-core modules imported since
    the last call are covered too; the modules cooper_mcore uses are imported here first.

    Args:
        force: apply the CPU adaptations even if CUDA is available (for tests only).

    Returns:
        True if CPU mode is active.
    """
    global _ENABLED, _PROXY
    if torch.cuda.is_available() and not force:
        return False
    if _PROXY is None:
        _PROXY = _TorchOnCpu()
    n = _proxy_megatron_modules(_PROXY)  # again on each call: covers modules imported since
    if _ENABLED:
        return True
    _patch_rng()
    _patch_tensor_methods()
    _patch_all_to_all()
    _ENABLED = True
    logger.info("megatron-core CPU mode: proxied torch in %d modules", n)
    return True


def cpu_mode_enabled() -> bool:
    """Whether :func:`enable_cpu_mode` has adapted megatron-core to CPU."""
    return _ENABLED
