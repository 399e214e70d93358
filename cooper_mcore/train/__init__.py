"""The training engine every job shares (RL, SFT, VerifyRM training), on megatron-core: model
wrapping and the one guarded optimizer step, the collectives cooper_mcore issues itself, offload/onload, the model state
that training checkpoints save, the reward model's batches, scores and losses, per-token
log-probabilities, and fault-injection points.

Nothing here imports :mod:`cooper_mcore.rl`, :mod:`cooper_mcore.jobs`, :mod:`cooper_mcore.convert`
or :mod:`cooper_mcore.checkpoint` (whose training checkpoints save this layer's
:class:`~cooper_mcore.train.model_state.ModelState` records).
"""
