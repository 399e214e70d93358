"""Every tensor collective cooper_mcore issues hands the collective a tensor on the compute device.

On GPUs the process groups are NCCL's, which reject host tensors ("No backend type associated with
device type cpu"); on CPU they are gloo's, which accept everything, so a host tensor slips through
the CPU tests (the RM scores' pipeline broadcast did). Two checks model the CUDA world:

* statically, no module but :mod:`cooper_mcore.collectives` calls ``torch.distributed``'s
  tensor collectives (the weight gather of :mod:`cooper_mcore.rollout.weight_sync`, whose tensors
  are parameters, is the one exception);
* dynamically, the helpers there move what they are given to ``parallel.device()``: with the
  compute device played by the ``meta`` device, every tensor that reaches a collective must be on it.
"""

from __future__ import annotations

import ast
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cooper_mcore import collectives, parallel

ROOT = Path(__file__).resolve().parents[2] / "cooper_mcore"
TENSOR_COLLECTIVES = {"broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
                      "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                      "send", "recv", "isend", "irecv"}
ALLOWED = {"collectives.py", "rollout/weight_sync.py"}


def _direct_collectives(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in TENSOR_COLLECTIVES:
            base = ast.unparse(node.func.value)
            if base in ("dist", "torch.distributed"):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {base}.{node.func.attr}")
    return hits


def test_no_module_issues_tensor_collectives_directly():
    hits = [h for p in ROOT.rglob("*.py") if str(p.relative_to(ROOT)) not in ALLOWED for h in _direct_collectives(p)]
    assert not hits, "route these through cooper_mcore.collectives (it puts tensors on the device):\n" + \
        "\n".join(hits)


@pytest.fixture
def meta_device(monkeypatch):
    """The compute device is ``meta``; collectives record the devices they are handed."""
    seen: list[torch.device] = []

    def record(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
        seen.extend(t.device for t in tensors)

    for name in ("broadcast", "all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, record)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(collectives, "device", lambda: torch.device("meta"))
    return seen


def test_helpers_hand_collectives_device_tensors(meta_device, monkeypatch):
    host = torch.zeros(3)  # what a careless caller passes: a host tensor
    collectives.broadcast_from_last_stage(host, pp_group=object())
    collectives.all_reduce(host)
    collectives.all_gather(host)
    assert meta_device and all(d.type == "meta" for d in meta_device), meta_device
    meta_device.clear()  # the group leader's side of the tensor broadcast (the others read the shape's values)
    monkeypatch.setattr(collectives, "model_parallel_group_and_src", lambda: (object(), 0))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    out = collectives.broadcast_tensor_in_model_parallel_group(torch.zeros(2, 3, dtype=torch.int16), torch.int16)
    assert out.shape == (2, 3) and out.dtype == torch.int16 and out.device.type == "meta"
    assert len(meta_device) == 2 and all(d.type == "meta" for d in meta_device), meta_device


def test_the_process_group_timeout_is_the_configured_one(monkeypatch):
    """The default group gets ``parallel.timeout_minutes`` (20 by default, sized in docs/reliability.md), not the
    10 minutes of NCCL's default, so ranks that wait while the leader generates are not killed."""
    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.delenv("RANK", raising=False)
    assert parallel.ParallelConfig().timeout_minutes == 20
    with pytest.raises(RuntimeError, match="stop here"):
        parallel.init_distributed(parallel.ParallelConfig(timeout_minutes=75))
    assert seen["timeout"] == datetime.timedelta(minutes=75)


def _group_timeout(group) -> datetime.timedelta:
    """The collective timeout a process group's backend (gloo here, NCCL on GPUs) was built with."""
    return group._get_backend(parallel.device()).options._timeout


def test_megatron_groups_get_the_configured_timeout():
    """``parallel.timeout_minutes`` reaches megatron's TP/PP/DP/model-parallel groups too, not only the
    world group: without it they keep megatron's 30-minute default and ranks waiting on leader-only
    work abort after 30 minutes whatever the setting says."""
    from megatron.core import parallel_state

    want = datetime.timedelta(minutes=75)
    with parallel.single_process_world(parallel.ParallelConfig(timeout_minutes=75)):
        groups = {
            "world": dist.group.WORLD,
            "tensor": parallel_state.get_tensor_model_parallel_group(),
            "pipeline": parallel_state.get_pipeline_model_parallel_group(),
            "data": parallel_state.get_data_parallel_group(),
            "data+context": parallel_state.get_data_parallel_group(with_context_parallel=True),
            "model": parallel_state.get_model_parallel_group(),
        }
        got = {name: _group_timeout(g) for name, g in groups.items()}
    assert got == dict.fromkeys(groups, want)
