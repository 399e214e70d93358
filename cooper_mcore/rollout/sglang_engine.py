"""Rollout engine on SGLang 0.5.23 (``docs/sglang.md``): offline ``sglang.Engine`` in this process
(:meth:`SGLangEngine.offline`, colocated) or an HTTP server (:meth:`SGLangEngine.launch` /
:meth:`SGLangEngine.connect`), on CUDA or on SGLang's CPU backend (:meth:`SGLangConfig.cpu`).

Weights travel in SGLang's ``flattened_bucket`` load format (:mod:`cooper_mcore.rollout.sglang_payload`:
shared tensors, so the server must share the host and GPUs), one payload per SGLang TP rank
(possibly made by different trainer ranks), base64-encoded over HTTP
(:mod:`cooper_mcore.rollout.sglang_http`), inside the ``begin_weight_update`` /
``end_weight_update`` session SGLang 0.5.23 requires. Each
engine of a node gets its own ports from its local rank, and building ``sglang.Engine`` leaves
the trainer's logging as it was. ``sglang`` is imported lazily, only inside the functions that
need it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions on ForkingPickler)

from cooper_mcore.rollout.base import EngineLost, GenerateOutput, Prompts, SamplingParams
from cooper_mcore.rollout.sglang_http import SGLangHTTPClient
from cooper_mcore.rollout.sglang_payload import LOAD_FORMAT, rank_payload
from cooper_mcore.rollout.weight_group import WeightGroup, WeightGroupSpec, specs_of

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"  # the release this module was written against (its PyPI wheel's source)

# ServerArgs fields this module sets (names checked against SGLang 0.5.23's arg_groups/fields)
SERVER_ARG_NAMES = frozenset({
    "model_path", "tokenizer_path", "tp_size", "dtype", "mem_fraction_static", "enable_memory_saver",
    "enable_weights_cpu_backup", "random_seed", "skip_tokenizer_init", "trust_remote_code",
    "context_length", "max_running_requests", "max_total_tokens", "base_gpu_id", "enable_deterministic_inference",
    "host", "port", "nccl_port", "log_level", "device", "attention_backend", "disable_cuda_graph", "sleep_on_idle",
    "enable_return_routed_experts",
})
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # ServerArgs.dtype choices
DEVICES = ("cuda", "cpu")
# request sampling_params keys this module sends (SGLang's /generate rejects unknown keys)
SAMPLING_PARAM_NAMES = frozenset({"max_new_tokens", "temperature", "top_p", "stop", "sampling_seed"})
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants.GPU_MEMORY_TYPE_*

_RAW_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
_CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"  # sglang.srt.utils.is_cpu(): SGLang's CPU backend
_BIG_SEED = 2**63


# -- configuration ---------------------------------------------------------------------------
@dataclass
class SGLangConfig:
    """How to start SGLang; :meth:`server_args` maps it to ``ServerArgs`` keyword arguments.

    Attributes:
        model_path / tp_size / dtype / mem_fraction_static / random_seed / ...: the ``ServerArgs``
            fields of the same names (:data:`SERVER_ARG_NAMES`; ``dtype`` in :data:`DTYPE_CHOICES`).
        device: ``"cuda"``, or ``"cpu"`` for SGLang's CPU backend (``SGLANG_USE_CPU_ENGINE=1``, the
            ``torch_native`` attention backend unless ``attention_backend`` says otherwise, CUDA graphs
            off, no memory saver; pass ``max_total_tokens``, else SGLang sizes its KV cache from the
            host's memory).
        attention_backend: SGLang's attention backend (None: SGLang's choice; ``torch_native`` on CPU).
        disable_cuda_graph: turn CUDA graphs off (always off on CPU).
        max_total_tokens: size of the KV-cache pool in tokens (None: from ``mem_fraction_static``).
        sleep_on_idle: the scheduler sleeps while idle instead of polling (a colocated engine on a few
            CPU cores otherwise keeps one busy all through training).
        enable_memory_saver: needed for :meth:`SGLangEngine.release_memory` to free anything (None:
            on for CUDA, off on CPU, where SGLang cannot release memory).
        enable_weights_cpu_backup: keep the weights in CPU memory while released (otherwise they
            must be re-sent with ``update_weights`` after resuming them).
        skip_tokenizer_init: token-id prompts only; outputs carry no text.
        enable_deterministic_inference: SGLang honours per-request seeds only in this mode.
        raw_logprobs: log-probabilities of the unscaled distribution (temperature 1, as the trainer
            computes them) via ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; else after temperature scaling.
        enable_return_routed_experts: capture the experts each token is routed to, so that a request
            can ask for them (``SamplingParams.routed_experts``; rollout routing replay).
        port: the server's HTTP port; SGLang derives further ports from it (``port + 233`` with
            DP attention, ``port + 10000`` for gRPC). None: ``base_port + local_rank * port_stride``,
            so that the engines of one node never share ports.
        nccl_port: SGLang's torch.distributed port. None: ``port + 1`` (SGLang itself would pick a
            free port at random, racing with the other engines of the node).
        base_port / port_stride: the ports of local rank ``r``'s engine start at
            ``base_port + r * port_stride``.
        local_rank: this process's rank on its node (None: ``$LOCAL_RANK``, else 0).
        extra_server_args: further ``ServerArgs`` fields, checked against the installed SGLang.
    """

    model_path: str
    tokenizer_path: Optional[str] = None
    tp_size: int = 1
    dtype: str = "bfloat16"
    device: str = "cuda"
    attention_backend: Optional[str] = None
    disable_cuda_graph: bool = False
    mem_fraction_static: float = 0.5
    max_total_tokens: Optional[int] = None
    sleep_on_idle: bool = False
    enable_memory_saver: Optional[bool] = None
    enable_weights_cpu_backup: bool = False
    random_seed: int = 0
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    context_length: Optional[int] = None
    max_running_requests: Optional[int] = None
    base_gpu_id: int = 0
    enable_deterministic_inference: bool = False
    raw_logprobs: bool = True
    enable_return_routed_experts: bool = False
    host: str = "127.0.0.1"
    port: Optional[int] = None
    nccl_port: Optional[int] = None
    base_port: int = 30000
    port_stride: int = 10
    local_rank: Optional[int] = None
    log_level: str = "error"
    extra_server_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def cpu(cls, model_path: str, **overrides: Any) -> SGLangConfig:
        """A config for SGLang's CPU backend (fp32, a 4096-token KV cache, the scheduler asleep when idle);
        ``overrides`` set other fields.

        ``max_total_tokens`` is what sizes the KV cache here. ``mem_fraction_static`` stays at 0.5:
        SGLang budgets the cache as the host memory free after loading minus ``(1 - fraction)`` of
        what was free before, so a small fraction fails ("Loaded weights leave no GPU memory")
        as soon as other processes take that much host memory meanwhile (seen at 0.05 on a shared
        machine); the cache is then cut to ``max_total_tokens``."""
        fields = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "mem_fraction_static": 0.5,
                  "sleep_on_idle": True}
        fields.update(overrides)
        return cls(model_path=model_path, **fields)

    def resolved_local_rank(self) -> int:
        """``local_rank``, else ``$LOCAL_RANK``, else 0."""
        if self.local_rank is not None:
            return self.local_rank
        raw = os.environ.get("LOCAL_RANK", "0")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None

    def resolved_port(self) -> int:
        """The HTTP port: ``port``, else ``base_port + local_rank * port_stride``."""
        return self.port if self.port is not None else self.base_port + self.resolved_local_rank() * self.port_stride

    def resolved_nccl_port(self) -> int:
        """SGLang's torch.distributed port: ``nccl_port``, else ``port + 1``."""
        return self.nccl_port if self.nccl_port is not None else self.resolved_port() + 1

    def memory_saver(self) -> bool:
        """Whether SGLang's memory saver is on (``enable_memory_saver``, else on for CUDA only)."""
        return self.device == "cuda" if self.enable_memory_saver is None else self.enable_memory_saver

    def engine_env(self) -> dict[str, str]:
        """Environment variables the SGLang processes need for this config."""
        env = {}
        if self.raw_logprobs:
            env[_RAW_LOGPROB_ENV] = "1"
        if self.device == "cpu":
            env[_CPU_ENGINE_ENV] = "1"
        return env

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        port, nccl_port = self.resolved_port(), self.resolved_nccl_port()
        for ok, problem in ((bool(self.model_path), "model_path is empty"),
                            (self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}"),
                            (self.dtype in DTYPE_CHOICES, f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}"),
                            (self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}"),
                            (0 < self.mem_fraction_static < 1,
                             f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"),
                            (self.max_total_tokens is None or self.max_total_tokens > 0,
                             f"max_total_tokens must be > 0, got {self.max_total_tokens}"),
                            (self.port_stride >= 2, f"port_stride must be >= 2 (HTTP and NCCL ports), got "
                                                    f"{self.port_stride}"),
                            (self.resolved_local_rank() >= 0, f"local_rank must be >= 0, got "
                                                              f"{self.resolved_local_rank()}"),
                            (0 < port < 65536, f"port must be in 1..65535, got {port}"),
                            (0 < nccl_port < 65536, f"nccl_port must be in 1..65535, got {nccl_port}"),
                            (nccl_port != port, f"nccl_port must differ from port ({port})"),
                            (not (self.device == "cpu" and self.memory_saver()),
                             "enable_memory_saver needs device='cuda' (SGLang cannot release memory on CPU)"),
                            (not (self.enable_deterministic_inference and self._attention_backend() == "torch_native"),
                             "enable_deterministic_inference needs an attention backend SGLang 0.5.23 makes "
                             "deterministic (fa3, fa4, flashinfer, triton, ...), not torch_native (the CPU "
                             "backend): per-request sampling seeds are not available on CPU"),
                            (not (self.device == "cpu" and self.enable_return_routed_experts),
                             "enable_return_routed_experts needs device='cuda': SGLang 0.5.23 allocates the "
                             "routed-experts host buffer with cudaHostRegister whatever the device (no 'cpu' entry "
                             "in ALLOC_MEMORY_FUNCS), so its CPU scheduler dies at start and takes this process "
                             "tree with it; on CPU, replay the routing with rollout.engine=hf"),
                            (self.base_gpu_id >= 0, f"base_gpu_id must be >= 0, got {self.base_gpu_id}")):
            if not ok:
                raise ValueError(f"SGLangConfig.{problem}")

    def _attention_backend(self) -> Optional[str]:
        return self.attention_backend or ("torch_native" if self.device == "cpu" else None)

    def server_args(self) -> dict[str, Any]:
        """``ServerArgs`` keyword arguments (``None`` values left to SGLang's defaults); the ports are
        always set explicitly (:meth:`resolved_port`, :meth:`resolved_nccl_port`)."""
        self.validate()
        args: dict[str, Any] = {name: getattr(self, name) for name in sorted(SERVER_ARG_NAMES)}
        args.update(port=self.resolved_port(), nccl_port=self.resolved_nccl_port(),
                    enable_memory_saver=self.memory_saver())
        if self.device == "cpu":
            args.update(disable_cuda_graph=True, attention_backend=self._attention_backend())
            del args["base_gpu_id"]
        args = {k: v for k, v in args.items() if v is not None}
        clash = sorted(set(self.extra_server_args) & SERVER_ARG_NAMES)
        if clash:
            raise ValueError(f"SGLangConfig.extra_server_args sets {clash}: use the config fields of that name")
        args.update(self.extra_server_args)
        return args


def _child_pids() -> set[int]:
    """This process's descendants (psutil comes with SGLang; imported where SGLang is)."""
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


@contextlib.contextmanager
def _kill_only(pids: frozenset[int]) -> Iterator[None]:
    """Make ``sglang.Engine.shutdown`` stop only the engine's own processes.

    SGLang 0.5's shutdown ends with ``kill_process_tree(os.getpid(), include_parent=False)``: every
    child of this process, so also megatron's checkpoint writer and its queue manager, torch's resource
    tracker, verifier workers and other engines. Within this block that call kills the trees of ``pids``
    (none recorded: an engine this class did not start, e.g. a test double; nothing is patched).
    """
    if not pids:
        yield
        return
    import sglang.srt.entrypoints.engine as engine_module

    kill_tree = engine_module.kill_process_tree

    def engine_trees_only(parent_pid: int, include_parent: bool = True, **kwargs: Any) -> None:
        if parent_pid != os.getpid() or include_parent:
            kill_tree(parent_pid, include_parent=include_parent, **kwargs)
            return
        for pid in sorted(pids):
            with contextlib.suppress(Exception):  # already gone
                kill_tree(pid, include_parent=True, **kwargs)

    engine_module.kill_process_tree = engine_trees_only
    try:
        yield
    finally:
        engine_module.kill_process_tree = kill_tree


@contextlib.contextmanager
def preserve_root_logging() -> Iterator[None]:
    """Restore the root logger's handlers, level and filters, and every logger's ``disabled`` flag,
    after the block (which may run ``logging.basicConfig(force=True)`` or ``dictConfig``).

    The root handlers are detached during the block, so a forced ``basicConfig`` does not close
    them (a closed file handler loses its place in logging's shutdown flush); handlers the block
    installed on the root logger are removed and closed afterwards.
    """
    root = logging.getLogger()
    handlers, level, filters = list(root.handlers), root.level, list(root.filters)
    disabled = {name: lg.disabled for name, lg in logging.Logger.manager.loggerDict.items()
                if isinstance(lg, logging.Logger)}
    for h in handlers:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        root.filters[:] = filters
        for name, lg in logging.Logger.manager.loggerDict.items():
            if isinstance(lg, logging.Logger):
                lg.disabled = disabled.get(name, False)


def installed_server_arg_names() -> frozenset[str]:
    """Field names of the installed ``ServerArgs`` (a msgspec Struct in 0.5.23; imports sglang)."""
    import msgspec
    from sglang.srt.server_args import ServerArgs

    return frozenset(f.name for f in msgspec.structs.fields(ServerArgs))


def check_server_arg_names(args: dict[str, Any], known: Iterable[str]) -> None:
    """Raise ``ValueError`` if ``args`` has a key that is not a ``ServerArgs`` field in ``known``."""
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"not SGLang ServerArgs fields: {unknown} (written against sglang {SGLANG_VERSION})")


