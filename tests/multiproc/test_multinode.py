"""Multi-node as users launch it (docs/deploy.md), two "nodes" on this machine: two torchrun agents of 2
processes each (TP=2 inside a node, DP=2 across them), c10d rendezvous on 127.0.0.1, gloo, the tiny preset.

One run history, shared by the tests of this module (fixture ``history``), against an uninterrupted reference:

0. the reference: ``examples/launch_multinode.sh`` with one agent of 4 processes (the same layout), all steps;
1. ``examples/slurm/cooper.sbatch`` under a stand-in ``srun`` that runs its task once per node of the
   allocation here (``SLURM_NODEID``, per-node logs): each node's launcher checks the config, starts the node's
   assistant (``ASSISTANT_MODEL_PATH``: the rehearsal's stand-in assistant in place of SGLang's server, which
   needs a GPU; the two nodes' servers share one port, as each real node serves its own at the same address),
   asks it once and starts the agent; steps with an evaluation and a periodic checkpoint, then SIGUSR1 to the
   batch script (SLURM's warning before the time limit): every rank checkpoints and exits 75;
2. the per-node command on each node (``launch_multinode.sh``, NNODES=2) with ``--resume auto``: it continues;
   once it has written a checkpoint, the node whose agent hosts the rendezvous store (its launcher, agent,
   ranks and assistant) is SIGKILLed mid-step: the other node's ranks must each exit with one line naming the
   collective that lost its peer, the newest complete checkpoint and ``--resume auto``, and its launcher exit 69
   (its agent outliving the store), within 60 s;
3. ``cooper.sbatch`` again with ``--resume auto``: it continues from that checkpoint to the end.

Every step's metrics and the final policy and reward-model weights of that history must equal the reference's
bit for bit (:func:`cooper_mcore.rehearsal.run.metrics_differ`, ``weights_differ``): the same global ranks
compute the same things whatever the agents, and a resume restores everything. Also here: a node that never
joins the rendezvous ends the launch in one line (exit 69), and a config refusal raised on every rank is
printed once per node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cooper_mcore.checkpoint.training import complete_checkpoints
from cooper_mcore.exit_codes import EXIT_PEER_LOST, EXIT_PREEMPTED
from cooper_mcore.rehearsal.run import metrics_differ, weights_differ
from tests.conftest import ROOT, _free_port

pytestmark = pytest.mark.multiproc

LAUNCH = str(ROOT / "examples" / "launch_multinode.sh")
SBATCH = str(ROOT / "examples" / "slurm" / "cooper.sbatch")
STEPS = 5
LOST_BOUND_S = 60  # from the SIGKILL of a node to the exit of the other node's launcher
RUN_LIMIT_S = 420  # any one launch (start-up of 4 processes on 2 shared cores included)

# `python -m sglang.launch_server ...` on a node without a GPU: the rehearsal's stand-in assistant on the port the
# launcher gives, shared with the other "node" of this machine; on SIGTERM (the launcher's exit) it writes how many
# answers it gave to $STANDIN_COUNTS/node<SLURM_NODEID>-<pid>.json
STANDIN_SGLANG = """
import argparse, json, logging, os, signal, threading
from cooper_mcore.rehearsal.assistant import StandInAssistant
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
parser = argparse.ArgumentParser()
parser.add_argument("--served-model-name")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
with StandInAssistant(args.served_model_name, slow_s=0.05, port=args.port, reuse_port=True) as server:
    done.wait()
    counts = dict(server.counts)
node = os.environ.get("SLURM_NODEID", "x")
with open(os.path.join(os.environ["STANDIN_COUNTS"], f"node{node}-{os.getpid()}.json"), "w") as f:
    json.dump(counts, f)
"""
# srun: the task once per node of the allocation, here, each with its SLURM_NODEID and its own log; signals are
# passed on to the tasks (as srun does); the exit status is the highest of the tasks'
STANDIN_SRUN = """#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_ID=0 "$@" > "$SRUN_LOGS/node$node.log" 2>&1 &
    pids+=("$!")
