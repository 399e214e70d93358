"""Fixes to megatron-core 0.16 that apply on every device (``compat.cpu`` holds the CPU-only ones).

Importing this module applies them, once:

* ``transformer/moe/moe_utils.py`` names ``te_general_gemm`` in ``RouterGatingLinearFunction``
  but defines it only when Transformer Engine imports, so every MoE router without TE (the
  torch-native spec, on a GPU or the CPU) raises ``NameError``. Without TE it is set to None, which
  takes megatron's own ``torch.mm`` branch (the router's logits in ``moe_router_dtype``).
"""

from __future__ import annotations

import megatron.core.transformer.moe.moe_utils as _moe_utils

if not _moe_utils.HAVE_TE and not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None
