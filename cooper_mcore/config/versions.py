"""A run's config record, ``<out>/config.yaml``: every version of the run's settings with the step it
started at.

A run writes version 1 when it starts. A resume whose settings differ from the newest version
appends a version (``step``: the steps done when it took over; ``changed``: each differing key,
``old -> new``); a resume with the same settings leaves the record as it is. Which keys a resume
may change freely and which need the user's consent is the caller's rule (for a Cooper run,
:mod:`cooper_mcore.rl.run_folder`); this module reads, compares and writes. The record holds the
settings as written elsewhere too: secrets scrubbed (:func:`cooper_mcore.redaction.scrub_config`).

A folder written before versions existed has a ``config.yaml`` that is the config itself: it reads
as one version that started at step 0. :func:`newest_config` gives a record's newest settings,
so ``cooper train --config <out>/config.yaml`` runs them again.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from cooper_mcore.atomic import atomic_open
from cooper_mcore.redaction import scrub_config

__all__ = ["RECORD_FILE", "Change", "ConfigRecord", "ConfigVersion", "config_changes", "newest_config",
           "read_record", "write_record"]

RECORD_FILE = "config.yaml"
_HEADER = ("# The run's settings: one version per start that changed them, with the step it started at\n"
           "# (docs/reliability.md). `cooper train --config` of this file runs the newest version.\n")


@dataclass(frozen=True)
class Change:
    """One setting that differs between two versions."""

    key: str
    """The setting's dotted key."""
    old: Any
    """Its value in the older version."""
    new: Any
    """Its value in the newer one."""

    def __str__(self) -> str:
        return f"{self.key}: {json.dumps(self.old)} -> {json.dumps(self.new)}"


@dataclass
class ConfigVersion:
    """One version of a run's settings."""

    version: int
    """1 for the settings the run started with, then counting."""
    step: int
    """Steps done when this version took over (0 for the first)."""
    config: dict[str, Any]
    """The settings (plain nested dicts, secrets scrubbed)."""
    started: str = ""
    """When it took over (ISO 8601; empty in a folder written before versions existed)."""
    changed: list[str] = field(default_factory=list)
    """The keys that differ from the previous version, ``key: old -> new``."""
    allowed: bool = False
    """Whether the change needed the user's consent (``--allow-config-change``)."""


@dataclass
class ConfigRecord:
    """Every version of a run's settings, oldest first."""

    versions: list[ConfigVersion]
    """The versions (at least one)."""

    @property
    def newest(self) -> ConfigVersion:
        """The settings in force."""
        return self.versions[-1]

    @classmethod
    def start(cls, config: Mapping[str, Any], step: int = 0) -> ConfigRecord:
        """The record of a run that starts with ``config`` after ``step`` steps (secrets scrubbed)."""
        return cls([ConfigVersion(1, step, scrub_config(config), _now())])

    def then(self, config: Mapping[str, Any], step: int, changes: Iterable[Change], allowed: bool) -> ConfigRecord:
        """This record with ``config`` appended as the version in force from ``step``."""
        version = ConfigVersion(self.newest.version + 1, step, scrub_config(config), _now(),
                                [str(c) for c in changes], allowed)
        return ConfigRecord([*self.versions, version])


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The settings whose values differ between ``old`` and ``new`` (nested dicts, compared leaf by
    leaf; lists are leaves), after scrubbing secrets from ``new`` as the record has them. A key that
    only one side has (a setting added or removed by another version of cooper_mcore) is left out:
    the side without it ran with that setting's behaviour of its time."""
    old_leaves, new_leaves = dict(_leaves(old)), dict(_leaves(scrub_config(new)))
    return [Change(k, old_leaves[k], v) for k, v in new_leaves.items() if k in old_leaves and old_leaves[k] != v]


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def read_record(path: str) -> Optional[ConfigRecord]:
    """The record at ``path`` (None: no such file); a file from before versions is one version at step 0.

    Raises:
        ValueError: the file is not a record or a config (naming it).
    """
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable config record: {' '.join(str(e).split())}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} is not a config record: move it aside to start the record again")
    if "versions" not in tree:
        return ConfigRecord([ConfigVersion(1, 0, tree)])  # a folder written before versions
    try:
        return ConfigRecord([ConfigVersion(**v) for v in tree["versions"]])
    except TypeError as e:
        raise ValueError(f"{path} has a malformed version list ({e}): move it aside to start the record again") \
            from None


def write_record(path: str, record: ConfigRecord) -> None:
    """Write ``record`` to ``path`` (atomically: a crash leaves the previous record whole)."""
    versions = [{"version": v.version, "step": v.step, "started": v.started, "changed": v.changed,
                 "allowed": v.allowed, "config": v.config} for v in record.versions]
    with atomic_open(path) as f:
        f.write(_HEADER)
        yaml.safe_dump({"versions": versions}, f, sort_keys=False, allow_unicode=True, width=120)


def newest_config(tree: Any) -> Any:
    """A preset's tree with a config record replaced by its newest version's settings (others unchanged)."""
    if isinstance(tree, dict) and set(tree) == {"versions"} and isinstance(tree["versions"], list) \
            and tree["versions"] and isinstance(tree["versions"][-1], dict) and "config" in tree["versions"][-1]:
        return tree["versions"][-1]["config"]
    return tree
