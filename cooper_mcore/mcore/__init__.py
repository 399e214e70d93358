"""The Megatron layer shared by every job (RL, SFT, VerifyRM training): model wrapping and the one
guarded optimizer step, the collectives cooper_mcore issues itself, offload/onload, training
checkpoints, the reward model's batches, scores and losses, per-token log-probabilities, and
fault-injection points.

Nothing here imports :mod:`cooper_mcore.rl` or :mod:`cooper_mcore.jobs`.
"""