done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    while true; do
        wait "$pid"
        rc=$?
        kill -0 "$pid" 2>/dev/null || break  # else a trapped signal interrupted the wait
    done
    (( rc > status )) && status=$rc
done
exit "$status"
"""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """The stand-ins' folder: ``scontrol``, ``srun`` and the launchers' ``python`` (see the module doc)."""
    root = tmp_path_factory.mktemp("stand_ins")
    (root / "standin_sglang.py").write_text(STANDIN_SGLANG)
    scripts = {
        "scontrol": '#!/usr/bin/env bash\nprintf "127.0.0.1\\n127.0.0.1\\n"\n',
        "srun": STANDIN_SRUN,
        "python": (f'#!/usr/bin/env bash\nif [[ ${{1:-}} == -m && ${{2:-}} == sglang.launch_server ]]; then\n'
                   f'    shift 2\n    exec {sys.executable} {root / "standin_sglang.py"} "$@"\nfi\n'
                   f'exec {sys.executable} "$@"\n'),
    }
    for name, text in scripts.items():
        (root / name).write_text(text)
        (root / name).chmod(stat.S_IRWXU)
    return {"bin": str(root), "python": str(root / "python")}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """The tiny task and models, and an "assistant model" folder for ASSISTANT_MODEL_PATH (the tiny policy's
    config.json: the launcher sizes the server's memory from it)."""
    from cooper_mcore.demo.assets import build_tiny_assets

    root = tmp_path_factory.mktemp("assets")
    paths = build_tiny_assets(str(root), n_train=32, n_eval=4)
    assistant = root / "stand-in-assistant"
    assistant.mkdir()
    (assistant / "config.json").write_text(Path(paths["policy_hf"], "config.json").read_text())
    paths["assistant"] = str(assistant)
    return paths


def _env(stand_ins: dict[str, str], assets: dict[str, str], work: Path, **kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASSISTANT_", "MASTER_", "NNODES", "GPUS_PER_NODE", "RDZV_", "SLURM_", "COOPER_",
                                "GPU_MEMORY", "TORCHELASTIC_"))}
    env.update(PYTHON=stand_ins["python"], PATH=f"{stand_ins['bin']}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", LOGLEVEL="INFO",
               GPU_MEMORY_GIB="80", ASSISTANT_MODEL_PATH=assets["assistant"], ASSISTANT_READY_TIMEOUT="300",
               STANDIN_COUNTS=str(work / "assistant_counts"))
    env.update(kw)
    return env


