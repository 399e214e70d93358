"""Sizes for the memory planner (:mod:`cooper_mcore.planner.plan`): parameters of a model or of one
TP/PP rank as megatron-core lays them out, training state, KV cache, activations and logits.

Pure arithmetic on :class:`~cooper_mcore.models.arch.ArchSpec`; the conventions (what autograd
keeps, which copies the loss makes) are documented in :mod:`cooper_mcore.planner.plan`.
"""

from __future__ import annotations

import math

from cooper_mcore.models.arch import ArchSpec

__all__ = ["CUDA_CONTEXT_GIB", "DTYPE_BYTES", "GIB", "H100_80GB_GIB", "check_layout", "kv_bytes_per_token",
           "layer_activation_bytes", "layer_numel", "logits_bytes", "model_numel", "stage_numel", "training_state"]

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
CUDA_CONTEXT_GIB = 0.75
"""One process's CUDA context on one GPU, cuBLAS initialised: 736 MiB (618 MiB before the first
matmul) measured with nvidia-smi for torch 2.11+cu130 on an H100 80GB HBM3, driver 580.159."""
H100_80GB_GIB = 79.18
"""What ``torch.cuda.mem_get_info()`` reports as the total memory of an H100 80GB HBM3 (measured)."""


def check_layout(arch: ArchSpec, tp: int, pp: int, name: str = "model") -> None:
    """Raise ValueError if ``arch`` cannot be split ``tp`` x ``pp`` (as the model builder requires).

    Mixture-of-experts models are refused: these sizes count dense MLPs only.
    """
    arch.require_dense("the memory planner (cooper_mcore/planner/sizes.py)")
    checks = (("num_layers", arch.num_layers, "pp", pp), ("num_key_value_heads", arch.num_query_groups, "tp", tp),
              ("num_attention_heads", arch.num_attention_heads, "tp", tp), ("vocab_size", arch.vocab_size, "tp", tp))
    for what, value, by, div in checks:
        if value % div:
            raise ValueError(f"{name}: {what}={value} is not divisible by {by}={div}")


def layer_numel(arch: ArchSpec, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank."""
    arch.require_dense("the memory planner (cooper_mcore/planner/sizes.py)")
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, 2 * arch.num_query_groups * d
    n = 2 * h  # input and pre-MLP RMSNorm weights (replicated)
    n += (q + kv) * h // tp + ((q + kv) // tp if arch.qkv_bias else 0)
    n += 2 * d if arch.qk_norm else 0
    n += h * q // tp  # attention output projection
    n += 3 * h * arch.ffn_hidden_size // tp  # gate+up, down
    return n


def stage_numel(arch: ArchSpec, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters on one rank of pipeline stage ``stage`` (megatron-core's layout)."""
    assert 0 <= stage < pp
    h = arch.hidden_size
    embedding = arch.vocab_size * h // tp
    n = arch.num_layers // pp * layer_numel(arch, tp)
    if stage == 0:
        n += embedding
    if stage == pp - 1:
        n += h  # final norm
        if arch.model_type == "reward":
            n += h  # scalar head, replicated
        elif not arch.tie_word_embeddings or pp > 1:
            n += embedding
    return n


def model_numel(arch: ArchSpec) -> int:
    """Parameters of the whole model (equal to the Hugging Face count)."""
    return stage_numel(arch)


def training_state(numel: int, dtype_bytes: int, dp: int, distributed_optimizer: bool = True,
                   trainable: bool = True) -> dict[str, int]:
    """Bytes of parameters, gradients and Adam state for ``numel`` parameters on one rank."""
    if not trainable:
        return {"params": numel * dtype_bytes, "grads": 0, "optimizer": 0}
    per_param = 8 + (4 if dtype_bytes < 4 else 0)  # two fp32 moments (+ fp32 main params for bf16)
    shard = math.ceil(numel / dp) if distributed_optimizer else numel
    return {"params": numel * dtype_bytes, "grads": numel * 4, "optimizer": shard * per_param}


def kv_bytes_per_token(arch: ArchSpec, dtype_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes per token on one GPU: 2 (K, V) x layers x KV heads x head_dim x dtype bytes.

    With ``tp`` above the number of KV heads, each GPU keeps one (replicated) head.
    """
    heads = max(1, arch.num_query_groups // tp)
    return 2 * arch.num_layers * heads * arch.head_dim * dtype_bytes


def layer_activation_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                           sequence_parallel: bool = False) -> int:
    """Bytes autograd keeps for one layer over ``tokens`` tokens (see the module docstring)."""
    q = arch.num_attention_heads * arch.head_dim
    replicated = 6 * arch.hidden_size // (tp if sequence_parallel else 1)
    return tokens * dtype_bytes * (replicated + (5 * q + 4 * arch.ffn_hidden_size) // tp)


def logits_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int, train: bool) -> int:
    """Peak bytes of the output logits and their loss/metric temporaries on the last stage."""
    copy = 4 if dtype_bytes < 4 else 0  # .float() copies only half-precision logits
    per = dtype_bytes + copy
    if train:  # the entropy metric (no grad) while the micro-batch's activations are held
        per += copy + (17 if tp == 1 else 8)
    return tokens * arch.vocab_size // tp * per