def server_cli_args(args: dict[str, Any]) -> list[str]:
    """``ServerArgs`` keywords as ``sglang.launch_server`` flags (``--field-name value``); booleans are
    store-true flags (the ones used here default to False), ``False`` and ``None`` are left out."""
    argv: list[str] = []
    for name, value in args.items():
        if value is not None and value is not False:
            argv += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
    return argv


def server_command(config: SGLangConfig, python: str = sys.executable) -> list[str]:
    """The command that launches an SGLang HTTP server for ``config``."""
    return [python, "-m", "sglang.launch_server", *server_cli_args(config.server_args())]


# -- sampling and outputs --------------------------------------------------------------------
def to_sglang_sampling_params(params: SamplingParams, index: int = 0) -> dict[str, Any]:
    """SGLang ``sampling_params`` for the ``index``-th prompt of a batch; a seed becomes
    ``sampling_seed = seed + index`` so that repeated prompts (a GRPO group) draw different samples."""
    params.validate()
    out: dict[str, Any] = {"max_new_tokens": int(params.max_new_tokens),
                           "temperature": float(params.temperature), "top_p": float(params.top_p)}
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = (int(params.seed) + index) % _BIG_SEED
    return out


def parse_generate_output(out: dict[str, Any], logprobs: bool, prompt_len: Optional[int] = None) -> GenerateOutput:
    """One SGLang generate result (``{"text", "output_ids", "meta_info"}``) as a GenerateOutput.

    ``meta_info["output_token_logprobs"]`` holds one ``[logprob, token_id, text]`` per output token;
    ``meta_info["finish_reason"]`` is ``{"type": "stop" | "length" | "abort", ...}``. Token ids
    include a stop token and the tokens of a matched stop string (as sampled), the text does not.
    With ``prompt_len`` (a request with ``return_routed_experts``) ``meta_info["routed_experts"]`` is
    read (:func:`decode_routed_experts`).

    Raises:
        RuntimeError: an aborted request, logprobs that do not match the output tokens, or routed
            experts missing or of the wrong size.
    """
    meta = out.get("meta_info") or {}
    rid = meta.get("id", "?")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise RuntimeError(f"SGLang aborted request {rid}: {reason.get('message')!r}")
    if kind not in ("stop", "length"):
        raise RuntimeError(f"SGLang request {rid} returned an unfinished or unknown finish_reason {reason!r}")
    token_ids = [int(t) for t in out.get("output_ids") or []]
    lps: Optional[list[float]] = None
    if logprobs:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise RuntimeError(f"SGLang request {rid} returned no output_token_logprobs")
        if len(entries) != len(token_ids) or any(int(e[1]) != t for e, t in zip(entries, token_ids)):
            raise RuntimeError(f"SGLang request {rid}: output_token_logprobs ({len(entries)} entries) do not "
                               f"match output_ids ({len(token_ids)} tokens)")
        lps = [float(e[0]) for e in entries]
    routes = None if prompt_len is None else decode_routed_experts(meta.get("routed_experts"),
                                                                   prompt_len + len(token_ids) - 1, rid)
    return GenerateOutput(token_ids=token_ids, text=out.get("text") or "", logprobs=lps, finish_reason=kind,
                          routed_experts=routes)


