"""Model checkpoints: the format every model of cooper_mcore is saved in and loaded from.

A cooper_mcore model checkpoint is a megatron-core distributed checkpoint (``torch_dist``
format, loadable at any TP/PP) plus ``cooper_model.json`` (:data:`META_FILE`: the architecture, the
original HF config and the dtype), ``hf_extra/`` (:data:`EXTRA_DIR`: tokenizer and generation
files copied from the HF folder, so that an export is a complete HF model folder) and, written last,
``manifest.json`` (every file's size and CRC-32, :mod:`cooper_mcore.checkpoint.manifest`). A training
checkpoint's ``policy/`` and ``rm/`` are model checkpoints whose manifest is their ``step_<n>/``'s.

Folders are written under a temporary name and renamed when complete
(:func:`save_model_checkpoint_atomic`); a write that fails (a full disk is reported as such, naming
the output: :mod:`cooper_mcore.files`) removes the temporary folder.

Every reader of a checkpoint's tensors first calls :func:`open_model_checkpoint`: a folder still
being written is refused, then a damaged ``cooper_model.json``, ``metadata.json`` naming another
backend than ``torch_dist``, an unreadable ``common.pt``, a missing or truncated shard
(:func:`check_checkpoint_files`), then any file that disagrees with the manifest
(:func:`verify_model_checkpoint`) is a one-line ``ValueError`` naming the folder, the file and
what to do.

The conversion from and to Hugging Face folders is :mod:`cooper_mcore.convert.hf`'s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor, load_plain_tensors
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from torch.distributed.checkpoint import FileSystemReader

from cooper_mcore.checkpoint.manifest import MANIFEST, complete_checkpoints, verify_checkpoint, write_manifest
from cooper_mcore.collectives import gather_objects
from cooper_mcore.files import explain_write_errors, read_json_object
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.parallel import ParallelConfig

logger = logging.getLogger(__name__)

#: the checkpoint's metadata: architecture, original HF config, dtype
META_FILE = "cooper_model.json"
#: the HF tokenizer and generation files kept with the checkpoint
EXTRA_DIR = "hf_extra"
#: the trainer's state in a training checkpoint (``step_<n>/trainer.json``): marks a model folder's parent as one
TRAINER_FILE = "trainer.json"
#: the files of an HF folder kept in ``hf_extra/``: tokenizer, generation settings, chat template
EXTRA_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)
FORMAT_VERSION = 1
_TMP_NAME = re.compile(r"\.tmp(-[^/]*)?$")
_STEP_NAME = re.compile(r"^step_(\d+)(\.tmp)?$")
#: the parameter dtypes a model checkpoint may hold, by the name ``cooper_model.json`` gives them
CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as ``cooper_model.json`` and ``config.json`` write it (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def read_meta(ckpt_dir: str) -> tuple[ArchSpec, dict[str, Any], torch.dtype]:
    """Read a checkpoint's architecture, original HF config and dtype.

    Raises:
        FileNotFoundError: no ``cooper_model.json``.
        ValueError: ``cooper_model.json`` is not valid JSON (file, line and column named) or lacks
            or garbles a field.
    """
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{ckpt_dir!r} is not a cooper_mcore model checkpoint (no {META_FILE})"
        )
    meta = read_json_object(path)
    hint = "; the checkpoint's metadata is damaged: restore it or convert the model again"
    missing = [k for k in ("arch", "hf_config", "dtype") if k not in meta]
    if missing:
        raise ValueError(f"{path} has no {', '.join(repr(k) for k in missing)}{hint}")
    if meta["dtype"] not in CHECKPOINT_DTYPES:
        raise ValueError(f"{path}: unknown dtype {meta['dtype']!r} (expected one of {sorted(CHECKPOINT_DTYPES)}){hint}")
    if not isinstance(meta["hf_config"], dict):
        raise ValueError(f"{path}: 'hf_config' must be a JSON object{hint}")
    try:
        arch = ArchSpec.from_dict(meta["arch"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: its 'arch' is not a valid architecture ({type(e).__name__}: {e}){hint}") from None
    return arch, meta["hf_config"], CHECKPOINT_DTYPES[meta["dtype"]]


def write_meta(ckpt_dir: str, arch: ArchSpec, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
    """Write a checkpoint's ``cooper_model.json``: architecture, original HF config and dtype."""
    meta = {"format_version": FORMAT_VERSION, "arch": arch.to_dict(), "hf_config": hf_config,
            "dtype": dtype_name(dtype)}
    with open(os.path.join(ckpt_dir, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def is_model_checkpoint(path: str) -> bool:
    """Whether ``path`` is a folder holding a model checkpoint's ``cooper_model.json``."""
    return os.path.isfile(os.path.join(path, META_FILE))


def checkpoint_arch(ckpt_dir: str) -> Optional[ArchSpec]:
    """The architecture of the model checkpoint in ``ckpt_dir``; None when the folder holds none.

    Args:
        ckpt_dir: a folder, or "" (no checkpoint).

    Raises:
        ValueError: its ``cooper_model.json`` is damaged (see :func:`read_meta`).
    """
    if not ckpt_dir or not is_model_checkpoint(ckpt_dir):
        return None
    return read_meta(ckpt_dir)[0]


def checkpoint_arch_fields(ckpt_dir: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The raw architecture fields and dtype name in a checkpoint's ``cooper_model.json``.

    Read leniently, for the config checks: a partial ``arch`` is returned as it is, and a missing,
    unreadable or damaged file gives ``(None, None)`` (the checks of paths and JSON report why).

    Returns:
        ``(arch fields, dtype name)``.
    """
    try:
        with open(os.path.join(ckpt_dir, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
        return dict(meta["arch"]), meta.get("dtype")
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def save_model_checkpoint(
    model: torch.nn.Module, ckpt_dir: str, arch: ArchSpec, hf_config: dict[str, Any],
    dtype: torch.dtype, consume: bool = False, extra_from: Optional[str] = None,
) -> None:
    """Save a (possibly TP/PP-sharded) model as a distributed checkpoint into an empty folder, with
    its ``cooper_model.json``, its ``hf_extra/`` and, last, its ``manifest.json`` (every file's
    size and CRC-32, checked by every reader: :func:`open_model_checkpoint`).

    Collective: every rank of the model's groups calls it.

    Args:
        consume: the model is not needed afterwards. megatron-core's writer clones every CPU
            tensor that is a view (the gate and up halves of ``linear_fc1``); with ``consume``
            no second copy is made (see :func:`_detach_views`).
        extra_from: a model checkpoint or HF folder whose tokenizer and generation files
            (:func:`copy_extra_files`) go into ``hf_extra/``; None: no ``hf_extra/``.
    """
    sharded = model.sharded_state_dict()
    if consume:
        apply_factories(sharded)
        _detach_views(sharded, model)
    dist_checkpointing.save(sharded, ckpt_dir)
    torch.distributed.barrier()  # every rank's shards are on disk before rank 0 checksums them
    if torch.distributed.get_rank() == 0:
        write_meta(ckpt_dir, arch, hf_config, dtype)
        copy_extra_files(extra_from, os.path.join(ckpt_dir, EXTRA_DIR))
        write_manifest(ckpt_dir)


def copy_extra_files(source: Optional[str], dest: str) -> None:
    """Copy a model checkpoint's ``hf_extra/`` (all of it), else an HF folder's :data:`EXTRA_FILES`,
    into the folder ``dest`` (made only when there is something to copy; ``source`` None: nothing)."""
    if source is None:
        return
    if os.path.isdir(os.path.join(source, EXTRA_DIR)):
        shutil.copytree(os.path.join(source, EXTRA_DIR), dest, dirs_exist_ok=True)
        return
    names = [n for n in EXTRA_FILES if os.path.isfile(os.path.join(source, n))]
    if names:
        os.makedirs(dest, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(source, name), os.path.join(dest, name))


def save_model_checkpoint_atomic(model: torch.nn.Module, dest: str, arch: ArchSpec, hf_config: dict[str, Any],
                                 dtype: torch.dtype, extra_from: str | None = None) -> None:
    """Save under ``dest + ".tmp"`` (with ``extra_from``'s tokenizer files), then rename to ``dest``,
    so a folder named ``dest`` is always complete. Collective."""
    tmp = dest + ".tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    try:
        with explain_write_errors(dest, "model checkpoint"):
            save_model_checkpoint(model, tmp, arch, hf_config, dtype, extra_from=extra_from)
            torch.distributed.barrier()
            if rank0:
                os.replace(tmp, dest)
    except BaseException:
        if rank0:  # nothing half-written is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    torch.distributed.barrier()


def save_new_model_checkpoint(model: torch.nn.Module, dest: str, arch: ArchSpec, hf_config: dict[str, Any],
                              dtype: torch.dtype, extra_from: Optional[str] = None) -> None:
    """:func:`save_model_checkpoint_atomic` into a folder that must not exist yet; logs it. Collective.

    Raises:
        FileExistsError: ``dest`` exists (checked on every rank before anything is written).
    """
    if os.path.exists(dest):
        raise FileExistsError(f"checkpoint {dest!r} already exists")
    save_model_checkpoint_atomic(model, dest, arch, hf_config, dtype, extra_from=extra_from)
    if torch.distributed.get_rank() == 0:
        logger.info("saved %s", dest)


def _detach_views(sharded: dict, model: torch.nn.Module) -> None:
    """Make every ShardedTensor own its data without a second copy of the model.

    megatron-core's swiglu factory saves ``linear_fc1`` as two views (gate and up halves),
    which its writer would clone. When the two halves of one parameter are all of it (TP=1),
    they are merged back into one ShardedTensor over the whole parameter: same key and global
    shape, so any TP layout still loads it through the factory. Any other view is cloned, one
    parameter at a time, and that parameter freed.
    """
    owners = {p.untyped_storage().data_ptr(): p for p in model.parameters()}

    def owner(sh) -> torch.nn.Parameter | None:
        if isinstance(sh, ShardedTensor) and sh.data is not None:
            return owners.get(sh.data.untyped_storage().data_ptr())
        return None

    for key, container, shards in _sharded_lists(sharded):  # 1. merge whole-parameter halves
        if len(shards) != 2 or owner(shards[0]) is None or owner(shards[0]) is not owner(shards[1]):
            continue
        w, v = shards
        param, axis = owner(w), w.prepend_axis_num
        if (w.key == v.key and axis <= 1 and w.axis_fragmentations[axis] == 2
                and param.numel() == 2 * w.data.numel() and v.global_offset[axis] == w.data.shape[0]):
            offsets = [(0, w.global_offset[0], w.axis_fragmentations[0])] if axis else []
            container[key] = ShardedTensor.from_rank_offsets(
                w.key, param.data, *offsets, replica_id=w.replica_id, prepend_axis_num=axis)

    views: dict[int, list] = {}  # 2. clone what is still a view, freeing its parameter
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor) and sh.data is not None and sh.data.device.type == "cpu":
            t = sh.data
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                views.setdefault(t.untyped_storage().data_ptr(), []).append(sh)
    for ptr, shards in views.items():
        for sh in shards:
            sh.data = sh.data.clone()
        if ptr in owners:
            owners[ptr].data = torch.empty(0, dtype=owners[ptr].dtype)


def _sharded_lists(d: dict):
    """(key, parent dict, value) for every list value in a nested dict."""
    for k, v in list(d.items()):
        if isinstance(v, dict):
            yield from _sharded_lists(v)
        elif isinstance(v, list):
            yield k, d, v


def load_model_checkpoint(model: torch.nn.Module, ckpt_dir: str, arch: ArchSpec | None = None) -> None:
    """Load a model checkpoint into a built model at any TP/PP layout, after checking it
    (:func:`open_model_checkpoint`). Collective over the world.

    Args:
        model: this rank's model (unwrapped GPTModel or RewardGPTModel).
        ckpt_dir: a folder written by :func:`save_model_checkpoint` or ``hf-to-mcore``.
        arch: the architecture the model was built with; checked against the checkpoint's.

    Raises:
        ValueError: the checkpoint is unfinished or damaged, or its architecture or a tensor's global
            shape differs.
    """
    ckpt_arch, _, _ = open_model_checkpoint(ckpt_dir)
    if arch is not None and arch != ckpt_arch:
        diffs = {k: (v, getattr(ckpt_arch, k)) for k, v in arch.to_dict().items()
                 if ckpt_arch.to_dict()[k] != v}
        raise ValueError(f"checkpoint {ckpt_dir!r} does not match the model: "
                         + ", ".join(f"{k}: model {a} vs checkpoint {b}" for k, (a, b) in diffs.items()))
    _load_checked(model, ckpt_dir)


def _load_checked(model: torch.nn.Module, ckpt_dir: str) -> None:
    """Load a checked checkpoint of the model's architecture: every tensor's shape first."""
    sharded = model.sharded_state_dict()
    saved = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    for key, sh in _sharded_tensors(sharded):
        if key not in saved:
            raise ValueError(f"tensor {key!r} is missing from checkpoint {ckpt_dir!r}")
        if tuple(saved[key].global_shape) != tuple(sh.global_shape):
            raise ValueError(
                f"tensor {key!r}: checkpoint shape {tuple(saved[key].global_shape)} does not "
                f"match the model's {tuple(sh.global_shape)} ({ckpt_dir})"
            )
    with torch.no_grad():
        state = dist_checkpointing.load(drop_absent_extra_state(sharded, ckpt_dir), ckpt_dir)
        missing, _ = model.load_state_dict(state, strict=False)  # strict trips on _extra_state
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing, f"parameters not loaded from {ckpt_dir}: {missing}"


def load_checkpoint_model(ckpt: str, parallel: ParallelConfig,
                          pg_collection: Any = None) -> tuple[torch.nn.Module, ArchSpec]:
    """Check a checkpoint (:func:`open_model_checkpoint`), build this rank's part of its model and
    load it. Collective over the world.

    Args:
        ckpt: a model checkpoint folder.
        parallel: the TP/PP layout to build the model at.
        pg_collection: the process groups to build it with (default megatron-core's).

    Returns:
        ``(model, arch)``.
    """
    arch, _, dtype = open_model_checkpoint(ckpt)
    model = build_model(arch, parallel, dtype=dtype, init_weights=False, pg_collection=pg_collection)
    _load_checked(model, ckpt)
    return model, arch


def load_checkpoint_tensors(ckpt: str) -> dict[str, Any]:
    """Every tensor and object a checked checkpoint stores (:func:`open_model_checkpoint`), by key,
    unsharded (megatron-core's ``load_plain_tensors``: optimizer state included). Needs a world."""
    open_model_checkpoint(ckpt)
    return load_plain_tensors(ckpt)


def open_model_checkpoint(ckpt_dir: str) -> tuple[ArchSpec, dict[str, Any], torch.dtype]:
    """A model checkpoint's ``(arch, hf_config, dtype)`` once it is known whole: every reader of a
    checkpoint's tensors (the loaders here, the HF export) calls this first.

    In order: an unfinished folder is refused (:func:`verify_model_checkpoint`), ``cooper_model.json``
    read (:func:`read_meta`), the dist checkpoint's files checked (:func:`check_checkpoint_files`),
    then every file against its manifest (:func:`verify_model_checkpoint`). Collective over the
    world when torch.distributed is initialised (the ranks share the checksumming).

    Raises:
        ValueError: one line naming the checkpoint, the file and what to do.
        FileNotFoundError: no ``cooper_model.json``.
    """
    refuse_unfinished(ckpt_dir)
    meta = read_meta(ckpt_dir)
    check_checkpoint_files(ckpt_dir)
    verify_model_checkpoint(ckpt_dir)
    return meta


def _training_step(folder: str) -> Optional[re.Match]:
    """The ``step_<n>`` (or ``step_<n>.tmp``) name of the training checkpoint holding ``folder``."""
    return _STEP_NAME.match(os.path.basename(os.path.dirname(folder)))


def _what_to_do(ckpt_dir: str) -> str:
    """Advice for an unusable checkpoint: another step's complete one, or writing it again."""
    folder = os.path.realpath(ckpt_dir)
    step = _training_step(folder)
    if step is None:
        return "write it again (`cooper convert hf-to-mcore`, or the job that wrote it) or restore it from a copy"
    room, name = os.path.dirname(os.path.dirname(folder)), os.path.basename(folder)
    others = [s for s in complete_checkpoints(room) if not (s == int(step.group(1)) and not step.group(2))]
    if not others:
        return f"no other complete checkpoint is in {room}: use another checkpoint or run the steps again"
    return ("use the previous step's checkpoint, e.g. the newest other complete one: "
            f"{os.path.join(room, f'step_{others[-1]}', name)}")


def refuse_unfinished(ckpt_dir: str) -> None:
    """Refuse a folder that was still being written (its writer died or is running): one under a
    temporary name (``<dest>.tmp``, ``<out>.tmp-*``) or in a training checkpoint's ``step_<n>.tmp``,
    whether or not its writer got as far as its ``cooper_model.json``.

    Raises:
        ValueError: one line naming the folder and what to do.
    """
    folder = os.path.realpath(ckpt_dir)
    step = _training_step(folder)
    if step is not None and step.group(2):
        where = f"its training checkpoint {os.path.dirname(folder)} was never completed (no manifest, not renamed)"
    elif _TMP_NAME.search(os.path.basename(folder)):
        where = "it is a temporary folder its writer never renamed into place"
    else:
        return
    raise ValueError(f"checkpoint {ckpt_dir!r} is unfinished: {where}; {_what_to_do(ckpt_dir)}")


def verify_model_checkpoint(ckpt_dir: str) -> None:
    """Check a model checkpoint against its manifest: its own ``manifest.json``, or the one of the
    training checkpoint holding it (a ``step_<n>`` folder, or one with a ``trainer.json``; its files
    only). A folder with neither (written before model checkpoints carried one) is read with a
    warning. Collective over the world when torch.distributed is initialised: each rank checksums a
    share of the pieces.

    Raises:
        ValueError: unfinished, no manifest in its training checkpoint, or a file missing, of
            another size or CRC-32 (one line: the checkpoint, the file, what to do).
    """
    refuse_unfinished(ckpt_dir)
    folder = os.path.realpath(ckpt_dir)
    parent = os.path.dirname(folder)
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        manifest_dir, under = folder, ""
    elif _training_step(folder) or os.path.isfile(os.path.join(parent, TRAINER_FILE)):  # a training checkpoint's
        manifest_dir, under = parent, os.path.basename(folder)
    else:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.warning("checkpoint %s has no %s (written before model checkpoints carried one): its files are "
                           "not checked against checksums", ckpt_dir, MANIFEST)
        return
    world = torch.distributed.is_initialized()
    problem = verify_checkpoint(manifest_dir, under, rank=torch.distributed.get_rank() if world else 0,
                                world=torch.distributed.get_world_size() if world else 1,
                                gather=gather_objects if world else None)
    if problem is not None:
        raise ValueError(f"checkpoint {ckpt_dir!r} is damaged: {problem} ({os.path.join(manifest_dir, MANIFEST)}); "
                         f"{_what_to_do(ckpt_dir)}")


def drop_absent_extra_state(sharded: dict, ckpt_dir: str) -> dict:
    """``sharded`` without the ``_extra_state`` objects that ``ckpt_dir`` does not hold.

    Transformer Engine's modules (its norms among them) carry ``_extra_state`` (FP8 metadata) that
    the torch-native spec's modules do not, so a checkpoint converted or trained with one spec
    lacks objects the other asks for; megatron-core would refuse the load ("Missing key in
    checkpoint state_dict"). The modules keep their freshly built extra state. Unexpected extra
    state in the checkpoint is ignored by megatron-core already. Anything else that is missing
    still fails (:func:`load_model_checkpoint` checks every tensor first).
    """
    saved = set(load_sharded_metadata(ckpt_dir))

    def keep(v: Any) -> bool:
        return not (isinstance(v, ShardedObject) and v.key.endswith("_extra_state")
                    and v.unique_key not in saved and v.key not in saved)

    def walk(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: walk(v) for k, v in d.items() if keep(v)}
        if isinstance(d, list):
            return [walk(v) for v in d if keep(v)]
        return d

    return walk(sharded)


def check_checkpoint_format(ckpt_dir: str) -> None:
    """Refuse a folder that megatron-core would fail on with a raw traceback: no or a damaged
    ``metadata.json``, a backend other than ``torch_dist``, a missing or unreadable ``common.pt``.

    Raises:
        ValueError: naming the folder and what is wrong.
    """
    path = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {ckpt_dir!r} is not a megatron-core distributed checkpoint (no metadata.json); "
                         "convert an HF model with `cooper convert hf-to-mcore`")
    meta = read_json_object(path)
    backend = meta.get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(f"checkpoint {ckpt_dir!r} is not a torch_dist checkpoint: metadata.json says backend "
                         f"{backend!r}; cooper_mcore reads torch_dist checkpoints only (convert the model again "
                         "with `cooper convert hf-to-mcore`)")
    common = os.path.join(ckpt_dir, "common.pt")
    if not os.path.isfile(common):
        raise ValueError(f"checkpoint {ckpt_dir!r} is incomplete: common.pt is missing")
    try:
        torch.load(common, map_location="cpu", weights_only=True)  # what megatron-core does, as a check
    except Exception as e:  # garbage gives UnpicklingError, RuntimeError (zip), EOFError, ...
        # torch's weights-only error starts with advice to load unsafely: keep only its reason
        reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
        first = reason.group(1).strip() if reason else (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"checkpoint {ckpt_dir!r}: common.pt is unreadable ({type(e).__name__}: {first}); the "
                         "checkpoint is damaged: use another one or write it again") from None


def check_checkpoint_files(ckpt_dir: str) -> None:
    """Refuse a damaged, truncated or incomplete dist checkpoint before megatron-core reads it.

    The folder's format is checked first (:func:`check_checkpoint_format`). Every stored item's
    byte range (from the checkpoint's ``.metadata``) must lie inside its ``.distcp`` file;
    megatron-core itself fails on a short file with a bare ``EOFError`` deep in unpickling.

    Raises:
        ValueError: another backend, an unreadable ``common.pt``, a shard file missing, or shorter
            than the bytes recorded for it (the message names the file, its expected and actual
            size, and the first tensor cut off).
    """
    check_checkpoint_format(ckpt_dir)
    try:
        storage = FileSystemReader(ckpt_dir).read_metadata().storage_data
    except FileNotFoundError:
        raise ValueError(f"{ckpt_dir!r} has no dist-checkpoint metadata (.metadata); it is incomplete") from None
    need: dict[str, tuple[int, str]] = {}
    for index, info in storage.items():
        end = info.offset + info.length
        if end > need.get(info.relative_path, (0, ""))[0]:
            need[info.relative_path] = (end, index.fqn)
    for name, (end, fqn) in sorted(need.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint shard {path!r} is missing (it holds tensor {fqn!r})")
        size = os.path.getsize(path)
        if size < end:
            cut = min((s.offset, i.fqn) for i, s in storage.items()
                      if s.relative_path == name and s.offset + s.length > size)[1]
            raise ValueError(f"checkpoint shard {path!r} is truncated: expected at least {end} bytes, found {size} "
                             f"(tensor {cut!r} is cut off)")


def _sharded_tensors(sharded: dict) -> list:
    """``(key, ShardedTensor)`` of every tensor a sharded state dict holds, factories built."""
    out = []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor):
            out.append((v.key, v))
        elif hasattr(v, "build"):  # ShardedTensorFactory (e.g. swiglu fc1): check its parts
            built = v.build()
            out.extend((t.key, t) for t in nested_values(built) if isinstance(t, ShardedTensor))
    return out
