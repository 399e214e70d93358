"""cooper_mcore: Cooper (policy and reward model co-optimized in RL) on Megatron-core."""

import warnings

__version__ = "0.1.0"

# megatron-core warns at import about optional GPU libraries; on the CPU path they are
# absent by design (see cooper_mcore.compat.cpu).
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
