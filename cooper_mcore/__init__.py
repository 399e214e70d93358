"""cooper_mcore: Cooper (policy and reward model co-optimized in RL) on Megatron-core."""

__version__ = "0.1.0"
