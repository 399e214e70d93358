"""``cooper config``: a job's settings with their values and one-line docs, all of them or the
keys asked for (``cooper config algo.tis_cap rollout``: a setting, or each setting of a section).

This handler lives beside the schema rather than in :mod:`cooper_mcore.commands`, whose import
loads megatron-core and torch (seconds): a lookup needs the schema only (standard library,
OmegaConf and YAML) and answers in well under a second.
"""

from __future__ import annotations

import argparse

from cooper_mcore.config.schema import JOB_CONFIGS, format_settings, load_config


def config(args: argparse.Namespace) -> None:
    """Print the settings of ``args.job`` (default ``train``) from ``args.config`` and the
    ``key=value`` overrides among ``args.overrides``; the entries without ``=`` are the keys to show.

    Raises:
        ValueError: an unknown key (with a did-you-mean), a bad override or preset.
    """
    keys = [a for a in args.overrides if "=" not in a]
    overrides = [a for a in args.overrides if "=" in a]
    cfg = load_config(args.config, overrides, cls=JOB_CONFIGS[getattr(args, "job", "train")])
    print(format_settings(cfg, keys), flush=True)  # the listing
