"""Cooper RL: the training loop (:mod:`~cooper_mcore.rl.loop`), one Cooper step
(:mod:`~cooper_mcore.rl.step`) and the stages it calls, one level down each: run set-up, the
colocation of the training state and the rollout engine, rollouts, their scoring, the GRPO update of the
policy and the reward model's pairwise update.

Only the CLI and the demo import this package.
"""
