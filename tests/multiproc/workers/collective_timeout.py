"""Worker: a collective that one rank never joins, through the ``cooper`` CLI's error handling.

Two ranks, gloo, a 5-second timeout. Rank 1 never calls the collective (it waits until rank 0 is
done, then leaves); rank 0 runs a one-off subcommand whose job is ``any_rank`` inside
:func:`cooper_mcore.parallel.owned_world` (as every cooper job is), through
:func:`cooper_mcore.cli.main`. Rank 0 prints one JSON line: the exit code, the seconds the
collective took to fail, and the ERROR log lines the CLI wrote.
"""

import datetime
import json
import logging
import os
import sys
import time

import torch.distributed as dist

from cooper_mcore import cli
from cooper_mcore.collectives import any_rank
from cooper_mcore.parallel import owned_world

DONE = os.environ["COOPER_TEST_DONE"]  # a file rank 0 creates when it has finished


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@owned_world()
def job(_args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    if dist.get_rank() == 1:
        while not os.path.exists(DONE):
            time.sleep(0.1)
        return
    any_rank(True)  # rank 1 never joins


def main():
    rank = int(os.environ["RANK"])
    if rank == 1:
        job(None)
        return
    capture = Capture()
    logging.getLogger("cooper_mcore").addHandler(capture)
    cli.handler = lambda command: job  # `cooper config` parses; its handler is the job above
    start = time.monotonic()
    rc = cli.main(["config"])
    seconds = time.monotonic() - start
    print(json.dumps({"rc": rc, "seconds": seconds, "errors": capture.lines}), flush=True)
    open(DONE, "w").close()
    sys.stdout.flush()
    os._exit(0)  # the world of a timed-out collective is not torn down (the process is going down)


if __name__ == "__main__":
    main()
