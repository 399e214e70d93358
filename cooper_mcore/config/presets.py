"""The presets shipped with cooper_mcore, found by name from any folder.

The repository's ``examples/`` holds the run presets (``*.yaml``), the other jobs' presets
(``jobs/*.yaml``) and the HF configs of the models they name (``model_configs/*.json``). A wheel
carries the same files as the package data ``cooper_mcore/presets/`` (``setup.py`` maps
``examples/`` there), so that ``cooper train --config tiny_cpu`` works where no checkout is. Run
from a checkout (the editable install of ``make test``), the files are read from ``examples/``
itself. A path that exists always wins over a shipped name.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import cooper_mcore
from cooper_mcore.files import read_json_object

logger = logging.getLogger(__name__)

#: Where the shipped files lie, most specific first: the installed package data, the checkout's examples/.
_PACKAGE_DIR = Path(cooper_mcore.__file__).resolve().parent
SHIPPED_DIRS = (_PACKAGE_DIR / "presets", _PACKAGE_DIR.parent / "examples")
MODEL_CONFIGS = "model_configs"


def shipped_dir() -> Optional[Path]:
    """The folder of the shipped presets, or None when this install has none."""
    return next((d for d in SHIPPED_DIRS if (d / MODEL_CONFIGS).is_dir()), None)


def shipped_presets() -> dict[str, Path]:
    """Every shipped preset by name: ``tiny_cpu``, ``jobs/sft_tiny_cpu``, ..."""
    root = shipped_dir()
    if root is None:
        return {}
    files = sorted(root.glob("*.yaml")) + sorted(root.glob("jobs/*.yaml"))
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in files}


def _name(given: str, suffix: str) -> str:
    """``examples/jobs/sft_tiny_cpu.yaml`` -> ``jobs/sft_tiny_cpu``: a preset named as in the docs."""
    name = given.replace(os.sep, "/").removesuffix(suffix)
    for prefix in ("./", "examples/"):
        name = name.removeprefix(prefix)
    return name


def resolve_preset(given: str) -> str:
    """The path of the preset ``given``: that file if it exists, else the shipped preset of that
    name (``tiny_cpu``, ``tiny_cpu.yaml``, ``examples/tiny_cpu.yaml``, ``jobs/sft_tiny_cpu``).

    Raises:
        FileNotFoundError: neither, naming the shipped presets.
    """
    if os.path.exists(given):
        return given
    found = shipped_presets().get(_name(given, ".yaml"))
    if found is not None:
        logger.info("preset %s: the shipped %s", given, found)
        return str(found)
    names = ", ".join(shipped_presets()) or "none in this install"
    raise FileNotFoundError(f"config preset {given!r} not found, neither as a file nor as a shipped preset "
                            f"(shipped: {names})")


def resolve_model_config(given: str) -> str:
    """The path of the HF config ``given``: that file (or folder) if it exists, else the shipped
    ``model_configs/<name>.json`` (``qwen2.5-1.5b-instruct``, ``qwen2.5-1.5b-instruct.json``).

    Raises:
        FileNotFoundError: neither, naming the shipped model configs.
    """
    if os.path.exists(given):
        return given
    root = shipped_dir()
    found = root / MODEL_CONFIGS / f"{os.path.basename(_name(given, '.json'))}.json" if root else None
    if found is not None and found.is_file():
        return str(found)
    names = ", ".join(p.stem for p in sorted(root.glob(f"{MODEL_CONFIGS}/*.json"))) if root else "none"
    raise FileNotFoundError(f"model config {given!r} not found, neither as a file nor as a shipped model config "
                            f"(shipped: {names})")


def read_model_config(given: str) -> dict[str, Any]:
    """An HF config: a ``config.json`` file, the model folder holding it, or a shipped model config's name.

    Raises:
        FileNotFoundError: none of these (naming the shipped model configs), or a folder without ``config.json``.
        ValueError: the file is not valid JSON (file, line and column named) or not an object.
    """
    path = resolve_model_config(given)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {given!r}")
    return read_json_object(path)


def shipped_model_config(model_path: str, preset: Optional[str] = None) -> Optional[str]:
    """The HF config shipped for the model at ``model_path`` (a placeholder such as
    ``/models/Qwen2.5-1.5B-Instruct``): ``model_configs/<its name, lower case>.json`` beside the
    preset (when given), else among the shipped ones; None when there is none."""
    name = os.path.basename(os.path.normpath(model_path)).lower() if model_path else ""
    if not name:
        return None
    roots = ([Path(preset).resolve().parent] if preset else []) + ([d] if (d := shipped_dir()) else [])
    return next((str(p) for r in roots if (p := r / MODEL_CONFIGS / f"{name}.json").is_file()), None)
