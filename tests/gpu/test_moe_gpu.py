"""GPU tier: a tiny Qwen3-MoE (megatron's router and alltoall dispatcher, torch-native spec) on a CUDA device.

Megatron's router computes its logits in fp32 (``moe_router_dtype``) where transformers uses the
model's dtype, so in bf16 a near-tie between two experts can route a token differently: the bf16
check is on the mean difference, the fp32 one on the maximum.
"""

import logging

import pytest
import torch

pytestmark = pytest.mark.gpu
logger = logging.getLogger(__name__)


@pytest.mark.parametrize("dtype,stat,tol", [(torch.float32, "max", 1e-3), (torch.bfloat16, "mean", 0.05)])
def test_moe_logits_close_to_transformers_on_gpu(tmp_path, dtype, stat, tol):
    import transformers

    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.convert.compare import sample_batch
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.forward import forward_only
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen3_moe", dtype=dtype, hidden_size=256,
                                moe_intermediate_size=128, num_attention_heads=8)
    hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    ids, _ = sample_batch(128, 4, 64, None, 0)
    with single_process_world():
        model, arch = load_checkpoint_model(str(tmp_path / "mc"), ParallelConfig())
        assert next(model.parameters()).is_cuda and arch.moe is not None
        out = forward_only(model, ids).float().cpu()
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        want = ref(ids.cuda()).logits.float().cpu()
    diff = (out - want).abs()
    logger.warning("MoE logits on the GPU, %s: max %.3g, mean %.3g", dtype, diff.max(), diff.mean())
    assert getattr(diff, stat)() < tol


def test_grouped_experts_equal_sequential_mlp_in_bf16_on_gpu(tmp_path):
    """``GroupedExperts`` (``torch._grouped_mm`` on compute capability 9.x, else one matmul per expert)
    against megatron's ``SequentialMLP`` from one bf16 checkpoint, forward and backward. Both multiply
    each expert's tokens by its weights with fp32 accumulation and round the products to bf16 (2^-8
    relative) in kernels of another blocking, so logits of size ~3 differ by a few bf16 steps (0.05
    at most), and a near-tie in a later router (fp32 logits computed from those inputs) may move a
    token to another expert: the mean is the check (0.01), the max is logged."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from cooper_mcore.convert.hf import hf_to_mcore, load_hf_weights
    from cooper_mcore.models.arch import ArchSpec, load_hf_config
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.models.experts import grouped_mm_supported
    from cooper_mcore.models.forward import position_ids_for
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen3_moe", dtype=torch.bfloat16, hidden_size=256,
                                moe_intermediate_size=128, num_attention_heads=8, mlp_only_layers=[])
    hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    arch = ArchSpec.from_hf_config(load_hf_config(hf_dir))
    ids = torch.randint(1, 128, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    logits = {}
    with single_process_world():
        for grouped in (True, False):
            model = build_model(arch, ParallelConfig(), dtype=torch.bfloat16, init_weights=False,
                                grouped_experts=grouped)
            load_hf_weights(model, hf_dir, arch)
            out = model(ids, position_ids_for(ids), None)
            out.float().pow(2).mean().backward()
            logits[grouped] = out.detach().float().cpu()
            experts = model.decoder.layers[0].mlp.experts
            if grouped:
                w = experts.linear_fc1.weight
                x = torch.zeros(8, arch.hidden_size, dtype=w.dtype, device=w.device)
                logger.warning("torch._grouped_mm used: %s (capability %s)", grouped_mm_supported(x, w),
                               torch.cuda.get_device_capability())
                assert float(w.grad.abs().max()) > 0
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # set by the backward outside megatron's schedule
    diff = (logits[True] - logits[False]).abs()
    logger.warning("grouped vs sequential experts, bf16 logits: max %.3g, mean %.3g", diff.max(), diff.mean())
    assert float(diff.mean()) < 0.01