def _overrides(assets: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"out={out}", f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"model.rm_ckpt={assets['rm_ckpt']}", f"data.train_path={assets['train']}",
            f"data.eval_path={assets['eval']}", "logging.wandb=false", f"train.steps={STEPS}", "parallel.tp=2",
            "train.prompts_per_step=4", "rollout.max_new_tokens=24", "eval.every=2", "eval.max_new_tokens=24",
            "checkpoint.every=1", "checkpoint.keep=2", "rm.negatives=assistant", *extra]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait_until(condition, procs: list[subprocess.Popen], what: str, timeout: float = RUN_LIMIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{what}: not reached (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.05)


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (torchrun starts each rank in a session of its own, so a
    process group would miss them)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _finish(procs: list[subprocess.Popen], timeout: float = RUN_LIMIT_S) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            _kill_tree(p.pid)
            p.wait()


def _newest(out: Path) -> int:
    steps = complete_checkpoints(str(out / "checkpoints"))
    return steps[-1] if steps else 0


def _metrics(out: Path) -> dict[int, dict]:
    """Each step's metrics line (the last one written for it)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row for row in rows}


def _errors(log: str, name: str = "cooper_mcore") -> list[str]:
    return [line.split(f" ERROR {name}: ", 1)[1] for line in log.splitlines() if f" ERROR {name}: " in line]


@pytest.fixture(scope="module")
def history(stand_ins, assets, tmp_path_factory) -> dict:
    """The reference and the interrupted history (module doc); what each launch left, for the tests."""
    work = tmp_path_factory.mktemp("multinode")
    (work / "assistant_counts").mkdir()
    got: dict = {"work": work}
    port = str(_free_port())

    ref = work / "reference"
    env = _env(stand_ins, assets, work, NNODES="1", GPUS_PER_NODE="4", MASTER_PORT=str(_free_port()),
               RDZV_ID="reference", ASSISTANT_PORT=port)
    t0 = time.monotonic()
    got["reference_rc"] = _finish([_start(["bash", LAUNCH, "examples/tiny_cpu.yaml", *_overrides(assets, ref)], env,
                                          work / "reference.log")])
    got["seconds"] = {"reference": time.monotonic() - t0}

    out = work / "run"
    slurm = dict(SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="2",
                 SLURM_CPUS_PER_TASK="1", COOPER_REPO=str(ROOT), ASSISTANT_PORT=port)
    # 1. sbatch; SIGUSR1 once a periodic checkpoint and an evaluation are written
    t0 = time.monotonic()
    (work / "sbatch1").mkdir()
    env = _env(stand_ins, assets, work, SLURM_JOB_ID="101", COOPER_MASTER_PORT=str(_free_port()),
               SRUN_LOGS=str(work / "sbatch1"), **slurm)
    job = _start(["bash", SBATCH, "examples/tiny_cpu.yaml", *_overrides(assets, out)], env, work / "sbatch1.log")
    _wait_until(lambda: _newest(out) >= 2, [job], "a checkpoint after the evaluation of step 2")
    job.send_signal(signal.SIGUSR1)
    got["sbatch1_rc"] = _finish([job])[0]
    got["stopped_at"] = _newest(out)
    assert got["stopped_at"] < STEPS - 1, "the stop came too late to leave a step to lose a node in"
    got["seconds"]["sbatch"] = time.monotonic() - t0

    # 2. the per-node command on each node; the node that does not host the rendezvous store is lost mid-step
    t0 = time.monotonic()
    rdzv_port = _free_port()
    env = _env(stand_ins, assets, work, NNODES="2", GPUS_PER_NODE="2", MASTER_PORT=str(rdzv_port),
               RDZV_ID="relaunch", ASSISTANT_PORT=port)
    cmd = ["bash", LAUNCH, "examples/tiny_cpu.yaml", *_overrides(assets, out), "--resume", "auto"]
    nodes = [_start(cmd, env, work / f"lost{i}.log") for i in range(2)]
    try:
        _wait_until(lambda: _newest(out) > got["stopped_at"], nodes, "a checkpoint after the resume")
        host = [_hosts_store(node, rdzv_port) for node in nodes]
        assert host.count(True) == 1, host
        lost, survivor = (0, 1) if host[0] else (1, 0)  # the harder loss: the other agent loses its store too
        _kill_tree(nodes[lost].pid)
        killed = time.monotonic()
        got["lost_newest"] = _newest(out)
        got["survivor_rc"] = nodes[survivor].wait(timeout=LOST_BOUND_S + 30)
        got["survivor_s"] = time.monotonic() - killed
        got["survivor_log"] = (work / f"lost{survivor}.log").read_text()
    finally:
        for node in nodes:
            _kill_tree(node.pid)
            node.wait()
    got["seconds"]["lost node"] = time.monotonic() - t0

    # 3. sbatch again, --resume auto: to the end
    t0 = time.monotonic()
    (work / "sbatch2").mkdir()
    env = _env(stand_ins, assets, work, SLURM_JOB_ID="102", COOPER_MASTER_PORT=str(_free_port()),
               SRUN_LOGS=str(work / "sbatch2"), **slurm)
    job = _start(["bash", SBATCH, "examples/tiny_cpu.yaml", *_overrides(assets, out), "--resume", "auto"], env,
                 work / "sbatch2.log")
    got["sbatch2_rc"] = _finish([job])[0]
    got["seconds"]["resume"] = time.monotonic() - t0
    print(json.dumps(got["seconds"]))  # (pytest -s shows what each launch took)
    return got


def _hosts_store(node: subprocess.Popen, port: int) -> bool:
    """Whether this node's agent hosts the c10d rendezvous store: listens on the rendezvous port (on one machine
    the first agent to bind it does)."""
    for p in psutil.Process(node.pid).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return True
        except psutil.Error:  # gone meanwhile
            continue
    return False


def test_sbatch_runs_two_nodes_with_their_assistants_and_stops_on_sigusr1(history):
    work = history["work"]
    assert history["reference_rc"] == [0], (work / "reference.log").read_text()[-3000:]
    logs = [(work / "sbatch1" / f"node{n}.log").read_text() for n in range(2)]
    assert history["sbatch1_rc"] == EXIT_PREEMPTED, (work / "sbatch1.log").read_text()[-2000:] + logs[0][-3000:]
    stop = history["stopped_at"]
    out = work / "run"
    for log in logs:  # each node: its assistant started and answered the launcher's check, its 2 ranks stopped
        assert "stand-in assistant serving 'stand-in-assistant'" in log
        assert "assistant 'stand-in-assistant' answers at http://127.0.0.1:" in log
        said = [e for e in _errors(log) if re.match(rf"preempted \(.+\) after step {stop}: checkpoint "
                                                    rf"{out}/checkpoints/step_{stop} written", e)]
        assert len(said) == 2, log[-3000:]
        assert "Traceback" not in log
    assert "cooper.sbatch: SIGUSR1" in (work / "sbatch1.log").read_text()
    # one rendezvous, a node each: Megatron's TP groups {0, 1} and {2, 3} inside the nodes, DP across them
    assert sorted(_rendezvous(log) for log in logs) == [(0, 2, [0, 1]), (1, 2, [2, 3])]
    counts = [json.loads(p.read_text()) for p in sorted((work / "assistant_counts").glob("node[01]-*.json"))]
    assert len(counts) == 4 and sum(sum(c.values()) for c in counts) > 0, counts  # two nodes, two sbatch jobs


def _rendezvous(log: str) -> tuple[int, int, list[int]]:
    """(group_rank, group_world_size, global_ranks) from torchrun's "Rendezvous complete" log (LOGLEVEL=INFO)."""
    found = [re.search(rf"\b{key}=(\[[^\]]*\]|\d+)", log) for key in ("group_rank", "group_world_size",
                                                                      "global_ranks")]
    assert all(found), log[-3000:]
    return int(found[0].group(1)), int(found[1].group(1)), json.loads(found[2].group(1))


