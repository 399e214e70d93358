"""examples/launch_multinode.sh for real, on CPU with gloo: torchrun's c10d rendezvous with one agent, and
"multi-node without a cluster": two torchrun agents on this machine (``NNODES=2``, rendezvous on
127.0.0.1), TP=2 inside each "node" and DP across the two, whose Cooper steps must equal the same layout
run by one agent. Also the assumption the launcher's SIGUSR1 forwarding rests on: torchrun's workers are
its direct children, and a signal sent to them does not disturb the agent. The GPU cluster path differs
only in NNODES/GPUS_PER_NODE/MASTER_ADDR (and NCCL)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.multiproc

LAUNCH = str(ROOT / "examples" / "launch_multinode.sh")
# metrics that count discrete things (tokens, pairs, verifier verdicts): equal, not close
DISCRETE = ("rule/", "pairs/", "response/length", "skipped/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from cooper_mcore.demo.assets import build_tiny_assets

    return build_tiny_assets(str(tmp_path_factory.mktemp("assets")), n_train=32, n_eval=8)


def _env(**kw: str) -> dict[str, str]:
    env = dict(os.environ, DRY_RUN="0", MASTER_ADDR="127.0.0.1", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", PYTHONWARNINGS="ignore", LOGLEVEL="INFO")
    for k in ("ASSISTANT_URL", "ASSISTANT_MODEL_PATH", "GPU_MEMORY_GIB", "SLURM_STEP_ID"):
        env.pop(k, None)
    env.update(kw)
    return env


def _overrides(paths: dict, out, *extra: str) -> list[str]:
    return [f"out={out}", f"model.policy_ckpt={paths['policy_ckpt']}", f"model.policy_hf={paths['policy_hf']}",
            f"model.rm_ckpt={paths['rm_ckpt']}", f"data.train_path={paths['train']}", "eval.every=0",
            "checkpoint.every=0", "logging.wandb=false", "rollout.max_new_tokens=8", *extra]


def _metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def test_launcher_trains_with_c10d_rendezvous(tmp_path, assets):
    out = tmp_path / "run"
    env = _env(NNODES="1", GPUS_PER_NODE="2", MASTER_PORT=str(_free_port()), RDZV_ID="test")
    r = subprocess.run(["bash", LAUNCH, "examples/tiny_cpu.yaml", *_overrides(assets, out, "train.steps=1")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["ratio/mean"] == pytest.approx(1.0) and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)


def _rendezvous(log: str) -> tuple[int, int, list[int]]:
    """(group_rank, group_world_size, global_ranks) from torchrun's "Rendezvous complete" log (LOGLEVEL=INFO)."""
    found = [re.search(rf"\b{key}=(\[[^\]]*\]|\d+)", log) for key in ("group_rank", "group_world_size",
                                                                      "global_ranks")]
    assert all(found), log[-3000:]
    return int(found[0].group(1)), int(found[1].group(1)), json.loads(found[2].group(1))


def test_two_agents_on_one_machine_equal_one_agent(tmp_path, assets):
    """Two "nodes" of 2 CPU processes each (TP=2 inside a node, DP=2 across them) through the launcher, against
    one agent with 4 processes and the same layout: two Cooper steps (rollout, RM scoring and update, policy
    update, weight sync) must give the same metrics.

    Tolerance: both runs have the same global ranks, so every rank computes the same thing and gloo reduces
    over the same ranks in the same order; only the transport between the agents and LOCAL_RANK differ. The
    metrics are expected equal (they were, bitwise, when this test was written); floats are compared at
    1e-5 relative (+1e-7 absolute), room for a few hundred fp32 roundings (eps 6e-8) should a reduction ever
    run in another order, and far below what a layout error (a TP group across the two agents, a rank
    reading another's data) changes: rewards and losses move at 1e-3 and more. Discrete metrics (lengths,
    pairs, verifier verdicts) must be equal."""
    steps = ("train.steps=2", "parallel.tp=2", "train.prompts_per_step=4")
    one = tmp_path / "one"
    r = subprocess.run(["bash", LAUNCH, "examples/tiny_cpu.yaml", *_overrides(assets, one, *steps)], cwd=ROOT,
                       env=_env(NNODES="1", GPUS_PER_NODE="4", MASTER_PORT=str(_free_port()), RDZV_ID="one"),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]

    two = tmp_path / "two"
    env = _env(NNODES="2", GPUS_PER_NODE="2", MASTER_PORT=str(_free_port()), RDZV_ID="two")
    agents = [subprocess.Popen(["bash", LAUNCH, "examples/tiny_cpu.yaml", *_overrides(assets, two, *steps)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    try:
        logs = [a.communicate(timeout=900)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-3000:] for log in logs)
    ranks = sorted(_rendezvous(log) for log in logs)
    assert ranks == [(0, 2, [0, 1]), (1, 2, [2, 3])]  # one node each; Megatron's TP groups are {0,1} and {2,3}

    expected, got = _metrics(one), _metrics(two)
    assert [row["step"] for row in got] == [row["step"] for row in expected] == [1, 2]
    for row_one, row_two in zip(expected, got):
        assert row_one.keys() == row_two.keys()
        for key, value in row_one.items():
            if key.startswith(DISCRETE) or not isinstance(value, float):
                assert row_two[key] == value, (row_one["step"], key)
            else:
                assert row_two[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (row_one["step"], key)
    assert got[1]["pairs/valid"] + got[1]["pairs/no_positive"] + got[1]["pairs/no_negative"] > 0


WORKER = """
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
    """What the launcher's forwarding relies on: each worker's parent is the torchrun agent (the launcher
    finds them as the agent's children), and SIGUSR1 sent to them leaves the agent running to a clean exit."""
    (tmp_path / "worker.py").write_text(WORKER)
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--max-restarts=0",
                              str(tmp_path / "worker.py"), str(tmp_path)],
                             cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
