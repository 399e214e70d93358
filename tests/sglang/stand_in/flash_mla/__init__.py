"""Hides the CUDA-only ``flash_mla`` (the ``sgl-flash-mla`` wheel sglang 0.5.23 pulls in) in the CPU
test tier.

Without ``libcuda.so.1`` its import raises ``OSError``, which megatron-core's optional import
(``megatron/core/transformer/attention.py``: ``except ImportError``) does not catch, so no
Megatron model could be built next to SGLang. Raising ``ImportError`` here makes both megatron-core
and SGLang treat it as absent, as on any machine without it.
"""

raise ImportError("flash_mla is CUDA-only; hidden by tests/sglang/stand_in in the CPU test tier")
