"""The checkpoint room: every format cooper_mcore saves its models and runs in.

* :mod:`~cooper_mcore.checkpoint.model`: model checkpoints (a megatron-core distributed checkpoint
  with ``cooper_model.json``, ``hf_extra/`` and ``manifest.json``): their metadata, saving, the check
  every reader passes (:func:`~cooper_mcore.checkpoint.model.open_model_checkpoint`), loading,
  building a model from one, and reading a checkpoint's architecture.
* :mod:`~cooper_mcore.checkpoint.manifest`: a checkpoint folder's ``manifest.json`` (every file's size
  and CRC-32), written last, and the verification against it.
* :mod:`~cooper_mcore.checkpoint.tokenizer`: a model checkpoint's tokenizer (its ``hf_extra/``).
* :mod:`~cooper_mcore.checkpoint.training`: training checkpoints (``step_<n>/``: both models with
  their optimizers and schedules, RNG states, trainer state, manifest), resume and pruning.
* :mod:`~cooper_mcore.checkpoint.safetensors_io`: streaming reads and writes of Hugging Face
  safetensors folders.

The conversion between Hugging Face folders and model checkpoints is :mod:`cooper_mcore.convert`'s,
a client of this package; nothing here imports :mod:`cooper_mcore.convert`. Training checkpoints
save the Megatron layer's :class:`~cooper_mcore.train.model_state.ModelState` records, so this
package sits above :mod:`cooper_mcore.train`, which does not import it.
"""
