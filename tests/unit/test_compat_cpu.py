"""The megatron-core CPU layer adapts megatron-core only, and leaves the rest of torch alone."""

import pytest
import torch

from cooper_mcore.compat.cpu import enable_cpu_mode

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode is off when CUDA is present")


def test_megatron_sees_cpu_for_cuda():
    assert enable_cpu_mode() is True
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules

    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")  # as in the 1F1B schedule
    assert t.device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    schedules.torch.cuda.synchronize()
    with schedules.torch.cuda.stream(schedules.torch.cuda.Stream()):
        pass
    assert clip_grads.torch.tensor([1.0], device="cuda").device.type == "cpu"


def test_rest_of_torch_is_unchanged():
    enable_cpu_mode()
    assert torch.zeros(2).type() == "torch.FloatTensor"  # called from here, not megatron.core
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1).cuda()


def test_rng_tracker_forks_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    enable_cpu_mode()
    mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 123)
    outside = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(3))  # the fork drew from the tracker's seed
