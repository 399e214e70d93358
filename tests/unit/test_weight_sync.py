"""Weight push to a rollout engine (:func:`cooper_mcore.rollout.weight_sync.sync_weights`) in a world of
one process: the CUDA-IPC limbo is emptied at the end of a push on CUDA machines."""

from __future__ import annotations

import pytest

from cooper_mcore.rollout import weight_sync


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    root = tmp_path_factory.mktemp("ws")
    hf_to_mcore(save_tiny_hf_model(str(root / "hf"), "qwen2"), str(root / "mc"))
    with single_process_world():
        yield load_checkpoint_model(str(root / "mc"), ParallelConfig())


class BucketEngine:
    """Records the events of a push: each ``update_weights`` (its buckets consumed) and each IPC collect."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.buckets = events, []

    def update_weights(self, buckets, version: int) -> None:
        self.buckets = [[name for name, _ in b] for b in buckets]
        self.events.append(f"update_weights v{version}")


@pytest.mark.parametrize("cuda", [True, False])
def test_a_push_ends_by_collecting_the_cuda_ipc_limbo(policy, monkeypatch, cuda):
    """A CUDA tensor shared over CUDA IPC (an SGLang payload) that the sender drops waits in torch's IPC
    limbo until a collect: the push's last bucket would stay allocated through generation. With CUDA the
    push ends with ``torch.cuda.ipc_collect()``, after the engine has loaded every bucket; without it the
    call is not made (it would initialise CUDA)."""
    model, arch = policy
    events: list[str] = []
    monkeypatch.setattr(weight_sync.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(weight_sync.torch.cuda, "ipc_collect", lambda: events.append("ipc_collect"))
    engine = BucketEngine(events)
    stats = weight_sync.sync_weights(model, arch, engine, version=3, bucket_bytes=2**16)
    assert stats["buckets"] == len(engine.buckets) > 1
    assert events == (["update_weights v3", "ipc_collect"] if cuda else ["update_weights v3"])
