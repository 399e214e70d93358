"""Fixes to megatron-core 0.16 that apply on every device (``compat.cpu`` holds the CPU-only ones).

Importing this module applies them, once:

* ``transformer/moe/moe_utils.py`` names ``te_general_gemm`` in ``RouterGatingLinearFunction``
  but defines it only when Transformer Engine imports, so every MoE router without TE (the
  torch-native spec, on a GPU or the CPU) raises ``NameError``. Without TE it is set to None, which
  takes megatron's own ``torch.mm`` branch (the router's logits in ``moe_router_dtype``).
* With a padding mask, a router weighs its rank's part of the load-balancing loss by that rank's
  real tokens under the per-token loss mode (``get_tokens_per_expert_and_token_count``'s
  ``local_num_tokens``, ``router.py``). The loss is one sum over the sequence-parallel ranks'
  parts, so parts weighted by different counts give another gradient than one process would (a
  rank whose slice is mostly padding would hardly count). Each rank gets the mean count of its
  reduce group instead: the weight megatron gives without padding, when the slices are even.
* The checkpoint writer (``FileSystemWriterAsync``) hands a save's results back through a queue
  served by a multiprocessing Manager it spawns at the process's first save: a new interpreter
  that imports torch to unpickle them (2-3 s of CPU per process, for each rank of each
  launch, measured at tiny scale), and a process that a Ctrl-C or a scheduler's signal to the
  process group kills in the middle of the write. cooper saves synchronously only: the writer runs
  in the saving process (its forked shard writers report through a queue of their own), so the
  results go through an in-process queue instead.
"""

from __future__ import annotations

import queue

import megatron.core.transformer.moe.moe_utils as _moe_utils
import megatron.core.transformer.moe.router as _router
from megatron.core.dist_checkpointing.strategies import filesystem_async as _writer

if not _moe_utils.HAVE_TE and not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None

_token_counts = _moe_utils.get_tokens_per_expert_and_token_count


def _even_token_counts(routing_map, reduce_group, topk=None, with_padding_mask=False):
    """megatron's counts, the local one the reduce group's mean when padding is masked."""
    per_expert, local, total = _token_counts(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
    if with_padding_mask:
        local = total / reduce_group.size()
    return per_expert, local, total


if getattr(_router.get_tokens_per_expert_and_token_count, "__name__", "") != _even_token_counts.__name__:
    _router.get_tokens_per_expert_and_token_count = _even_token_counts

if hasattr(_writer, "_get_write_results_queue") and getattr(_writer, "_results_queue", None) is None:
    _writer._results_queue = queue.Queue()
