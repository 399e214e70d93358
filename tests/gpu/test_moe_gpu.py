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
