"""The memory planner (``cooper plan``): the per-GPU memory of a Cooper run, phase by phase, and
the offload settings that make it fit, before any GPU is used; and (``cooper plan --simulate``) a
simulated step it is held against.

* :mod:`~cooper_mcore.planner.plan`: the estimate of every phase on every pipeline stage, the
  colocated assistant's share, and the search for the offload settings that fit.
* :mod:`~cooper_mcore.planner.sizes`: the sizes it adds up: parameters per TP/PP rank, training
  state, KV cache, activations and logits.
* :mod:`~cooper_mcore.planner.report`: model shapes read from config files and checkpoints, the
  table and JSON of ``cooper plan``, and the launchers' pre-start check.
* :mod:`~cooper_mcore.planner.simulate`: one rank of a run's real layout through a whole Cooper
  step (the trainer's own code) on fake tensors and a fake process group
  (:mod:`~cooper_mcore.planner.fake_device`, the one seam; :mod:`~cooper_mcore.planner.stand_ins`,
  the engine, verifier, assistant and tokenizer it talks to), each phase's peak by kind
  (:mod:`~cooper_mcore.planner.memory_tracker`), set beside the plan by
  :mod:`~cooper_mcore.planner.comparison`.

The plan is pure arithmetic on architectures and the run's config (nothing is allocated). The
report reads checkpoints' metadata through :mod:`cooper_mcore.checkpoint`; the simulation drives
:mod:`cooper_mcore.rl`'s step, so the package sits above both (nothing below imports it).
"""
