"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import pytest

from cooper_mcore.convert.hf import hf_to_mcore
from cooper_mcore.models.tiny import save_tiny_hf_model


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory) -> tuple[str, str]:
    """Megatron checkpoints of a tiny Qwen3-MoE policy and reward model (aux-loss coefficient 0.01)."""
    root = tmp_path_factory.mktemp("moe")
    out = []
    for i, kind in enumerate(("causal_lm", "reward")):
        hf = save_tiny_hf_model(str(root / f"{kind}-hf"), "qwen3_moe", kind, seed=10 + i, router_aux_loss_coef=0.01)
        hf_to_mcore(hf, str(root / f"{kind}-mcore"))
        out.append(str(root / f"{kind}-mcore"))
    return out[0], out[1]
