"""The real-SGLang tier (``make test-sglang``, run in ``.venv-sglang``): SGLang 0.5.23 on its CPU
backend, driven through cooper_mcore's :class:`~cooper_mcore.rollout.sglang_engine.SGLangEngine`.

Set-up for every test here:

* the test-only ``sgl_kernel`` stand-in (``stand_in/sgl_kernel``) goes first on ``sys.path`` and
  ``PYTHONPATH`` (for SGLang's scheduler subprocesses and launched servers), and
  ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU backend;
* session fixtures build the tiny assets once (a tokenizer trained on the arithmetic corpus, an
  untied and a tied random Qwen2 over exactly its vocabulary, in fp32, and their Megatron
  checkpoints) and share one offline engine and one HTTP server between the modules, since each
  SGLang start costs tens of seconds on two cores.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

STAND_IN = str(Path(__file__).resolve().parent / "stand_in")
if sys.path[0] != STAND_IN:
    sys.path.insert(0, STAND_IN)
os.environ["PYTHONPATH"] = os.pathsep.join([STAND_IN, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine  # noqa: E402

SERVER_READY_S = 600.0


def free_port() -> int:
    """A TCP port nothing listens on now; SGLang also takes the next one (its NCCL port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free pair of ports")


@dataclass(frozen=True)
class Assets:
    """Paths of the tiny assets (see the module docstring)."""

    tokenizer: str
    hf: dict[str, str]  # "untied" / "tied" -> HF model folder
    mcore: dict[str, str]  # same keys -> Megatron checkpoint
    vocab_size: int
    eos_id: int


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    from cooper_mcore.convert.checkpoint import hf_to_mcore
    from cooper_mcore.data.mathgen import tokenizer_corpus
    from cooper_mcore.data.tokenizer import EOS, train_tiny_tokenizer
    from cooper_mcore.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("sglang-assets")
    tok = train_tiny_tokenizer(tokenizer_corpus(600), str(root / "tokenizer"), vocab_size=128)
    vocab, eos = len(tok), tok.convert_tokens_to_ids(EOS)
    hf, mcore = {}, {}
    for i, (name, family) in enumerate((("untied", "qwen2"), ("tied", "qwen2_tied"))):
        hf[name] = save_tiny_hf_model(str(root / f"{name}-hf"), family, seed=10 + i, dtype=torch.float32,
                                      vocab_size=vocab, eos_token_id=eos, bos_token_id=1, pad_token_id=0)
        mcore[name] = str(root / f"{name}-mcore")
        hf_to_mcore(hf[name], mcore[name])
    return Assets(str(root / "tokenizer"), hf, mcore, vocab, eos)


def cpu_config(assets: Assets, name: str, **overrides) -> SGLangConfig:
    """The CPU engine config the tier uses for model ``name`` (a fresh pair of ports)."""
    fields = {"tokenizer_path": assets.tokenizer, "random_seed": 0, "port": free_port(), "max_total_tokens": 2048,
              "max_running_requests": 16}
    fields.update(overrides)
    return SGLangConfig.cpu(assets.hf[name], **fields)


@pytest.fixture(scope="session")
def megatron_world():
    """A one-process torch.distributed world with megatron's model-parallel groups (gloo)."""
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
