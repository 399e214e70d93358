"""A model checkpoint's tokenizer: the HF tokenizer files kept in its ``hf_extra/`` folder.

Apart from :mod:`cooper_mcore.checkpoint.model` because it loads transformers, which the readers of a
checkpoint's metadata (the config checks, ``cooper plan``) do not need.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from cooper_mcore.checkpoint.model import EXTRA_DIR
from cooper_mcore.data.tokenizer import load_tokenizer

#: a folder holds a tokenizer when it has one of these
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_folder(path: str) -> Optional[str]:
    """The folder holding the tokenizer of a model checkpoint (its ``hf_extra/``) or of an HF model or
    tokenizer folder (itself); None when it has no tokenizer files (:data:`TOKENIZER_FILES`)."""
    folder = os.path.join(path, EXTRA_DIR) if os.path.isdir(os.path.join(path, EXTRA_DIR)) else path
    if os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, n)) for n in TOKENIZER_FILES):
        return folder
    return None


def load_checkpoint_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The HF tokenizer of a model checkpoint (or of an HF folder).

    Args:
        path: a cooper_mcore checkpoint (the tokenizer is read from its ``hf_extra/`` folder) or
            an HF model / tokenizer folder.
        trust_remote_code: allow the folder's own Python tokenizer code to run (off unless asked).

    Raises:
        ValueError: no tokenizer files in the folder.
    """
    folder = tokenizer_folder(path)
    if folder is None:
        where = os.path.join(path, EXTRA_DIR) if os.path.isdir(os.path.join(path, EXTRA_DIR)) else path
        raise ValueError(f"no tokenizer files in {where!r} (expected one of {TOKENIZER_FILES})")
    return load_tokenizer(folder, trust_remote_code=trust_remote_code)
