"""A faster start for every ``cooper`` command process (each rank of each launch pays it).

megatron-core wraps its fused kernels in ``torch.compile`` when it is imported
(``megatron.core.jit.jit_fuser``), and building each wrapper imports TorchDynamo and TorchInductor:
about a second of CPU per process, whether or not a kernel ever runs (on the CPU path none does).
:func:`import_megatron` imports megatron-core while ``torch.compile`` is replaced by
:func:`deferred_compile`, which returns a function that calls the real ``torch.compile`` with the
same arguments on its first call: a kernel that runs is compiled exactly as before, one that
does not costs nothing. After the import the real ``torch.compile`` is back.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch

_REAL_COMPILE = torch.compile


def deferred_compile(model: Optional[Callable[..., Any]] = None, **kwargs: Any) -> Any:
    """``torch.compile(model, **kwargs)``, done on the first call of the result (a decorator when
    ``model`` is None, as ``torch.compile`` is)."""
    if model is None:
        return lambda fn: deferred_compile(fn, **kwargs)
    compiled: Optional[Callable[..., Any]] = None

    @functools.wraps(model)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = _REAL_COMPILE(model, **kwargs)
        return compiled(*args, **kw)

    return call


def import_megatron() -> None:
    """Import megatron-core with ``torch.compile`` deferred (a no-op once it is imported)."""
    if "megatron.core" in sys.modules:
        return
    torch.compile = deferred_compile  # type: ignore[assignment]
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = _REAL_COMPILE  # type: ignore[assignment]
