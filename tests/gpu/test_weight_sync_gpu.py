"""GPU tier: a weight push over CUDA IPC leaves none of its buckets allocated (skipped without CUDA).

The policy's buckets go to an SGLang engine as CUDA-IPC payloads; here the engine is a stand-in for
SGLang's scheduler in a process of its own, which opens each payload's handle, reads the bucket and
drops it. A shared block that the trainer drops while a receiver may still hold it waits in torch's
IPC limbo; without a collect at the end of the push the last bucket stayed allocated through
generation.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning")]


def _rebuild_cuda_tensor(*args):
    """torch's ``rebuild_cuda_tensor`` with the device named by its UUID (as SGLang's patched
    reductions, and :mod:`cooper_mcore.rollout.sglang_payload`, send it) mapped back to an index."""
    from torch.multiprocessing import reductions

    args = list(args)
    if isinstance(args[6], str):
        args[6] = next(i for i in range(torch.cuda.device_count())
                       if str(torch.cuda.get_device_properties(i).uuid) == args[6])
    return reductions.rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        return super().find_class(module, name)


def _receiver(conn) -> None:
    """The stand-in scheduler: for each payload, rebuild its bucket (over CUDA IPC), checksum it, drop
    it and answer ``(device type, bytes, checksum)``; stop on None."""
    import torch.multiprocessing  # noqa: F401  (torch's reductions, for the payload's other objects)

    while (blob := conn.recv()) is not None:
        flat = _Unpickler(io.BytesIO(blob)).load()["flattened_tensor"]
        answer = (flat.device.type, flat.numel() * flat.element_size(), int(flat.sum(dtype=torch.int64)))
        del flat
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        conn.send(answer)


class ReceiverEngine:
    """The ``sglang.Engine`` methods :class:`SGLangEngine` calls for a weight update; each bucket's
    payload is loaded by the receiver process before the call returns, as SGLang's is."""

    def __init__(self, conn) -> None:
        self.conn, self.loaded = conn, []

    def begin_weight_update(self, selector="all"):
        return True, "Success"

    def end_weight_update(self):
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        (blob,) = named_tensors  # one SGLang TP rank
        self.conn.send(blob)
        self.loaded.append(self.conn.recv())
        return True, "Success"


def push_through_a_receiver(model, arch, bucket_bytes: int) -> tuple[int, dict, list]:
    """Push ``model`` into an SGLang engine whose payloads a receiver process loads; returns the change
    of ``torch.cuda.memory_allocated()`` over the push (0 on CPU), its stats and the receiver's answers."""
    from cooper_mcore.rollout.sglang_engine import SGLangEngine
    from cooper_mcore.rollout.weight_sync import sync_weights

    cuda = next(model.parameters()).is_cuda
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        receiver = ReceiverEngine(conn)
        engine = SGLangEngine(engine=receiver, tp_size=1, device="cuda" if cuda else "cpu")
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        stats = sync_weights(model, arch, engine, version=1, bucket_bytes=bucket_bytes)
        if cuda:
            torch.cuda.synchronize()
        change = (torch.cuda.memory_allocated() if cuda else 0) - before
    finally:
        conn.send(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0, proc.exitcode
    return change, stats, receiver.loaded


def test_a_push_over_cuda_ipc_leaves_no_bucket_allocated(tmp_path):
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.forward import unwrap
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    # untied qwen2: the push ends with lm_head.weight (8192 x 256 fp32 = 8 MiB), a bucket of its own
    hf = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2", hidden_size=256, intermediate_size=512,
                            num_attention_heads=8, vocab_size=8192)
    hf_to_mcore(hf, str(tmp_path / "mc"))
    with single_process_world():
        model, arch = load_checkpoint_model(str(tmp_path / "mc"), ParallelConfig())
        lm_head = unwrap(model).output_layer.weight.detach()
        assert lm_head.is_cuda
        expected_last = (lm_head.numel() * lm_head.element_size(),
                         int(lm_head.view(torch.uint8).sum(dtype=torch.int64)))
        change, stats, loaded = push_through_a_receiver(model, arch, bucket_bytes=2**20)
    assert stats["buckets"] == len(loaded) > 2
    assert {d for d, _, _ in loaded} == {"cuda"}  # the receiver read the trainer's GPU memory over CUDA IPC
    assert loaded[-1][1:] == expected_last and expected_last[0] == 8 * 2**20
    # every bucket is freed once the push returns: the last one (8 MiB) no longer waits in the IPC limbo
    # (the allocator rounds blocks to 512 bytes; nothing else of the push stays)
    assert abs(change) < 2**18, change
