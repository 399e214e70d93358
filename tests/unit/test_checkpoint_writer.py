"""megatron-core's checkpoint writer as cooper runs it (:mod:`cooper_mcore.compat.megatron_fixes`): a
save hands its results back in the saving process, with no Manager process of megatron's (a new
interpreter per process that imported torch at the first save, and that a Ctrl-C to the process group
killed in the middle of a write)."""

from __future__ import annotations

import multiprocessing
import queue

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor, load_plain_tensors
from megatron.core.dist_checkpointing.strategies import filesystem_async

import cooper_mcore.compat.megatron_fixes  # noqa: F401  (what every model build imports)
from cooper_mcore.parallel import single_process_world


def test_a_save_leaves_no_process_behind_and_reads_back(tmp_path):
    weight = torch.arange(12.0).reshape(3, 4)
    with single_process_world():
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight.clone(), replica_id=0)},
                                str(tmp_path))
        assert isinstance(filesystem_async._results_queue, queue.Queue)
        assert multiprocessing.active_children() == []  # the forked shard writers are done, no manager runs
        assert torch.equal(load_plain_tensors(str(tmp_path))["w"], weight)
