"""`cooper train` with a NaN injected into the policy's GRPO loss from step NAN_FROM_STEP on.

Test-only: wraps the GRPO loss's ``policy_loss`` (as :mod:`cooper_mcore.rl.policy` calls it) so that
every token's loss is NaN while the step being run (set by a wrapper around the loop's
``cooper_step``) is >= NAN_FROM_STEP, then runs
the CLI with the given arguments and exits with its code.

    NAN_FROM_STEP=2 python tests/multiproc/workers/nan_train.py train --out DIR ...
"""

import os
import sys

import cooper_mcore.rl.loop as loop
import cooper_mcore.rl.policy as policy
from cooper_mcore.cli import main

NAN_FROM = int(os.environ["NAN_FROM_STEP"])
_now = {"step": 0}
_loss, _step = policy.policy_loss, loop.cooper_step


def nan_loss(*args, **kwargs):
    tok, stats = _loss(*args, **kwargs)
    return (tok * float("nan") if _now["step"] >= NAN_FROM else tok), stats


def step(run, prompts, timer):
    _now["step"] = run.step + 1
    return _step(run, prompts, timer)


if __name__ == "__main__":
    policy.policy_loss = nan_loss
    loop.cooper_step = step
    sys.exit(main(sys.argv[1:]))
