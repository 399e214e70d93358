"""RMSNorm for the torch-native layer spec, built like Transformer Engine's and apex's norms.

megatron-core's fallback without TE or apex (``WrappedTorchNorm``) builds ``torch.nn.RMSNorm`` on
the default device in float32 whatever the model's dtype, and refuses sequence parallelism. This
norm instead:

* holds its weight in the model's ``params_dtype`` (a bf16 model is bf16 throughout, so the
  distributed optimizer sees one dtype: with fp32 norm weights in a bf16 model its
  ``dp_reshardable`` checkpoint paired parameters with the wrong main parameters and failed to
  save, on CPU and on an H100 alike);
* under sequence parallelism marks its weight ``sequence_parallel``, so megatron-core's
  ``finalize_model_grads`` sums its gradient over the tensor-parallel group (each rank saw only its
  own slice of the sequence), as TE's norms are marked.

It normalises in float32 and multiplies by the weight in the input's dtype, as transformers'
Qwen2/Llama/Qwen3 RMSNorm does.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * weight`` over the last dimension.

    Args:
        config: the model's config (dtype, sequence parallelism).
        hidden_size: the normalised dimension.
        eps: added to the mean square.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
