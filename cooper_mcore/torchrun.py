"""``python -m cooper_mcore.torchrun [torchrun's options] -m cooper_mcore train ...``: torchrun whose failures
are one line each and whose exit code is the ranks'.

The launcher (``examples/launch_multinode.sh``, which ``examples/slurm/cooper.sbatch`` runs on every node) starts
the training processes through this. It is torchrun's own agent (``torch.distributed.run``, the same options and
behaviour), except for how it ends:

* a rank failed: instead of torchrun's ``ChildFailedError`` block (a traceback and a table), one line naming the
  failed ranks of this node and their exit codes, and the exit code is that of the first rank that exited by
  itself (75 preempted, 69 another rank lost, 2 a config refusal, ...; only ranks killed by a signal: 128 + the
  signal), where torchrun exits 1 for any failure. Each rank has said what it saw in its own line above;
* the rendezvous timed out (a node never joined within ``join_timeout``, the launcher's ``RDZV_TIMEOUT``) or
  its store went away (the node that hosts it, at the rendezvous endpoint, was lost): one line, exit 69
  (:data:`~cooper_mcore.exit_codes.EXIT_PEER_LOST`);
* the agent was stopped by a signal (the scheduler's SIGTERM): one line, exit 128 + the signal;
* the rendezvous store going away while this node's ranks still run does not end the agent
  (:func:`keep_monitoring_without_the_store`): it watches them to their own end.

It imports torch's launcher and :mod:`cooper_mcore.exit_codes` only (not megatron-core): the agent starts
as fast as torchrun.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
from typing import Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.run import parse_args, run

from cooper_mcore.exit_codes import EXIT_PEER_LOST

logger = logging.getLogger("cooper_mcore.torchrun")  # (not __name__: it runs as __main__)


def exit_code(code: int) -> int:
    """A process's exit code as a shell reports it: a negative code (killed by signal N) is 128 + N."""
    return code if code >= 0 else 128 - code


def _describe(code: int) -> str:
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def failed_ranks(e: ChildFailedError) -> tuple[str, int]:
    """The line and the exit code for the failed ranks of this node: the code of the first rank that exited by
    itself (torchrun stamps failures to the second: of those seen together, the lowest rank's); ranks that torchrun
    then stopped (SIGTERM) only count when none exited by itself."""
    order = sorted(e.failures.items(), key=lambda item: (item[1].exitcode < 0, item[1].timestamp, item[0]))
    first_rank, first = order[0]
    ranks = ", ".join(f"rank {rank} {_describe(f.exitcode)}" for rank, f in sorted(e.failures.items()))
    code = exit_code(first.exitcode)
    return (f"{len(e.failures)} training process(es) of this node failed ({ranks}); each one's own error is above; "
            f"exiting with {code} (rank {first_rank}'s)"), code


def _rdzv_conf(args: argparse.Namespace, key: str) -> Optional[str]:
    for item in (args.rdzv_conf or "").split(","):
        name, _, value = item.partition("=")
        if name.strip() == key:
            return value.strip()
    return None


def rendezvous_failure(args: argparse.Namespace, e: Exception) -> str:
    """The line for a rendezvous that timed out, was closed, or lost its store."""
    where = f"the rendezvous at {args.rdzv_endpoint} (id {args.rdzv_id}) of {args.nnodes} node(s)"
    if isinstance(e, RendezvousTimeoutError):
        wait = _rdzv_conf(args, "join_timeout")
        return (f"{where} timed out{f' after {wait} s' if wait else ''}: not every node joined; start the same "
                "command on every node (the same rendezvous endpoint and id), or give the nodes more time "
                "(RDZV_TIMEOUT of examples/launch_multinode.sh, torchrun's --rdzv-conf join_timeout)")
    if isinstance(e, RendezvousClosedError):
        return f"{where} was closed: another node's agent ended the job (its log says why)"
    cause = e.__cause__ if e.__cause__ is not None else e
    words = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
    return (f"lost {where}: the node that hosts its store (the rendezvous endpoint's) is gone or unreachable "
            f"({words[:200]})")


def keep_monitoring_without_the_store() -> None:
    """Let this agent watch its ranks to their end when the rendezvous store goes away.

    While its ranks run, torchrun's agent asks the store every monitor interval whether nodes wait
    to join (elastic scale-up, which a fixed node count with ``--max-restarts=0`` never does). The
    store lives in the agent of one node. When a job stops on every node (a preemption: exit 75; a
    lost peer: 69) that agent may exit first, and another node's agent, whose ranks were still
    ending, then died of the missing store (``RendezvousConnectionError``), its ranks' codes lost:
    seen on two nodes under load, SIGUSR1 ending in 75 on one node and in the store's error on the
    other. Here that question is answered "none" when the store cannot be reached; the ranks end by
    themselves, and a peer that is really gone is theirs to see (a lost peer's line, or the
    collective timeout).
    """
    original = DynamicRendezvousHandler.num_nodes_waiting
    if getattr(original, "keeps_monitoring", False):
        return

    @functools.wraps(original)
    def num_nodes_waiting(self: DynamicRendezvousHandler) -> int:
        try:
            return original(self)
        except RendezvousConnectionError:
            return 0

    num_nodes_waiting.keeps_monitoring = True  # type: ignore[attr-defined]
    DynamicRendezvousHandler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]


def main(argv: Optional[list[str]] = None) -> int:
    """Run torchrun with ``argv`` (its options and the training command); return the exit code (module doc)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    keep_monitoring_without_the_store()
    try:
        run(args)
    except ChildFailedError as e:
        line, code = failed_ranks(e)
        logger.error("%s", line)
        return code
    except (RendezvousTimeoutError, RendezvousClosedError, RendezvousConnectionError) as e:
        logger.error("%s; exiting with %d", rendezvous_failure(args, e), EXIT_PEER_LOST)
        return EXIT_PEER_LOST
    except SignalException as e:
        code = 128 + int(e.sigval)
        logger.error("stopped by %s (the training processes were sent it too); exiting with %d",
                     signal.Signals(e.sigval).name, code)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
