"""The memory planner (``cooper plan``): the per-GPU memory of a Cooper run, phase by phase, and the
offload settings that make it fit, before any GPU is used.

* :mod:`~cooper_mcore.planner.plan`: the estimate of every phase on the worst pipeline stage, the
  colocated assistant's share, and the search for the offload settings that fit.
* :mod:`~cooper_mcore.planner.sizes`: the sizes it adds up: parameters per TP/PP rank, training
  state, KV cache, activations and logits.
* :mod:`~cooper_mcore.planner.report`: model shapes read from config files and checkpoints, the
  table and JSON of ``cooper plan``, and the launchers' pre-start check.

Pure arithmetic on architectures and the run's config (nothing is allocated). The report reads
checkpoints' metadata through :mod:`cooper_mcore.checkpoint`, so the package sits above it.
"""
