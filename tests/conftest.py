"""Shared fixtures: tiny random HF models of every family, converted once per session, and a
helper that runs a worker script under torchrun (gloo on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state

from cooper_mcore.parallel import destroy_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "multiproc" / "workers"
VARIANTS = [(f, t) for f in ("qwen2", "qwen2_tied", "llama", "qwen3") for t in ("causal_lm", "reward")]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args: str, timeout: int = 600) -> str:
    """Run ``tests/multiproc/workers/<script>`` on ``nproc`` local processes; return its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(WORKERS / script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r.stdout


_HOLD_LOCK = ("import sys, time\nfrom cooper_mcore.run_lock import RunLock\n"
              "RunLock(sys.argv[1], 'x').acquire()\nprint('held', flush=True)\ntime.sleep(600)\n")


def hold_lock(path: str) -> subprocess.Popen:
    """Another process holding the run-folder lock file ``path`` (:mod:`cooper_mcore.run_lock`) until it is
    killed (the caller kills it)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, path], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "held"
    return proc


def flip_a_byte(folder: Path) -> str:
    """Flip one bit in the middle of the folder's first ``.distcp`` shard (inside a tensor); return the
    shard's name."""
    shard = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    data = bytearray((folder / shard).read_bytes())
    data[len(data) // 2] ^= 0x08
    (folder / shard).write_bytes(bytes(data))
    return shard


def last_json(stdout: str):
    """The last line of a worker's output that is a JSON document."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith(("{", "[")):
            return json.loads(line)
    raise AssertionError(f"no JSON line in worker output:\n{stdout[-2000:]}")


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder that every pytest worker of this run shares (under pytest-xdist each worker's base
    temporary folder is a sibling of the others'): fixtures built there once serve them all."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[tuple[str, str], tuple[str, str]]:
    """{(family, model_type): (hf_dir, mcore_ckpt)} for every tiny variant, built once per test run
    (the workers of a parallel run take turns; the later ones reuse them). Tests must not change them."""
    from cooper_mcore.atomic import exclusive
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model

    root = shared_dir(tmp_path_factory, "tiny")
    out = {}
    with exclusive(str(root)):
        for i, (family, model_type) in enumerate(VARIANTS):
            hf_dir = str(root / f"{family}-{model_type}-hf")
            ckpt = str(root / f"{family}-{model_type}-mcore")
            if not os.path.isdir(ckpt):
                save_tiny_hf_model(hf_dir, family, model_type, seed=i)
                hf_to_mcore(hf_dir, ckpt)
            out[(family, model_type)] = (hf_dir, ckpt)
    return out


@pytest.fixture(scope="session")
def checkpoint_runs(tmp_path_factory) -> Path:
    """Checkpoints as the trainer writes them, built once per test run (shared by the workers; tests copy
    before they change anything):

    * ``hf/``: a tiny two-layer Qwen2 with a tokenizer; ``policy_src/``, ``rm_src/``: it converted (a
      causal LM, a reward model; each with its tokenizer in ``hf_extra/`` and a manifest);
    * ``run/checkpoints/step_{1,2}/{policy,rm}``: two training checkpoints of them, written by the trainer's
      own ``save_training_checkpoint`` (the policy with its optimizer);
    * ``random/checkpoints/step_1/policy``: a ``model.init=random`` run's (no tokenizer files);
    * ``prompts.jsonl``: eight arithmetic prompts (``question``, ``answer``).
    """
    from cooper_mcore.atomic import exclusive

    root = shared_dir(tmp_path_factory, "checkpoint_runs")
    with exclusive(str(root)):
        if not (root / "prompts.jsonl").is_file():  # written last
            _write_checkpoint_runs(root)
    return root


def _write_checkpoint_runs(root: Path) -> None:
    from cooper_mcore.checkpoint.model import load_checkpoint_model, open_model_checkpoint
    from cooper_mcore.checkpoint.training import save_training_checkpoint
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model, save_tiny_tokenizer
    from cooper_mcore.parallel import ParallelConfig, single_process_world
    from cooper_mcore.train.model_state import ModelState
    from cooper_mcore.train.offload import ModelOffloader
    from cooper_mcore.train.step import OptimConfig, build_scheduler, wrap_for_training

    def state(name: str, ckpt: str) -> ModelState:
        """A model as the trainer holds it: loaded, wrapped for training, with its optimizer and schedule."""
        module, arch = load_checkpoint_model(ckpt, ParallelConfig())
        ddp, opt = wrap_for_training(module, OptimConfig(lr=1e-3))
        _, hf_config, dtype = open_model_checkpoint(ckpt)
        return ModelState(name, module, arch, hf_config, dtype, ckpt, tokenizer=None,
                          offloader=ModelOffloader(ddp, opt), ddp=ddp, optimizer=opt,
                          scheduler=build_scheduler(opt, 1e-3, 0, 10, 0.0))

    hf = save_tiny_hf_model(str(root / "hf"), "qwen2", num_hidden_layers=2)
    save_tiny_tokenizer(hf)
    hf_to_mcore(hf, str(root / "policy_src"))
    hf_to_mcore(hf, str(root / "rm_src"), model_type="reward")
    with single_process_world():
        policy, rm = state("policy", str(root / "policy_src")), state("rm", str(root / "rm_src"))
        for step in (1, 2):
            save_training_checkpoint(str(root / "run" / "checkpoints"), step, [policy, rm], {})
        policy.source_ckpt = ""  # built with random weights: no checkpoint, so no tokenizer files
        save_training_checkpoint(str(root / "random" / "checkpoints"), 1, [policy], {})
    (root / "prompts.jsonl").write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                for i in range(8)))


@pytest.fixture(autouse=True, scope="module")
def _no_world_left_behind(request):
    """Fail the module whose tests leave behind a torch.distributed world that was not there before
    it (a module may share one world across its tests through a module fixture, torn down before
    this check; a session fixture's world exists before and after): the modules after it would run
    inside that world (a leaked world of one made the metrics tests fail far from the culprit)."""
    before = torch.distributed.is_initialized(), parallel_state.model_parallel_is_initialized()
    yield
    after = torch.distributed.is_initialized(), parallel_state.model_parallel_is_initialized()
    if any(a and not b for a, b in zip(after, before)):
        destroy_distributed()  # megatron's groups and the process group: the next module starts clean
        raise AssertionError(f"{request.module.__name__} left torch.distributed or megatron's model-parallel "
                             "groups initialised (a job did not tear down its world)")
