"""GPU tier: bf16 Megatron forward against transformers on a CUDA device (skipped without one)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_bf16_logits_close_to_transformers(tmp_path):
    import transformers

    from cooper_mcore.convert.compare import compare_logits
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2", dtype=torch.bfloat16,
                                hidden_size=256, intermediate_size=512, num_attention_heads=8)
    hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    with single_process_world():
        diff = compare_logits(hf_dir, str(tmp_path / "mc"), ParallelConfig(), batch=4, seq=64)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    assert ref.dtype == torch.bfloat16
    assert diff < 0.1  # bf16 kernels differ (SDPA flash vs eager); fp32 is exact on CPU
