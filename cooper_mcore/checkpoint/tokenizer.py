"""A model checkpoint's tokenizer: the HF tokenizer files kept in its ``hf_extra/`` folder.

Apart from :mod:`cooper_mcore.checkpoint.model` because it loads transformers, which the readers of a
checkpoint's metadata (the config checks, ``cooper plan``) do not need.
"""

from __future__ import annotations

import os
from typing import Any

from cooper_mcore.checkpoint.model import EXTRA_DIR
from cooper_mcore.data.tokenizer import load_tokenizer


def load_checkpoint_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The HF tokenizer of a model checkpoint (or of an HF folder).

    Args:
        path: a cooper_mcore checkpoint (the tokenizer is read from its ``hf_extra/`` folder) or
            an HF model / tokenizer folder.
        trust_remote_code: allow the folder's own Python tokenizer code to run (off unless asked).

    Raises:
        ValueError: no tokenizer files in the folder.
    """
    folder = os.path.join(path, EXTRA_DIR) if os.path.isdir(os.path.join(path, EXTRA_DIR)) else path
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not os.path.isdir(folder) or not any(os.path.isfile(os.path.join(folder, n)) for n in names):
        raise ValueError(f"no tokenizer files in {folder!r} (expected one of {names})")
    return load_tokenizer(folder, trust_remote_code=trust_remote_code)
