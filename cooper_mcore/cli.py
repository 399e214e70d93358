"""The ``cooper`` command (also ``python -m cooper_mcore``).

Subcommands are thin: they parse arguments and call one library function.

    cooper convert hf-to-mcore --hf-dir D --out D [--model-type causal_lm|reward] [--head-std S]
    cooper convert mcore-to-hf --ckpt D --out D [--tokenizer DIR]
    cooper verify --in F.jsonl --out G.jsonl [--timeout S] [--workers N]
    cooper tiny-assets --out DIR
    cooper eval --model CKPT_OR_HF --data F.jsonl [--k 8]
    cooper sft --config examples/jobs/sft_tiny_cpu.yaml [--ckpt CKPT] [--out DIR] [key=value ...]
    cooper train-rm --config examples/jobs/verify_rm_tiny_cpu.yaml [--ckpt RM] [--train F.jsonl] [--out DIR]
        [--eval VB.jsonl] [key=value ...]
    cooper eval-rm --ckpt RM --data VB.jsonl
    cooper annotate --in F.jsonl --out G.jsonl --judge-url URL --judge-model M
    cooper train --config examples/tiny_cpu.yaml [--out DIR] [--resume auto] [key=value ...]
    cooper config [--job train|sft|train-rm] [--config X] [KEY ...] [key=value ...]
    cooper demo [--full] [--out DIR] [--show] [key=value ...]
    cooper plan --config X --gpus-per-node N --gpu-memory-gib M [--nodes K] [--json] [key=value ...]
    cooper rehearse --config X [--out DIR] [key=value ...]
    cooper plot RUN [--out F.png]

Dotted ``key=value`` overrides may come before, between or after the options.

This module imports nothing but the standard library and :mod:`cooper_mcore.redaction`: the
subcommands' handlers (:mod:`cooper_mcore.commands`) import megatron-core, torch and transformers,
which takes seconds, so :data:`HANDLERS` names them and :func:`main` imports the chosen one after
the arguments are parsed. ``cooper --help``, ``--version`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import hashlib
import importlib
import importlib.metadata
import logging
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, Optional

import cooper_mcore
from cooper_mcore.redaction import install_log_filter

logger = logging.getLogger("cooper_mcore")

#: Each subcommand's handler as "module:function", imported only when that subcommand runs (see the
#: module doc: importing the library takes seconds that ``--help`` should not pay). The one place
#: where cooper_mcore imports a module other than at the top of a file.
HANDLERS = {
    "convert": "cooper_mcore.commands.convert:convert",
    "verify": "cooper_mcore.commands.verify:verify",
    "annotate": "cooper_mcore.commands.verify:annotate",
    "train": "cooper_mcore.commands.train:train",
    "config": "cooper_mcore.config.show:config",  # not under commands/, whose import loads megatron-core
    "eval": "cooper_mcore.commands.evaluate:evaluate",
    "sft": "cooper_mcore.commands.jobs:sft",
    "train-rm": "cooper_mcore.commands.jobs:train_rm",
    "eval-rm": "cooper_mcore.commands.evaluate:eval_rm",
    "tiny-assets": "cooper_mcore.commands.demo:tiny_assets",
    "demo": "cooper_mcore.commands.demo:demo",
    "plan": "cooper_mcore.commands.plan:plan",
    "rehearse": "cooper_mcore.commands.rehearse:rehearse",
    "plot": "cooper_mcore.commands.plot:plot",
}

#: Errors that are the user's (or the machine's) to fix: one clear line, no traceback, exit code 2
#: (or the error's ``exit_code``: ``cooper train`` stops with 75 when preempted, 3 on non-finite
#: numbers, 69 when another rank is lost). Under torchrun a refusal (exit 2) that a node's ranks
#: all raise is printed once (:func:`said_on_this_node`). Operating-system errors count when they
#: are about a path or the disk (see :func:`environment_error`); the others (a connection reset,
#: ...) get a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError)
#: The library's own user errors, by "module.Class": importing them would import megatron-core.
USER_ERROR_NAMES = frozenset({"cooper_mcore.job.TrainingStopped",
                              "cooper_mcore.negatives.pairs.AssistantUnavailable",
                              "cooper_mcore.jobs.annotate.JudgeUnavailable",
                              "cooper_mcore.parallel.CollectiveFailed"})
#: Exit code of a user or environment error.
EXIT_USER_ERROR = 2

# what to do about an operating-system error on a path, by errno ({path}: the path(s) it names)
_OS_ERROR_HINTS = {
    errno.EACCES: "permission denied on {path}: use a path this user may write (e.g. another --out) or change its "
                  "permissions",
    errno.EPERM: "operation not permitted on {path}: use a path this user may write (e.g. another --out) or change "
                 "its permissions",
    errno.EROFS: "{path} is on a read-only file system: write somewhere else (e.g. another --out)",
    errno.EISDIR: "{path} is a folder, where a file is expected: give a file's path",
    errno.ENOTDIR: "{path}: a file is in the way, where a folder is expected: give another path",
    errno.ENOSPC: "no space left on the device of {path}: free some space there or write elsewhere "
                  "(e.g. another --out)",
    errno.EDQUOT: "disk quota exceeded writing {path}: free some space there or write elsewhere (e.g. another --out)",
    errno.ENAMETOOLONG: "file name too long: {path}: give a shorter path",
    errno.ENOENT: "{path} does not exist",
    errno.EEXIST: "{path} already exists",
}


def environment_error(e: BaseException, args: Optional[argparse.Namespace] = None) -> Optional[str]:
    """The one-line message for an operating-system error about a path or the disk, else None.

    The path is the error's (both of a rename); an error that names none (a full disk met by a
    ``write``) names the command's ``--out``.
    """
    if not isinstance(e, OSError) or e.errno not in _OS_ERROR_HINTS:
        return None
    if e.filename is not None:
        path = repr(str(e.filename)) + (f" (-> {str(e.filename2)!r})" if e.filename2 is not None else "")
    elif getattr(args, "out", None):
        path = f"--out {args.out!r}"
    else:
        path = "the output"
    code = e.errno
    if code == errno.EEXIST and isinstance(e.filename, str) and os.path.lexists(e.filename) \
            and not os.path.isdir(e.filename):
        code = errno.ENOTDIR  # os.makedirs(path, exist_ok=True) where a file is
    return _OS_ERROR_HINTS[code].format(path=path)


def user_error(e: BaseException, args: Optional[argparse.Namespace] = None) -> Optional[str]:
    """The one-line message of a user or environment error (see :data:`USER_ERRORS`), else None."""
    message = environment_error(e, args)
    if message is not None:
        return message
    if isinstance(e, OSError) and e.errno is not None:  # another errno from the system: not ours to explain
        return None
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}
    if isinstance(e, USER_ERRORS) or names & USER_ERROR_NAMES:
        return str(e.args[0] if e.args and not isinstance(e, UnicodeError) else e)  # (a UnicodeError's is its codec)
    return None


def said_on_this_node(message: str) -> bool:
    """Whether another rank of this node already reported ``message``; if not, this one will (claimed here).

    Under torchrun each rank of a node has an error file in a folder of its agent's own
    (``TORCHELASTIC_ERROR_FILE``: ``<agent's folder>/attempt_<n>/<local rank>/error.json``): the first
    rank to create ``<that attempt's folder>/cooper-error-<hash of the message>`` reports it, the
    others exit with the same code in silence. So a config refusal raised alike on every rank is
    printed once per node, not once per rank; one raised on only some ranks is printed by the first
    of them; messages that differ (each names its rank) are all printed. Outside torchrun, or when
    the folder cannot be written: never said before.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    digest = hashlib.sha256(message.encode("utf-8", "replace")).hexdigest()[:16]
    marker = os.path.join(os.path.dirname(os.path.dirname(error_file)), f"cooper-error-{digest}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return True
    except OSError:  # no such folder, read-only: report it
        return False
    return False


def version() -> str:
    """The installed package's version (``cooper_mcore.__version__`` when it is not installed)."""
    try:
        return importlib.metadata.version("cooper_mcore")
    except importlib.metadata.PackageNotFoundError:
        return getattr(cooper_mcore, "__version__", "unknown")


def handler(command: str) -> Callable[[argparse.Namespace], Optional[int]]:
    """Import and return the function that runs ``command`` (see :data:`HANDLERS`)."""
    module, _, name = HANDLERS[command].partition(":")
    return getattr(importlib.import_module(module), name)


def _float_type(low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False,
                high_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` reading a finite float within the bounds (``low_open``: ``> low``); its
    error (NaN, an infinity or an overflow such as ``1e400``, out of range) names the value, and
    argparse names the flag: ``argument --gpu-memory-gib: must be a finite number > 0, got 'nan'``."""
    bounds = " ".join(filter(None, (f"{'>' if low_open else '>='} {low:g}" if low is not None else "",
                                    "and" if low is not None and high is not None else "",
                                    f"{'<' if high_open else '<='} {high:g}" if high is not None else "")))

    def read(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (low is not None and (value < low or (low_open and value == low))) \
                or (high is not None and (value > high or (high_open and value == high))):
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + bounds if bounds else ''}, got {text!r}")
        return value

    return read


#: argparse types of the commands' float flags (:func:`_float_type`)
non_negative_float = _float_type(0)
positive_float = _float_type(0, low_open=True)
probability_float = _float_type(0, 1, low_open=True, high_open=True)
top_p_float = _float_type(0, 1, low_open=True)
#: the largest seed a flag takes: every random generator takes it (as the config checks' MAX_SEED)
MAX_SEED = 2**31 - 1


def seed_int(text: str) -> int:
    """An argparse ``type`` reading a seed: an integer in ``0..MAX_SEED``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_SEED}, got {text!r}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help followed by its default, unless the default means "not given"."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        default = action.default
        if default is None or default is False or default == "" or default == [] or action.required:
            return action.help
        return super()._get_help_string(action)


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its positional ``key=value`` overrides may come on either side of its
    options (``train --config X a=1 --out D b=2``), as with ``parse_intermixed_args``, which argparse
    refuses on a parser with subcommands; so each subcommand's parser intermixes for itself when the
    top-level parser hands it its arguments."""

    _intermixing = False

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._subparsers is not None or self._intermixing:  # (parse_known_intermixed_args calls back here)
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cooper", description="Cooper RL on Megatron-core: the policy and the reward "
                                "model trained together. Dotted key=value overrides may come anywhere after the "
                                "subcommand.", formatter_class=_HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, and the warnings hidden by default")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_SubcommandParser)

    _add_model_commands(sub)
    _add_trainer_commands(sub)
    _add_job_commands(sub)
    _add_tool_commands(sub)
    return p


def _add_model_commands(sub: Any) -> None:
    """The subcommands ``convert`` and ``verify``."""
    conv = sub.add_parser("convert", help="convert checkpoints between HF and Megatron formats")
    csub = conv.add_subparsers(dest="direction", required=True)
    h2m = csub.add_parser("hf-to-mcore", help="HF safetensors folder -> Megatron dist checkpoint")
    h2m.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    h2m.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    h2m.add_argument("--model-type", choices=["causal_lm", "reward"], default=None,
                     help="default: from the config's architecture")
    h2m.add_argument("--head-std", type=non_negative_float, default=None,
                     help="std of a new reward head (reward from a causal LM); default the config's "
                          "initializer_range; 0: a zero head")
    m2h = csub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors folder")
    m2h.add_argument("--ckpt", required=True, help="checkpoint folder written by hf-to-mcore/training "
                                                   "(<run>/checkpoints/step_N/policy or .../rm)")
    m2h.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="tokenizer to export with the model (an HF model or tokenizer folder, or a checkpoint); "
                          "default the checkpoint's own; needed when it has none (a model.init=random run's)")
    m2h.add_argument("--out", required=True, help="output HF folder (must not exist)")
    m2h.add_argument("--max-shard-gib", type=positive_float, default=5.0, help="safetensors shard size in GiB")

    ver = sub.add_parser("verify", help="check predictions against gold answers with math-verify")
    ver.add_argument("--in", dest="inp", required=True, help="JSONL with 'gold' and 'pred' on each line")
    ver.add_argument("--out", required=True, help="JSONL: each input line plus 'correct' (true/false/null) "
                     "and 'seconds'")
    ver.add_argument("--timeout", type=positive_float, default=5.0, help="hard per-item timeout (s)")
    ver.add_argument("--workers", type=int, default=2, help="verifier processes")
    ver.add_argument("--gold-key", default="gold", help="field of each line holding the gold answer")
    ver.add_argument("--pred-key", default="pred", help="field of each line holding the prediction")


def _add_trainer_commands(sub: Any) -> None:
    """The subcommands ``train``, ``config`` and ``eval``."""
    tr = sub.add_parser("train", help="Cooper RL (reward modes: rule, static_rm, cooper); run under torchrun")
    tr.add_argument("--config", default=None, help="YAML preset: a path, or a shipped preset's name (tiny_cpu, "
                    "qwen2.5-1.5b_8xh100, ...: examples/*.yaml); default: the built-in defaults")
    tr.add_argument("--out", default=None, help="run folder (config.yaml, metrics.jsonl, checkpoints/); "
                                                "default: the preset's `out`")
    tr.add_argument("--resume", default=None, help="'auto' (the newest whole checkpoint in --out), 'none' or a "
                                                   "checkpoint folder; default: the preset's checkpoint.resume")
    tr.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a run, deleting its "
                                                             "metrics and checkpoints (checkpoint.overwrite=true)")
    tr.add_argument("--allow-config-change", action="store_true",
                    help="resume with settings that change what is trained, recorded as a new version of the run's "
                         "config.yaml (checkpoint.allow_config_change=true)")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01 reward.mode=rule "
                                                 "(`cooper config` lists them)")

    co = sub.add_parser("config", help="a job's settings (`cooper train`'s by default) with their values and docs: "
                                       "all of them, or the keys named (cooper config algo.tis_cap rollout)")
    co.add_argument("--show", action="store_true", help="print every key=value with its one-line doc (the default "
                                                        "when no key is named)")
    co.add_argument("--job", choices=["train", "sft", "train-rm"], default="train",
                    help="whose settings: train (Cooper RL), sft or train-rm (VerifyRM)")
    co.add_argument("--config", default=None, help="YAML preset (a path or a shipped preset's name) whose values to "
                                                    "show (default: the defaults)")
    co.add_argument("overrides", nargs="*", help="keys to show (a setting or a section, e.g. algo.tis_cap) and dotted "
                                                 "overrides (key=value, e.g. algo.kl_coef=0.01), in any order")

    ev = sub.add_parser("eval", help="held-out avg@k accuracy of a policy (HF folder or Megatron checkpoint)")
    ev.add_argument("--model", required=True,
                    help="HF folder, converted checkpoint, or <run>/checkpoints/step_N/policy")
    ev.add_argument("--data", required=True, help="JSONL/Parquet with question and answer")
    ev.add_argument("--k", type=int, default=8, help="samples per prompt")
    ev.add_argument("--temperature", type=non_negative_float, default=0.7, help="sampling temperature")
    ev.add_argument("--top-p", type=top_p_float, default=0.95, help="nucleus sampling threshold")
    ev.add_argument("--max-new-tokens", type=int, default=512, help="tokens generated per sample at most")
    ev.add_argument("--template", default="{question}", help="prompt template ({question} is replaced)")
    ev.add_argument("--chat-template", action="store_true", help="use the tokenizer's chat template")
    ev.add_argument("--limit", type=int, default=0, help="use the first N prompts (0: all)")
    ev.add_argument("--seed", type=seed_int, default=0, help="sampling seed")


def _add_job_commands(sub: Any) -> None:
    """The subcommands ``sft``, ``train-rm``, ``eval-rm`` and ``annotate``."""
    sft = sub.add_parser("sft", help="supervised fine-tuning of a policy checkpoint on the arithmetic task's worked "
                                     "solutions; run under torchrun for several GPUs")
    sft.add_argument("--config", default=None, help="YAML preset (a path, or a shipped name: jobs/sft_tiny_cpu); "
                                                    "default: the built-in "
                                                    "defaults")
    sft.add_argument("--ckpt", default=None, help="causal-LM checkpoint to start from (the setting ckpt)")
    sft.add_argument("--out", default=None, help="output checkpoint folder, must not exist (the setting out)")
    sft.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=200 optim.lr=1e-5 "
                                                  "(`cooper config --job sft` lists them)")

    trm = sub.add_parser("train-rm", help="train VerifyRM with BCE on labeled (question, reference, completion)")
    trm.add_argument("--config", default=None, help="YAML preset (a path, or a shipped name: "
                                                    "jobs/verify_rm_tiny_cpu); default: the "
                                                    "built-in defaults")
    trm.add_argument("--ckpt", default=None,
                     help="reward-model checkpoint to start from, hf-to-mcore --model-type reward (the setting ckpt)")
    trm.add_argument("--train", default=None, help="JSONL/Parquet: question, reference, completion, label "
                                                   "(data.train_path)")
    trm.add_argument("--out", default=None, help="output folder (must not exist or be empty): checkpoints, metrics "
                                                 "(the setting out)")
    trm.add_argument("--eval", default=None, help="VerifyBench-format or labeled eval data (data.eval_path)")
    trm.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=1 optim.lr=1e-5 "
                                                  "(`cooper config --job train-rm` lists them)")

    erm = sub.add_parser("eval-rm", help="VerifyRM accuracy (threshold 0.5), per answer type")
    erm.add_argument("--ckpt", required=True, help="reward-model checkpoint (e.g. <train-rm out>/final)")
    erm.add_argument("--data", required=True, help="VerifyBench-format or labeled JSONL")
    erm.add_argument("--format", default="auto", choices=["auto", "labeled", "verifybench"],
                     help="the data's format (auto: from its fields)")
    erm.add_argument("--micro-batch-size", type=int, default=8, help="rows per forward micro-batch")
    erm.add_argument("--threshold", type=probability_float, default=0.5,
                     help="probability above which a row counts as correct")
    erm.add_argument("--predictions", default=None, help="write per-item scores here")
    erm.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    erm.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")

    an = sub.add_parser("annotate", help="hybrid labels: rule verifier and LLM judge, keep agreements")
    an.add_argument("--in", dest="inp", required=True, help="JSONL/Parquet: question, reference, completion")
    an.add_argument("--out", required=True, help="the labeled rows (JSONL, or Parquet by its extension)")
    an.add_argument("--judge-url", required=True, help="OpenAI-compatible endpoint of the judge")
    an.add_argument("--judge-model", required=True, help="the judge's model name at that endpoint")
    an.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    an.add_argument("--judgements", default=None, help="also write every raw judgement here")
    an.add_argument("--judge-retries", type=int, default=3, help="retries per judge request (exponential backoff)")
    an.add_argument("--judge-timeout", type=positive_float, default=60.0, help="seconds per judge request attempt")
    an.add_argument("--on-judge-failure", choices=["mask", "stop"], default="mask",
                    help="a judge request that fails after its retries: drop that row and count it (mask), "
                         "or stop with an error naming the endpoint (stop)")
    an.add_argument("--verifier-timeout", type=positive_float, default=5.0,
                    help="hard per-item timeout of math-verify (s)")
    an.add_argument("--workers", type=int, default=2, help="verifier processes")
    an.add_argument("--skip-malformed", action="store_true", help="skip and count malformed rows instead of failing")


def _add_tool_commands(sub: Any) -> None:
    """The subcommands ``tiny-assets``, ``demo``, ``plan``, ``rehearse`` and ``plot``."""
    ta = sub.add_parser("tiny-assets", help="write tiny CPU assets (prompts, tokenizer, tiny policy and RM)")
    ta.add_argument("--out", default="runs/tiny_assets", help="output folder (existing pieces are reused)")
    ta.add_argument("--family", default="qwen2_tied", help="the policy's family (cooper_mcore/models/tiny.py "
                    "FAMILIES; qwen3_moe: mixture of experts)")
    ta.add_argument("--rm-family", default="qwen2", help="the reward model's family (as --family)")

    demo = sub.add_parser("demo", help="the embedded default job: rule vs static RM vs Cooper on a tiny CPU setup")
    demo.add_argument("--out", default="", help="output folder (default runs/demo, runs/demo_full with --full)")
    demo.add_argument("--full", action="store_true", help="the longer, bigger preset (within an hour on 2 cores)")
    demo.add_argument("--preset", choices=["smoke"], default=None, help="smoke: every stage at the smallest size")
    demo.add_argument("--show", action="store_true", help="print every demo setting with its one-line doc, run nothing")
    demo.add_argument("overrides", nargs="*", help="dotted settings, e.g. rl.steps=60 (cooper_mcore/demo/config.py)")

    pl = sub.add_parser("plan", help="predict per-GPU memory per phase and the offload settings a run needs")
    pl.add_argument("--config", default=None, help="YAML preset: a path or a shipped preset's name (examples/*.yaml)")
    pl.add_argument("--gpus-per-node", type=int, required=True, help="GPUs on each node")
    pl.add_argument("--gpu-memory-gib", type=positive_float, required=True, help="memory of one GPU, e.g. 80")
    pl.add_argument("--nodes", type=int, default=1, help="nodes of the run")
    pl.add_argument("--policy-config", default=None, help="the policy's HF config.json (default: model.policy_hf)")
    pl.add_argument("--rm-config", default=None, help="the reward model's HF config.json (default: model.rm_ckpt)")
    pl.add_argument("--prompt-tokens", type=int, default=512, help="the longest prompt in tokens")
    pl.add_argument("--overhead-gib", type=non_negative_float, default=2.0,
                    help="per-GPU allowance for NCCL buffers, CUDA graphs and fragmentation (CUDA contexts are "
                         "counted separately, per process)")
    pl.add_argument("--no-assistant", action="store_true", help="count no colocated assistant server")
    pl.add_argument("--assistant-config", default=None,
                    help="the colocated assistant's HF config.json (default: the policy's shape)")
    pl.add_argument("--assistant-tp", type=int, default=None, help="GPUs per assistant replica (default: parallel.tp)")
    pl.add_argument("--assistant-mem-fraction", type=probability_float, default=None,
                    help="the assistant's --mem-fraction-static (default: derived from its size, as the launcher)")
    pl.add_argument("--recompute", action="store_true", help="plan with full activation recomputation")
    pl.add_argument("--json", action="store_true", help="print JSON (top-level boolean 'fits')")
    pl.add_argument("--simulate", action="store_true",
                    help="also run one rank of the real layout through a whole Cooper step on fake tensors (no GPU, "
                         "minutes on a CPU) and print each phase's peak by kind beside the plan")
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 train.micro_batch_size=4")

    rh = sub.add_parser("rehearse", help="run a preset's job on CPU with a tiny model of its family: its layout and "
                                         "features, evaluation, checkpoints, a stop signal and a resume, in minutes")
    rh.add_argument("--config", required=True, help="the preset: a path or a shipped preset's name (examples/*.yaml)")
    rh.add_argument("--out", default="", help="rehearsal folder (default runs/rehearse/<preset name>; tiny assets "
                                              "are cached beside it)")
    rh.add_argument("--policy-config", default=None, help="the policy's HF config.json (default: model.policy_hf, "
                                                          "else model_configs/ beside the preset)")
    rh.add_argument("--rm-config", default=None, help="the reward model's HF config.json (default: the policy's "
                                                      "backbone with a scalar head)")
    rh.add_argument("--real-shape", action="store_true",
                    help="one process (a GPU) at the preset's real model shape with random weights: 3 steps that "
                         "measure time and peak memory per phase next to cooper plan's prediction")
    rh.add_argument("--variant", action="append", metavar="KEY=VALUE[,KEY=VALUE]",
                    help="settings that must not change the numbers (e.g. offload.release_engine=false): the "
                         "interrupted and resumed runs are made again with them and must equal the reference bit for "
                         "bit; repeat for several variants")
    # the defaults of cooper_mcore.rehearsal.run.Limits, written out so that --help needs no import (tested equal)
    rh.add_argument("--step-timeout", type=positive_float, default=180.0,
                    help="seconds one step may take before the run counts as hung")
    rh.add_argument("--startup-timeout", type=positive_float, default=600.0,
                    help="seconds from launch to the first step")
    rh.add_argument("overrides", nargs="*", help="dotted overrides applied to the preset, e.g. parallel.tp=2")

    pt = sub.add_parser("plot", help="draw a run's main curves (reward, accuracy, KL, RM accuracy, timing) from its "
                                     "metrics.jsonl to a PNG")
    pt.add_argument("run", help="the run folder (--out of cooper train), or its metrics.jsonl")
    pt.add_argument("--out", default=None, help="the PNG to write (default: metrics.png in the run folder)")
    pt.add_argument("--title", default=None, help="the figure's title (default: the run folder's name)")


def _late_stop_signal(signum: int, frame: Any) -> None:
    """SIGUSR1 outside a training job's stop handler: nothing to stop (see :func:`main`)."""
    logger.debug("SIGUSR1 outside a training job: ignored")


def _quiet_known_warnings() -> None:
    """Hide warnings that megatron-core 0.16 and torch raise on every run and a user cannot act on
    (deprecated collectives inside megatron, its optimizer probing ``.grad`` of non-leaf tensors);
    ``--verbose`` shows them."""
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)")
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    if not args.verbose:
        logging.getLogger("megatron").setLevel(logging.WARNING)
        _quiet_known_warnings()
    install_log_filter()  # no API key from the environment in any log line
    if threading.current_thread() is threading.main_thread():  # signal handlers are set there only
        # `kill -USR2 <pid>` prints every thread's stack: where a hung rank waits (the rehearsal asks for it);
        # to the process's own stderr, which has a file descriptor even where sys.stderr is replaced
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
        # SIGUSR1 (a scheduler's early warning) means "checkpoint and stop" inside a training job only
        # (cooper_mcore.job.StopSignal); outside it, before the job or once it has stopped, it is ignored rather
        # than killing the process: each node's launcher passes it on at its own pace, and a copy that reaches a
        # rank after the world already stopped on another node's copy turned its clean exit 75 into a death by
        # signal. A Python handler, not SIG_IGN: an ignored signal stays ignored in every program this process
        # starts (a launcher script could not trap it), a handler is reset to the default by exec
        signal.signal(signal.SIGUSR1, _late_stop_signal)
    try:
        rc = handler(args.command)(args)
    except Exception as e:
        message = user_error(e, args)
        if message is None:
            logger.exception("unexpected error (a bug, or an environment problem the message names); please report "
                             "it with this traceback")
            return 1
        # train: 75 preempted (SIGTERM/SIGUSR1), 3 non-finite stop, 69 another rank lost (cooper_mcore/exit_codes.py)
        code = getattr(e, "exit_code", EXIT_USER_ERROR)
        # a refusal (exit 2) raised alike on every rank: once per node; a stop or a lost peer: each rank says what
        # it saw
        if code != EXIT_USER_ERROR or not said_on_this_node(message):
            logger.error("%s", message)
        return code
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