def test_a_lost_node_ends_the_other_in_one_line_per_rank(history):
    out, log = history["work"] / "run", history["survivor_log"]
    assert history["survivor_rc"] == EXIT_PEER_LOST, log[-4000:]
    assert history["survivor_s"] < LOST_BOUND_S, history["survivor_s"]
    newest = f"{out}/checkpoints/step_{history['lost_newest']}"
    lines = _errors(log)
    assert sorted(int(re.match(r"rank (\d) of 4: ", e).group(1)) for e in lines) in ([0, 1], [2, 3]), lines
    for line in lines:  # one line per surviving rank: the collective, the lost peer, the checkpoint, the command
        assert re.search(r"of 4: lost a peer in (torch\.distributed\.\w+ over ranks \[[0-9, ]+\]|a collective of "
                         r"torch\.distributed), called from (cooper_mcore|megatron)/", line), line
        assert "torch: " in line and re.search(r"Connection (reset|closed) by peer", line), line
        assert line.endswith(f"the newest complete checkpoint is {newest}: run the same command on every node with "
                             "--resume auto to continue from it"), line
    (agent,) = _errors(log, "cooper_mcore.torchrun")  # torchrun's block, in one line
    assert re.search(r"^2 training process\(es\) of this node failed \(rank \d (exit 69|killed by SIGTERM), rank \d "
                     r"(exit 69|killed by SIGTERM)\); each one's own error is above; exiting with 69 \(rank \d's\)$",
                     agent), agent
    assert "Traceback" not in log and "unexpected error" not in log


