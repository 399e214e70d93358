"""A lost peer, a collective timeout, a rendezvous that never completes and a refusal raised on every rank: each
ends in one line and a documented exit code (docs/reliability.md). The multi-node runs that cause them for real
are in tests/multiproc/test_multinode.py; here, the pieces: torch's error texts classified, the job's line with
the newest checkpoint, the agent's lines, the per-node dedup of refusals and the NCCL watchdog settings."""

from __future__ import annotations

import logging
import os
import signal
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

from cooper_mcore import cli
from cooper_mcore import torchrun as agent
from cooper_mcore.exit_codes import EXIT_PEER_LOST
from cooper_mcore.job import TrainingStopped, job
from cooper_mcore.parallel import (
    CollectiveTimeout,
    ParallelConfig,
    PeerLost,
    collective_failure,
    collective_timeout,
    init_distributed,
    nccl_watchdog_env,
)

# gloo's words when the other end of a pair went away (torch 2.13, seen on the two-node CPU runs)
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27556: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")
# what NCCL ranks raise at their next collective once torch's watchdog has aborted the communicators
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=2): the texts ProcessGroupNCCL.cpp / NCCLUtils.cpp build (read in torch's
# source; no GPU here)
NCCL_TIMEOUT = ("NCCL communicator was aborted on rank 3.  Original reason for failure was: [PG ID 0 PG GUID 0"
                "(default_pg) Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1200000) ran for 1200095 milliseconds before "
                "timing out.")
NCCL_REMOTE = ("NCCL communicator was aborted on rank 1.  Original reason for failure was: NCCL error in: "
               "ProcessGroupNCCL.cpp:2097, remote process exited or there was a network error, NCCL version 2.27.5")


def test_torch_errors_are_told_apart():
    lost = collective_failure(RuntimeError(GLOO_RESET))
    assert isinstance(lost, PeerLost) and lost.exit_code == EXIT_PEER_LOST
    assert str(lost) == ("rank 0 of 1: lost a peer in a collective of torch.distributed: another rank of that group "
                         "is gone (its process exited or its node was lost: see that node's log). torch: Read error "
                         "[127.0.0.1]:27556: Connection reset by peer")  # gloo's words without its path and advice
    timeout = collective_failure(dist.DistBackendError(NCCL_TIMEOUT))
    assert isinstance(timeout, CollectiveTimeout) and collective_timeout(dist.DistBackendError(NCCL_TIMEOUT))
    assert "timed out" in str(timeout) and "the limit is parallel.timeout_minutes" in str(timeout)
    assert isinstance(collective_failure(dist.DistBackendError(NCCL_REMOTE)), PeerLost)
    assert collective_failure(lost) is lost  # converted once
    # not torch.distributed's: an HTTP client's reset, a plain timeout, a user error
    for e in (RuntimeError("Connection reset by peer"), RuntimeError("Timed out waiting 5000ms"), ValueError("x")):
        assert collective_failure(e) is None, e
    assert collective_timeout(RuntimeError(GLOO_RESET)) is None


def _complete_checkpoint(out, step):
    folder = out / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder


def test_a_lost_peer_leaves_the_job_with_the_checkpoint_to_resume(tmp_path):
    """One line: what failed, the newest complete checkpoint (not the half-written one), the command; exit 69."""
    _complete_checkpoint(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_3.tmp").mkdir()
    with pytest.raises(TrainingStopped) as info:
        with job(str(tmp_path), 4, parallel=ParallelConfig(), write_metrics=False):
            raise RuntimeError(GLOO_RESET)
    e = info.value
    assert e.exit_code == EXIT_PEER_LOST and e.checkpoint == str(tmp_path / "checkpoints" / "step_2")
    message = cli.user_error(e)
    assert message.startswith("rank 0 of 1: lost a peer in a collective of torch.distributed, called from "
                              "tests/unit/test_peer_lost.py:") and "\n" not in message
    assert message.endswith(f"; the newest complete checkpoint is {tmp_path}/checkpoints/step_2: run the same command "
                            "on every node with --resume auto to continue from it")
    with pytest.raises(TrainingStopped, match="no complete checkpoint yet: run the same command on every node to "
                                              "start over$"):
        with job(str(tmp_path / "fresh"), 4, parallel=ParallelConfig(), write_metrics=False):
            raise dist.DistBackendError(NCCL_TIMEOUT)
    with pytest.raises(RuntimeError, match="^a bug$"):  # anything else goes on as it was
        with job(str(tmp_path / "fresh"), 4, parallel=ParallelConfig(), write_metrics=False):
            raise RuntimeError("a bug")


def test_a_refusal_is_said_once_per_node(tmp_path, monkeypatch, caplog):
    """torchrun gives each local rank an error file under one folder of its agent's: the first rank to claim a
    message there logs it; the same message from another rank of the node is not repeated, another one is."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert not cli.said_on_this_node("x") and not cli.said_on_this_node("x")  # not under torchrun: always said
    attempt = tmp_path / "torchelastic_abc" / "run_0" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    assert not cli.said_on_this_node("bad config")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    assert cli.said_on_this_node("bad config") and not cli.said_on_this_node("another problem")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "0" / "error.json"))
    assert not cli.said_on_this_node("bad config")  # no such folder: say it

    # through the CLI: a refusal (exit 2) once; a rank's stop line (its own exit code) every time
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    refusals = []
    for _ in range(2):
        monkeypatch.setattr(cli, "handler", lambda command: _raise(ValueError("parallel.tp=3 does not divide 2")))
        with caplog.at_level(logging.ERROR, logger="cooper_mcore"):
            refusals.append(cli.main(["config"]))
        monkeypatch.setattr(cli, "handler", lambda command: _raise(TrainingStopped("preempted", 75, None)))
        with caplog.at_level(logging.ERROR, logger="cooper_mcore"):
            refusals.append(cli.main(["config"]))
    assert refusals == [2, 75, 2, 75]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "parallel.tp=3 does not divide 2", "preempted", "preempted"]
    # a late copy of SLURM's early warning, after the job stopped (a node's launcher passes it on late): ignored
    os.kill(os.getpid(), signal.SIGUSR1)  # (this process goes on)
    # ... by a handler, not SIG_IGN, which every program started from here would inherit: a launcher script
    # could not trap the signal then
    trapped = subprocess.run(["bash", "-c", "trap 'echo trapped' USR1; kill -USR1 $$"], capture_output=True,
                             text=True, timeout=30)
    assert trapped.stdout.strip() == "trapped", trapped


def _raise(e):
    def handle(_args):
        raise e
    return handle


def _failure(local_rank: int, exitcode: int, tmp_path) -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode,
                          error_file=str(tmp_path / "none.json"))


def test_the_agent_ends_in_one_line_with_the_ranks_exit_code(tmp_path, monkeypatch, caplog):
    argv = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500",
            "--rdzv-id=run1", "--rdzv-conf=join_timeout=1500,read_timeout=1500", "-m", "cooper_mcore", "train"]

    def fails(e):
        def run(_args):
            raise e
        return run

    cases = [  # (torchrun stamps failures to the second: the rank it stopped with SIGTERM may tie with the one that
        # failed by itself, whose code it is)
        (ChildFailedError("cooper_mcore", {2: _failure(0, -15, tmp_path), 3: _failure(1, 69, tmp_path)}), 69,
         "2 training process(es) of this node failed (rank 2 killed by SIGTERM, rank 3 exit 69); each one's own "
         "error is above; exiting with 69 (rank 3's)"),
        (ChildFailedError("cooper_mcore", {0: _failure(0, -9, tmp_path)}), 137,
         "1 training process(es) of this node failed (rank 0 killed by SIGKILL); each one's own error is above; "
         "exiting with 137 (rank 0's)"),
        (RendezvousTimeoutError(), EXIT_PEER_LOST,
         "the rendezvous at node0:29500 (id run1) of 2 node(s) timed out after 1500 s: not every node joined; start "
         "the same command on every node (the same rendezvous endpoint and id), or give the nodes more time "
         "(RDZV_TIMEOUT of examples/launch_multinode.sh, torchrun's --rdzv-conf join_timeout); exiting with 69"),
    ]
    gone = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")
    gone.__cause__ = dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
    cases.append((gone, EXIT_PEER_LOST, "lost the rendezvous at node0:29500 (id run1) of 2 node(s): the node that "
                  "hosts its store (the rendezvous endpoint's) is gone or unreachable (Failed to recv, got 0 bytes. "
                  "Connection was likely closed.); exiting with 69"))
    for error, code, line in cases:
        monkeypatch.setattr(agent, "run", fails(error))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cooper_mcore.torchrun"):
            assert agent.main(argv) == code
        assert [r.getMessage() for r in caplog.records] == [line]
    monkeypatch.setattr(agent, "run", lambda _args: None)
    assert agent.main(argv) == 0


def test_the_agent_outlives_the_rendezvous_store(monkeypatch):
    """The store's host node ended first: this agent keeps watching its ranks (no node waits to join a store that
    is gone) instead of dying with their exit codes; other answers and errors are the store's as before."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    answers = iter([3, RendezvousConnectionError("The connection to the C10d store has failed."), ValueError("x")])

    def store(self):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(DynamicRendezvousHandler, "num_nodes_waiting", store)
    agent.keep_monitoring_without_the_store()
    agent.keep_monitoring_without_the_store()  # once is enough
    handler = object.__new__(DynamicRendezvousHandler)
    assert handler.num_nodes_waiting() == 3 and handler.num_nodes_waiting() == 0
    with pytest.raises(ValueError):
        handler.num_nodes_waiting()


def test_nccl_ranks_end_at_the_timeout_with_a_line():
    """CleanUpOnly (2) whatever torchrun set (it sets 1: the watchdog would kill the rank before it says why); the
    heartbeat monitor stays on, keeping a value the user chose."""
    assert nccl_watchdog_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480"}
    assert nccl_watchdog_env({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"})["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "900"
    assert ParallelConfig().timeout_minutes == 20


def test_the_watchdog_is_set_before_the_nccl_group_is_made(monkeypatch):
    """On a GPU under torchrun (which set 1), the world's NCCL group is made with CleanUpOnly."""
    seen = {}

    def fake_init(**kwargs):
        seen.update(backend=kwargs["backend"], handling=os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
                    heartbeat=os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "1")
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "600")
    with pytest.raises(RuntimeError, match="stop here"):
        init_distributed(ParallelConfig())
    assert seen == {"backend": "nccl", "handling": "2", "heartbeat": "600"}
