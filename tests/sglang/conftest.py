"""The real-SGLang tier (``make test-sglang``, run in ``.venv-sglang``): SGLang 0.5.23 on its CPU
backend, driven through cooper_mcore's :class:`~cooper_mcore.rollout.sglang_engine.SGLangEngine`.

Set-up for every test here:

* without CUDA, the test-only stand-ins (``stand_in/``: ``sgl_kernel``, ``flash_mla``) go first on
  ``sys.path`` and ``PYTHONPATH`` (for SGLang's scheduler subprocesses and launched servers), and
  ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU backend (the ``sglang``-marked tests);
  with CUDA nothing is replaced (the ``gpu``-marked tests of ``test_gpu.py``);
* session fixtures build the tiny assets once (a tokenizer trained on the arithmetic corpus, an
  untied and a tied random Qwen2 over its vocabulary, in fp32, and their Megatron
  checkpoints) and share one offline engine and one HTTP server between the modules, since each
  SGLang start costs tens of seconds on two cores.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = str(Path(__file__).resolve().parent / "stand_in")
CPU_TIER = not torch.cuda.is_available()  # with a GPU, the real sgl_kernel and SGLang's CUDA backend
if CPU_TIER:
    if sys.path[0] != STAND_IN:
        sys.path.insert(0, STAND_IN)
    os.environ["PYTHONPATH"] = os.pathsep.join([STAND_IN, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine  # noqa: E402

SERVER_READY_S = 600.0
WORKERS = Path(__file__).resolve().parent / "workers"


def torchrun_sglang(script: str, nproc: int, *args: str, timeout: int = 600) -> str:
    """Run ``tests/sglang/workers/<script>`` under torchrun (gloo on CPU); return its stdout.

    Output goes through files, not pipes: CPU weight payloads start a ``torch_shm_manager``
    daemon in each worker, which inherits the worker's stdout and lives as long as the SGLang
    server that mapped the shared memory, so a pipe would never reach end-of-file."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(WORKERS / script), *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run(cmd, stdout=out, stderr=err, timeout=timeout, env=env, cwd=ROOT).returncode
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code != 0:
        raise AssertionError(f"torchrun {script} failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return stdout


def free_port() -> int:
    """A port nothing listens on now, and the next one too (SGLang's NCCL port), both below Linux's
    ephemeral range (32768+): a port from there can be taken by any process's outgoing or gloo
    socket before the server binds it (seen: SGLang's scheduler took the HTTP port first)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports in 20000..32000")


@dataclass(frozen=True)
class Assets:
    """Paths of the tiny assets (see the module docstring)."""

    tokenizer: str
    hf: dict[str, str]  # "untied" / "tied" -> HF model folder
    mcore: dict[str, str]  # same keys -> Megatron checkpoint
    vocab_size: int  # the models' (the tokenizer's size rounded up to a multiple of 8)
    eos_id: int


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.data.mathgen import tokenizer_corpus
    from cooper_mcore.data.tokenizer import EOS, train_tiny_tokenizer
    from cooper_mcore.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("sglang-assets")
    tok = train_tiny_tokenizer(tokenizer_corpus(600), str(root / "tokenizer"), vocab_size=128)
    vocab, eos = -(-len(tok) // 8) * 8, tok.convert_tokens_to_ids(EOS)  # divisible by TP=2; ids past the
    # tokenizer's decode to nothing, in SGLang and in the tests alike
    hf, mcore = {}, {}
    for i, (name, family) in enumerate((("untied", "qwen2"), ("tied", "qwen2_tied"))):
        hf[name] = save_tiny_hf_model(str(root / f"{name}-hf"), family, seed=10 + i, dtype=torch.float32,
                                      vocab_size=vocab, eos_token_id=eos, bos_token_id=1, pad_token_id=0,
                                      max_position_embeddings=4096)
        mcore[name] = str(root / f"{name}-mcore")
        hf_to_mcore(hf[name], mcore[name])
    return Assets(str(root / "tokenizer"), hf, mcore, vocab, eos)


def cpu_config(assets: Assets, name: str, **overrides) -> SGLangConfig:
    """The CPU engine config the tier uses for model ``name`` (a fresh pair of ports)."""
    fields = {"tokenizer_path": assets.tokenizer, "random_seed": 0, "port": free_port(), "max_total_tokens": 16384,
              "max_running_requests": 16}
    fields.update(overrides)
    return SGLangConfig.cpu(assets.hf[name], **fields)


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process torch.distributed world with megatron's model-parallel groups (gloo), torn down
    after the module (the root conftest fails a module that leaves a world behind)."""
    from cooper_mcore.parallel import single_process_world

    with single_process_world():
        yield


class CaptureHandler(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Offline:
    """The session's offline engine and the trainer-style logging installed before it was built."""

    engine: SGLangEngine
    handler: CaptureHandler
    root_before: tuple  # (handlers, level, filters) of the root logger before the build
    root_after: tuple  # the same right after it


@pytest.fixture(scope="session")
def offline(assets) -> Offline:
    """``sglang.Engine`` in this process on the tied model, shared by the session. A capturing
    handler is put on the root logger (level INFO) first, as the trainer's CLI does."""
    root = logging.getLogger()
    handler = CaptureHandler()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    before = (list(root.handlers), root.level, list(root.filters))
    engine = SGLangEngine.offline(cpu_config(assets, "tied"))
    after = (list(root.handlers), root.level, list(root.filters))
    yield Offline(engine, handler, before, after)
    engine.shutdown()
    root.removeHandler(handler)
    root.setLevel(old_level)


def megatron_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-probabilities of ``completion`` after ``prompt`` under a Megatron policy (TP=PP=1 here):
    ``forward_only`` logits, ``log_softmax`` in float64."""
    from cooper_mcore.models.forward import forward_only

    ids = torch.tensor([prompt + completion])
    logits = forward_only(model, ids)[0].double()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def megatron_step_max(model, prompt: list[int], completion: list[int]) -> list[float]:
    """At each completion position, the largest next-token log-probability (for greedy checks)."""
    from cooper_mcore.models.forward import forward_only

    logits = forward_only(model, torch.tensor([prompt + completion]))[0].double()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].max(-1).values.tolist()


class Server:
    """A launched ``sglang.launch_server`` on the untied model that a test may kill and restart."""

    def __init__(self, config: SGLangConfig):
        self.config = config
        self.engine = SGLangEngine.launch(config, ready_timeout_s=SERVER_READY_S)
        self.url = self.engine._client.base_url

    def restart(self) -> None:
        self.engine.shutdown()
        self.engine = SGLangEngine.launch(self.config, ready_timeout_s=SERVER_READY_S)


@pytest.fixture(scope="session")
def server(assets) -> Server:
    srv = Server(cpu_config(assets, "untied"))
    yield srv
    srv.engine.shutdown()
