"""The exit codes of cooper's training jobs and of its torchrun launcher, in one place (docs/reliability.md's
table). Standard library only: the launcher's agent (:mod:`cooper_mcore.torchrun`) imports this without
importing torch's or megatron's heavier modules.

A user or environment error is 2 (``cooper_mcore.cli.EXIT_USER_ERROR``, beside the CLI that reports it).
"""

EXIT_NO_SIGNAL = 2
"""The data gives the run nothing to learn from (no rule verdict for ``train.max_steps_without_signal`` steps in a
row): the user's to fix, so the CLI's user-error code."""
EXIT_NONFINITE = 3
"""Stopped after ``train.max_nonfinite_steps`` steps in a row with a non-finite loss or gradient norm."""
EXIT_PEER_LOST = 69
"""sysexits' EX_UNAVAILABLE: another rank (its process or its node) is gone, or did not join a collective
within ``parallel.timeout_minutes``, or a node never joined the rendezvous; run the same command on every node
with ``--resume auto`` once all nodes are up."""
EXIT_ENGINE_LOST = 71
"""sysexits' EX_OSERR: a rollout engine's process died more often than ``rollout.engine_restarts`` allows (an
engine apart from the trainer); the newest complete checkpoint is named: run the same command with
``--resume auto``."""
EXIT_CHECKPOINT_FAILED = 74
"""sysexits' EX_IOERR: a checkpoint could not be written."""
EXIT_PREEMPTED = 75
"""sysexits' EX_TEMPFAIL: stopped by a signal (SIGTERM, SIGUSR1, a first Ctrl-C) after a checkpoint; run the same
command again."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, what a shell reports for a command stopped by Ctrl-C (a second Ctrl-C: stopped at once)."""
