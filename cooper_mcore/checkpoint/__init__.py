"""The checkpoint room: the formats cooper_mcore saves its models in.

* :mod:`~cooper_mcore.checkpoint.model`: model checkpoints (a megatron-core distributed checkpoint
  with ``cooper_model.json`` and ``hf_extra/``): their metadata, saving, checked loading, building
  a model from one, and reading a checkpoint's architecture.
* :mod:`~cooper_mcore.checkpoint.safetensors_io`: streaming reads and writes of Hugging Face
  safetensors folders.

The conversion between Hugging Face folders and model checkpoints is :mod:`cooper_mcore.convert`'s,
a client of this package; nothing here imports :mod:`cooper_mcore.convert`.
"""
