"""Micro-batching, one room: how a mini-batch is cut, laid out and run, micro-batch by micro-batch.

Three modules, one per sub-concept, each importing only the ones before it:

* :mod:`~cooper_mcore.micro_batching.planning`: which samples go together: bins by a token budget,
  balanced across data-parallel ranks. A pure function of the lengths (standard library only, no
  torch), tested against hand-computed plans.
* :mod:`~cooper_mcore.micro_batching.packing`: sequences end to end in one row, megatron-core's
  ``thd`` layout, and back (torch only).
* :mod:`~cooper_mcore.micro_batching.runner`: ``MicroBatching`` (the three modes: fixed, by
  tokens, packed) and ``MicroBatch``, one micro-batch as a forward pass takes it, which the four
  passes of a Cooper step (old/reference log-probabilities, the policy update, RM scoring, the RM
  update) go through; ``forward_packed`` calls the model on a pack with megatron's
  ``PackedSeqParams``.

The package sits above :mod:`cooper_mcore.models` and below :mod:`cooper_mcore.train`: the runner
uses ``models.forward`` (positions of padded rows), and ``mcore`` (token batches, reward-model
passes) uses the runner. ``forward_packed`` lives here, not in ``models.forward``: the models layer
knows nothing of packs (only of megatron's ``PackedSeqParams``, which its attention reads), so the
dependency runs one way, ``micro_batching -> models``, and the two packages form no cycle.

This file imports nothing, so ``planning`` stays importable without torch or megatron.
"""
