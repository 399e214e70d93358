"""``cooper rehearse``: a preset's own job on CPU with a tiny model of its family."""

from __future__ import annotations

import argparse

from cooper_mcore.rehearsal.run import Limits, rehearse_preset


def rehearse(args: argparse.Namespace) -> int:
    report = rehearse_preset(args.config, args.overrides, out=args.out, policy_config=args.policy_config,
                             rm_config=args.rm_config,
                             limits=Limits(startup_s=args.startup_timeout, step_s=args.step_timeout),
                             at_real_shape=args.real_shape,
                             variants=[v.split(",") for v in args.variant or []])
    print(report.format(), flush=True)  # the report, its verdict line last
    return 0 if report.ok else 1
