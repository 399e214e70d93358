"""Start-up time of the ``cooper`` command: what a newcomer waits for ``--help`` and a typo.

Each command runs ``--repeat`` times in a fresh interpreter (``python -m cooper_mcore``, as the
``cooper`` script does); the median wall time is printed. For scale, the last row imports the
trainer's handler (megatron-core, torch, transformers), which every ``cooper train`` pays and
``--help`` no longer does (``cooper_mcore.cli.HANDLERS``).

    python benchmarks/cli_startup.py [--repeat 5]

Prints a table and, as its last line, ``help_s=<float> train_help_s=<float> config_key_s=<float>
import_trainer_s=<float>`` (``config_key_s``: a settings lookup, which needs the config schema only).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "help_s": [sys.executable, "-m", "cooper_mcore", "--help"],
    "train_help_s": [sys.executable, "-m", "cooper_mcore", "train", "--help"],
    "config_key_s": [sys.executable, "-m", "cooper_mcore", "config", "algo.tis_cap"],
    "import_trainer_s": [sys.executable, "-c", "import cooper_mcore.commands.train"],
}


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (the median is reported)")
    args = parser.parse_args()
    result = {}
    for name, cmd in CASES.items():
        wall(cmd)  # warm the file cache
        result[name] = statistics.median(wall(cmd) for _ in range(args.repeat))
        print(f"{name:18s} {result[name]:7.2f} s   {' '.join(cmd[1:])}", flush=True)
    print(" ".join(f"{k}={v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