def decode_routed_experts(encoded: Optional[str], positions: int, rid: Any = "?") -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` as int32 ``[positions, layers * top_k]``.

    SGLang (``state_capturer/routed_experts.py``, the detokenizer's ``_b64_encode_per_request``) sends
    the base64 of an int32 array ``[seqlen - 1, num_hidden_layers, top_k]``: one row per token it ran
    (prompt, then every output token but the last), ``seqlen = prompt + output tokens``.

    Raises:
        RuntimeError: missing (a server without ``enable_return_routed_experts``) or not ``positions`` rows.
    """
    if not encoded:
        raise RuntimeError(f"SGLang request {rid} returned no routed_experts: start SGLang with "
                           "enable_return_routed_experts (--enable-return-routed-experts)")
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if positions < 1 or flat.size % positions:
        raise RuntimeError(f"SGLang request {rid}: routed_experts holds {flat.size} ids, not a whole number per "
                           f"each of its {positions} positions")
    return torch.from_numpy(flat.copy()).reshape(positions, -1)


# -- the engine ------------------------------------------------------------------------------
def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    it, prev, have = iter(items), None, False
    for item in it:
        if have:
            yield prev, False
        prev, have = item, True
    if have:
        yield prev, True


def _check(op: str, result: Any) -> None:
    """Raise if an offline-engine call reports failure (``(success, message)`` or ``.success``)."""
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        ok, msg = result[0], result[1]
    elif hasattr(result, "success"):
        ok, msg = bool(result.success), getattr(result, "message", "")
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang engine: {op} failed: {msg}")


def _check_reply(op: str, reply: Any) -> None:
    """A control call's reply over HTTP or offline: ``{"success": false, "message": ...}``, or a
    ``(success, message)`` pair, raises naming the call."""
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {op} failed: {reply.get('message')}")
    if isinstance(reply, (tuple, list)) and reply and reply[0] is False:
        raise RuntimeError(f"SGLang {op} failed: {reply[1] if len(reply) > 1 else ''}")


def _warn_version(found: Optional[str], where: str) -> None:
    if found and found != SGLANG_VERSION:
        logger.warning("%s runs sglang %s; this engine was written against %s", where, found, SGLANG_VERSION)


class SGLangEngine:
    """The :class:`~cooper_mcore.rollout.base.RolloutEngine` on SGLang; build it with :meth:`offline`,
    :meth:`launch` or :meth:`connect`.

    Args:
        engine / client: an ``sglang.Engine`` (offline) or an :class:`SGLangHTTPClient`; exactly one.
        tp_size: the engine's tensor-parallel size (one weight payload per TP rank).
        process: the launched server process, terminated by :meth:`shutdown`.
    """

    def __init__(self, engine: Any = None, client: Optional[SGLangHTTPClient] = None, tp_size: int = 1,
                 process: Optional[subprocess.Popen] = None, device: str = "cuda") -> None:
        if (engine is None) == (client is None):
            raise ValueError("SGLangEngine needs exactly one of engine= (offline) or client= (HTTP)")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if device not in DEVICES:
            raise ValueError(f"SGLangEngine device must be one of {DEVICES}, got {device!r}")
        self._engine = engine
        self._client = client
        self._process = process
        self.tp_size = tp_size
        self.device = device
        self.weight_version = 0
        self._released: list[str] = []
        self._closed = False
        self._group: Optional[WeightGroup] = None  # the weight group, once made
        #: the processes the offline engine started (its shutdown must stop these, and only these)
        self.engine_pids: frozenset[int] = frozenset()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def offline(cls, config: SGLangConfig) -> SGLangEngine:
        """Start ``sglang.Engine`` in this process (colocated with the trainer).

        The root logger's handlers, level and filters (and which loggers are disabled) are kept:
        building the engine runs SGLang's ``configure_logger``, whose ``logging.basicConfig(force=True,
        level=log_level)`` would otherwise remove the trainer's handlers and silence its INFO and
        WARNING lines.
        """
        args = config.server_args()
        os.environ.update(config.engine_env())  # read by the scheduler subprocesses it spawns
        import sglang

        _warn_version(getattr(sglang, "__version__", None), "this process")
        check_server_arg_names(args, installed_server_arg_names())
        logger.info("starting sglang.Engine: %s", args)
        before = _child_pids()
        with preserve_root_logging():
            engine = sglang.Engine(**args)
        made = cls(engine=engine, tp_size=config.tp_size, device=config.device)
        made.engine_pids = frozenset(_child_pids() - before)
        return made

    @classmethod
    def launch(cls, config: SGLangConfig, ready_timeout_s: float = 900.0, python: str = sys.executable,
               **client_kwargs: Any) -> SGLangEngine:
        """Launch ``python -m sglang.launch_server`` for ``config`` and wait until it is healthy."""
        cmd = server_command(config, python)
        env = {**os.environ, **config.engine_env()}
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        client = SGLangHTTPClient(f"http://{host}:{config.resolved_port()}", **client_kwargs)
        logger.info("launching SGLang server: %s", " ".join(cmd))
        process = subprocess.Popen(cmd, env=env, start_new_session=True)
        engine = cls(client=client, tp_size=config.tp_size, process=process, device=config.device)
        try:
            engine.wait_until_ready(ready_timeout_s)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    @classmethod
    def connect(cls, url: str, tp_size: Optional[int] = None, ready_timeout_s: float = 0.0, device: str = "cuda",
                **client_kwargs: Any) -> SGLangEngine:
        """Attach to a running SGLang server (its TP size is read from ``/server_info`` if not given;
        ``device="cpu"`` for a server on SGLang's CPU backend)."""
        client = SGLangHTTPClient(url, **client_kwargs)
        if ready_timeout_s > 0:
            client.wait_until_ready(ready_timeout_s)
        info = client.request("GET", "/server_info", "server_info", idempotent=True)
        info = info if isinstance(info, dict) else {}
        _warn_version(info.get("version"), f"the server at {client.base_url}")
        if tp_size is None:
            if not isinstance(info.get("tp_size"), int):
                raise ValueError(f"/server_info of {client.base_url} has no tp_size; pass tp_size=")
            tp_size = info["tp_size"]
        return cls(client=client, tp_size=tp_size, device=device)

    def _live(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"SGLangEngine.{op} called after shutdown()")

    @contextlib.contextmanager
    def _server_watch(self, op: str) -> Iterator[None]:
        """A failed request to a launched server that has exited (given 5 s to) raises :class:`EngineLost`
        naming its pid and exit code, which a caller may start again; other failures as they are."""
        try:
            yield
        except (ConnectionError, TimeoutError, RuntimeError) as e:
            proc = self._process
            if proc is None:
                raise
            try:
                code = proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                raise e from None
            raise EngineLost(f"the SGLang server {self._client.base_url} (pid {proc.pid}) exited with code {code} "
                             f"during {op}") from e

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the server answers its health check (offline engines are ready once built)."""
        self._live("wait_until_ready")
        if self._client is not None:
            self._client.wait_until_ready(timeout_s, process=self._process)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Prompts, params: SamplingParams) -> list[GenerateOutput]:
        """Complete each prompt (all texts or all token-id lists) once; outputs in input order."""
        self._live("generate")
        params.validate()
        prompts = list(prompts)
        if not prompts:
            return []
        if all(isinstance(p, str) for p in prompts):
            key, value = "text", prompts
        elif all(not isinstance(p, str) and isinstance(p, Sequence) for p in prompts):
            value = [[int(t) for t in p] for p in prompts]
            if any(not p for p in value):
                raise ValueError("SGLangEngine.generate: empty token-id prompt")
            key = "input_ids"
        else:
            raise ValueError("SGLangEngine.generate: prompts must be all strings or all token-id lists")
        if self._released:
            raise RuntimeError(f"SGLangEngine.generate called with memory released ({self._released}); "
                               "call resume_memory() first")
        if params.routed_experts and key == "text":
            raise ValueError("SGLangEngine.generate: routed_experts needs token-id prompts (their lengths)")
        sampling = [to_sglang_sampling_params(params, i) for i in range(len(value))]
        request = {"return_routed_experts": True} if params.routed_experts else {}
        if self._engine is not None:
            kwargs = {"prompt" if key == "text" else "input_ids": value, **request}
            outs = self._engine.generate(sampling_params=sampling, return_logprob=params.logprobs, **kwargs)
        else:
            with self._server_watch("generate"):
                outs = self._client.request("POST", "/generate", "generate",  # seeded, stateless: safe to resend
                                            {key: value, "sampling_params": sampling,
                                             "return_logprob": params.logprobs, **request}, idempotent=True)
        if not isinstance(outs, list) or len(outs) != len(value):
            raise RuntimeError(f"SGLang generate returned {type(outs).__name__} "
                               f"{len(outs) if isinstance(outs, list) else ''} for {len(value)} prompts")
        return [parse_generate_output(o, params.logprobs, len(p) if params.routed_experts else None)
                for o, p in zip(outs, value)]

    # -- weights -----------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """One ``update_weights_from_tensor`` call per bucket inside one weight-update session, the
        cache flushed with the last; then ``weight_version = version``. Every SGLang TP rank gets its
        own payload of the same tensors (this process's; over CUDA IPC from its GPU). Tensors must
        stay valid until this returns. After :meth:`init_weights_update_group` they are broadcast over
        the group instead (:meth:`_update_over_group`)."""
        if self._group is not None:
            with self._server_watch("update_weights"):
                self._update_over_group(buckets, version)
            return
        as_base64 = self._client is not None

        def payloads() -> Iterator[list[Any]]:
            for bucket in buckets:
                yield [rank_payload(bucket, as_base64) for _ in range(self.tp_size)]

        self.update_weights_from_payloads(payloads(), version)

    def update_weights_from_payloads(self, payloads: Iterable[Sequence[Any]], version: int) -> None:
        """Like :meth:`update_weights` with the payloads already made: per bucket, one payload per
        SGLang TP rank (:func:`rank_payload`: raw bytes, encoded here for HTTP, or base64); SGLang's TP rank
        ``i`` loads entry ``i`` only, so each can come from a different trainer rank's device
        (:func:`gather_rank_payloads`). Every payload holds the full (unsharded) Hugging Face
        tensors of the bucket: SGLang's ``load_weights`` cuts each rank's shard out of them."""
        self._live("update_weights")
        count = 0
        with self._weight_session():
            for blobs, last in _with_last(payloads):
                blobs = list(blobs)
                if len(blobs) != self.tp_size:
                    raise ValueError(f"SGLangEngine.update_weights: {len(blobs)} payloads for a bucket, expected "
                                     f"one per TP rank ({self.tp_size})")
                self._update_bucket(blobs, last, version)
                count += 1
                del blobs
            if count == 0:
                raise ValueError("SGLangEngine.update_weights: no buckets")
        self.weight_version = version
        logger.info("SGLang weights updated to version %d (%d buckets)", version, count)

    @contextlib.contextmanager
    def _weight_session(self) -> Iterator[None]:
        """The ``begin_weight_update`` / ``end_weight_update`` session SGLang 0.5.23 loads weights in (ended
        after a failure too, keeping the original error)."""
        self._call("begin_weight_update", {"selector": "all"})
        try:
            yield
        except BaseException:
            try:
                self._call("end_weight_update", {})
            except Exception as close_error:  # keep the original error
                logger.error("SGLang end_weight_update after a failed update also failed: %s", close_error)
            raise
        self._call("end_weight_update", {})

    def _update_bucket(self, blobs: list[Any], last: bool, version: int) -> None:
        if self._engine is not None:
            _check("update_weights_from_tensor", self._engine.update_weights_from_tensor(
                named_tensors=blobs, load_format=LOAD_FORMAT, flush_cache=last))
            return
        blobs = [base64.b64encode(b).decode("ascii") if isinstance(b, bytes) else b for b in blobs]  # JSON
        body: dict[str, Any] = {"serialized_named_tensors": blobs, "load_format": LOAD_FORMAT, "flush_cache": last}
        if last:
            body["weight_version"] = str(version)
        self._client.request("POST", "/update_weights_from_tensor", "update_weights_from_tensor", body)

    def _call(self, op: str, payload: dict[str, Any]) -> Any:
        """A control call by SGLang's name, offline (method) or over HTTP (``POST /<op>``)."""
        if self._engine is not None:
            result = getattr(self._engine, op)(**payload)
            _check(op, result)
            return result
        return self._client.request("POST", "/" + op, op, payload)

    # -- weights over a process group (an engine apart from the trainer) -----------------------
    def init_weights_update_group(self, spec: WeightGroupSpec) -> None:
        """Make the weight group with the engine's TP ranks (ranks ``1 .. tp_size`` of ``spec``; this process
        is rank 0 and hosts its store): SGLang's ``init_weights_update_group``, called while this side joins.
        From then on :meth:`update_weights` broadcasts over the group instead of sharing tensors.

        Raises:
            ValueError: ``spec.world_size`` is not ``1 + tp_size``.
            RuntimeError: SGLang could not join (its message).
        """
        self._live("init_weights_update_group")
        if spec.world_size != 1 + self.tp_size:
            raise ValueError(f"a weight group with an SGLang engine of TP {self.tp_size} has {1 + self.tp_size} "
                             f"ranks, got world_size {spec.world_size}")
        body = {"master_address": spec.master_address, "master_port": spec.master_port, "rank_offset": 1,
                "world_size": spec.world_size, "group_name": spec.group_name, "backend": spec.backend}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self._call, "init_weights_update_group", body)
            group = WeightGroup(spec, rank=0, device="cpu" if spec.backend == "gloo" else "cuda")
            _check_reply("init_weights_update_group", joined.result())
        self._group = group

    def destroy_weights_update_group(self) -> None:
        """Leave the weight group (SGLang's ``destroy_weights_update_group``); pushes share tensors again."""
        if self._group is None:
            return
        _check_reply("destroy_weights_update_group",
                     self._call("destroy_weights_update_group", {"group_name": self._group.spec.group_name}))
        self._group.close()
        self._group = None

    def _update_over_group(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """In a weight session, one ``update_weights_from_distributed`` per bucket, its tensors broadcast
        (on a thread of their own) while SGLang receives them; the cache flushed and the version set with
        the last. A refusal (its reply) is raised at once, not after the broadcast's timeout."""
        assert self._group is not None
        self._live("update_weights")
        count = 0
        with self._weight_session(), concurrent.futures.ThreadPoolExecutor(2) as pool:
            for bucket, last in _with_last(buckets):
                specs = specs_of(bucket)
                body = {"names": [t.name for t in specs], "dtypes": [t.dtype for t in specs],
                        "shapes": [list(t.shape) for t in specs], "group_name": self._group.spec.group_name,
                        "flush_cache": last, "weight_version": str(version) if last else None}
                received = pool.submit(self._call, "update_weights_from_distributed", body)
                sent = pool.submit(self._group.send, bucket)
                _check_reply("update_weights_from_distributed", received.result())
                sent.result()
                count += 1
            if count == 0:
                raise ValueError("SGLangEngine.update_weights: no buckets")
        self.weight_version = version
        logger.info("SGLang weights updated to version %d over the weight group (%d buckets)", version, count)

    # -- memory and cache --------------------------------------------------------------------
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free GPU memory (default: weights, KV cache, CUDA graphs; needs ``enable_memory_saver``).
        Without ``enable_weights_cpu_backup`` released weights must be re-sent after resuming.

        On a CPU engine SGLang cannot release memory (its scheduler calls CUDA synchronize and
        dies), so nothing is sent: the tags are only marked, and :meth:`generate` still refuses
        until they are resumed."""
        self._live("release_memory")
        todo = [t for t in self._tags(tags) if t not in self._released]
        if todo:
            if self.device != "cpu":
                self._call("release_memory_occupation", {"tags": todo})
            self._released += todo

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take back released memory (default: everything released). For a weight update with
        little free memory: ``resume_memory(["weights"])``, ``update_weights``, then ``resume_memory()``."""
        self._live("resume_memory")
        todo = [t for t in self._tags(tags) if t in self._released]
        if todo:
            if self.device != "cpu":
                self._call("resume_memory_occupation", {"tags": todo})
            self._released = [t for t in self._released if t not in todo]

    @staticmethod
    def _tags(tags: Optional[Sequence[str]]) -> list[str]:
        if tags is None:
            return list(MEMORY_TAGS)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"unknown SGLang memory tags {bad}; expected some of {MEMORY_TAGS}")
        return list(dict.fromkeys(tags))

    def flush_cache(self) -> None:
        """Drop the radix (prefix) cache; SGLang refuses while requests are running."""
        self._live("flush_cache")
        if self._engine is not None:
            _check("flush_cache", self._engine.flush_cache())
        else:
            self._client.request("POST", "/flush_cache", "flush_cache", idempotent=True)

    def shutdown(self) -> None:
        """Stop the engine (offline) or the launched server; a connected server is left running."""
        if self._closed:
            return
        self._closed = True
        if self._engine is not None:
            with _kill_only(self.engine_pids):
                self._engine.shutdown()
        if self._client is not None:
            self._client.close()
        proc = self._process
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launched server's own session (start_new_session)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                logger.warning("SGLang server (pid %d) ignored SIGTERM; killing it", proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
