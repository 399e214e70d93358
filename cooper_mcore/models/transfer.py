"""Small host tensors copied to the device without stalling the host.

A plain ``tensor.to("cuda")`` of pageable host memory waits for the copy, and so for every kernel
queued before it on the stream: one such copy per layer (a mixture-of-experts layer's expert offsets,
a router's replayed routes) stalls the host once per layer. Staged through pinned memory the copy is
queued on the current stream like a kernel (torch's caching host allocator keeps the pinned block
until the copy has run) and the host goes on queueing work.
"""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: queued without waiting from a CUDA host; a plain copy elsewhere (CPU, meta).

    Args:
        t: the tensor (any device; one already on ``device`` is returned as is).
        device: where it goes.

    Returns:
        ``t`` on ``device``; read it only in work queued on the current stream (as every kernel is).
    """
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
