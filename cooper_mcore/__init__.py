"""cooper_mcore: Cooper (policy and reward model co-optimized in RL) on Megatron-core."""

import warnings

__version__ = "0.1.0"

# megatron-core warns at import about optional GPU libraries; on the CPU path they are
# absent by design (see cooper_mcore.compat.cpu).
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
# megatron-core 0.16's dist_checkpointing uses torch.distributed.checkpoint APIs that torch
# marks as deprecated; the warnings are torch's to megatron-core, not actionable by users.
warnings.filterwarnings("ignore", message=r".*Please use DTensor instead.*", category=FutureWarning)
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint.*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing.*")