def test_the_relaunch_resumes_and_equals_the_uninterrupted_run_bit_for_bit(history):
    work = history["work"]
    logs = "".join((work / "sbatch2" / f"node{n}.log").read_text() for n in range(2))
    assert history["sbatch2_rc"] == 0, logs[-4000:]
    assert f"resumed from {work}/run/checkpoints/step_{history['lost_newest']} (step {history['lost_newest']})" in logs
    ref, got = _metrics(work / "reference"), _metrics(work / "run")
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert ref[1]["ratio/mean"] == pytest.approx(1.0) and ref[1]["kl"] == pytest.approx(0.0, abs=1e-6)  # on-policy
    assert [s for s in got if "eval/acc" in got[s]] == [2, 4]
    diffs = {s: d for s in ref if (d := metrics_differ(ref[s], got[s]))}
    assert not diffs, diffs
    final = f"checkpoints/step_{STEPS}"
    for part in ("policy", "rm"):
        assert not weights_differ(str(work / "reference" / final / part), str(work / "run" / final / part)), part
    assert any(got[s]["pairs/valid"] > 0 for s in got)  # the reward model was trained: equal weights mean something


def test_a_node_that_never_joins_ends_the_launch_in_one_line(assets, tmp_path):
    """One node of two: the rendezvous waits RDZV_TIMEOUT, then the launcher exits 69 with one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASSISTANT_", "SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHON=sys.executable, NNODES="2", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RDZV_ID="alone", RDZV_TIMEOUT="5", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    overrides = [o for o in _overrides(assets, tmp_path / "run") if not o.startswith("rm.negatives")]
    r = subprocess.run(["bash", LAUNCH, "examples/tiny_cpu.yaml", *overrides], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == EXIT_PEER_LOST, r.stderr[-3000:]
    (line,) = _errors(r.stderr, "cooper_mcore.torchrun")
    assert line.startswith("the rendezvous at 127.0.0.1:") and "(id alone) of 2 node(s) timed out after 5 s: not " \
        "every node joined; start the same command on every node" in line and line.endswith("exiting with 69")
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_a_config_refusal_is_printed_once_per_node(tmp_path):
    """Both ranks of a node refuse the same config: one line, then the agent's, exit 2 (torchrun alone: 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "cooper_mcore.torchrun", "--standalone", "--nproc-per-node=2",
                        "-m", "cooper_mcore", "train", "--config", "examples/tiny_cpu.yaml", "--out",
                        str(tmp_path / "run"), "parallel.tp=3"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(_errors(r.stderr)) == 1, r.stderr[-3000:]  # one rank's message (its problems on the lines below)
    assert r.stderr.count("the world size 2 is not divisible by tp*pp = 3*1") == 1
    (agent,) = _errors(r.stderr, "cooper_mcore.torchrun")
    assert re.search(r"exiting with 2 \(rank [01]'s\)$", agent), agent
    assert "Traceback" not in r.stderr


AGENT_CHILD = """
import os, signal, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}")
os.rename(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
deadline = time.time() + 120
while not got and time.time() < deadline:
    time.sleep(0.05)
sys.exit(0 if got else 1)
"""


def test_torchrun_workers_are_its_children_and_take_sigusr1(tmp_path):
    """What the launcher's forwarding relies on: each worker's parent is the agent the launcher starts (it finds
    them as the agent's children), and SIGUSR1 sent to them leaves the agent running to a clean exit."""
    (tmp_path / "worker.py").write_text(AGENT_CHILD)
    agent = subprocess.Popen([sys.executable, "-m", "cooper_mcore.torchrun", "--nnodes=1", "--nproc-per-node=2",
                              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--max-restarts=0",
                              str(tmp_path / "worker.py"), str(tmp_path)],
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert agent.poll() is None and time.time() < deadline, agent.communicate()[0][-3000:]
            time.sleep(0.2)
        pids = [tuple(map(int, (tmp_path / f"pid{r}").read_text().split())) for r in range(2)]
        assert [ppid for _, ppid in pids] == [agent.pid, agent.pid]
        for pid, _ in pids:
            os.kill(pid, signal.SIGUSR1)
        log = agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, log[-3000:]
