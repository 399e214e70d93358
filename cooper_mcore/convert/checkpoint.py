"""Hugging Face <-> megatron-core checkpoint conversion, and loading checkpoints into models.

A cooper_mcore model checkpoint is a megatron-core distributed checkpoint (``torch_dist``
format, loadable at any TP/PP) plus ``cooper_model.json`` (the architecture, the original HF
config and the dtype) and ``hf_extra/`` (tokenizer and generation files copied from the HF
folder, so that an export is a complete HF model folder).

``hf-to-mcore`` builds the model once at TP=PP=1 without random init, fills it one HF tensor
at a time and saves it without extra copies; ``mcore-to-hf`` builds no model and reads the
checkpoint one layer at a time. Neither needs the model in memory twice. Folders are written under a temporary
name and renamed when complete; a write that fails (a full disk is reported as such, naming the
output: :mod:`cooper_mcore.files`) removes the temporary folder.

A checkpoint is checked before megatron-core reads it (:func:`check_checkpoint_files`): a damaged
``cooper_model.json``, ``metadata.json`` naming another backend than ``torch_dist``, an
unreadable ``common.pt``, or a missing or truncated shard is a ``ValueError`` naming the folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from torch.distributed.checkpoint import FileSystemReader

from cooper_mcore.convert.safetensors_io import HFCheckpointReader, write_tensors
from cooper_mcore.files import explain_write_errors, read_json_object
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.hf_mapping import (
    _LAYER_RE,
    _LOCAL_TO_TE,
    ParamMapping,
    canonical_mcore_name,
    hf_shapes,
    param_mappings,
    to_hf,
    to_mcore,
)
from cooper_mcore.parallel import ParallelConfig, single_process_world

logger = logging.getLogger(__name__)

META_FILE = "cooper_model.json"
EXTRA_DIR = "hf_extra"
FORMAT_VERSION = 1
_EXTRA_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
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
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{path}: unknown dtype {meta['dtype']!r} (expected one of {sorted(_DTYPES)}){hint}")
    if not isinstance(meta["hf_config"], dict):
        raise ValueError(f"{path}: 'hf_config' must be a JSON object{hint}")
    try:
        arch = ArchSpec.from_dict(meta["arch"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: its 'arch' is not a valid architecture ({type(e).__name__}: {e}){hint}") from None
    return arch, meta["hf_config"], _DTYPES[meta["dtype"]]


def write_meta(ckpt_dir: str, arch: ArchSpec, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
    """Write a checkpoint's ``cooper_model.json``: architecture, original HF config and dtype."""
    meta = {"format_version": FORMAT_VERSION, "arch": arch.to_dict(), "hf_config": hf_config,
            "dtype": dtype_name(dtype)}
    with open(os.path.join(ckpt_dir, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def _hf_dtype(reader: HFCheckpointReader, cfg: dict[str, Any]) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name in _DTYPES:
        return _DTYPES[name]
    return reader.get("model.embed_tokens.weight").dtype


def check_hf_shapes(reader: HFCheckpointReader, arch: ArchSpec, hf_dir: str) -> None:
    """Raise ValueError naming the first tensor whose shape disagrees with config.json."""
    for name, expected in hf_shapes(arch).items():
        if name == "score.weight" and name not in reader.weight_map:
            continue  # a reward head initialised from a causal LM
        if name not in reader.weight_map:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {hf_dir!r}")
        got = reader.shape(name)
        if got != expected:
            raise ValueError(
                f"tensor {name!r}: checkpoint shape {got} does not match the shape {expected} "
                f"implied by {hf_dir}/config.json"
            )


def load_hf_weights(model: torch.nn.Module, hf_dir: str, arch: ArchSpec, seed: int = 0,
                    head_std: float | None = None) -> None:
    """Copy an HF checkpoint into a TP=PP=1 Megatron model, one tensor at a time.

    A missing ``score.weight`` (reward model made from a causal LM) is initialised with
    N(0, ``head_std``); ``head_std=None`` takes the config's ``initializer_range``, as transformers
    does, and 0 gives a zero head (first scores 0; the backbone gets no gradient until the head moves).
    """
    cfg = load_hf_config(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    check_hf_shapes(reader, arch, hf_dir)
    params = {canonical_mcore_name(k): v for k, v in model.state_dict().items()
              if not k.endswith("_extra_state")}
    mapped = set()
    with torch.no_grad():
        for m in param_mappings(arch):
            if m.hf == ("score.weight",) and "score.weight" not in reader.weight_map:
                gen = torch.Generator().manual_seed(seed)
                std = cfg.get("initializer_range", 0.02) if head_std is None else head_std
                value = torch.randn(params[m.mcore].shape, generator=gen) * std
                logger.warning("no score.weight in %s: reward head initialised N(0, %g)", hf_dir, std)
                params[m.mcore].copy_(value)
            else:
                _read_mapped(reader, m, params[m.mcore], arch)
            mapped.add(m.mcore)
    missing = set(params) - mapped
    assert not missing, f"model parameters without a mapping: {sorted(missing)}"


def _read_mapped(reader: HFCheckpointReader, m: ParamMapping, dest: torch.Tensor, arch: ArchSpec) -> None:
    """Fill one Megatron parameter from its HF tensors, reading straight into it when the
    layout allows (copies, and the gate/up halves of ``linear_fc1``)."""
    # file reads land in host memory: a model built on a GPU is filled through a CPU copy
    direct = dest.device.type == "cpu" and dest.is_contiguous() and all(reader.dtype(n) == dest.dtype for n in m.hf)
    if direct and m.kind == "copy":
        reader.read_into(m.hf[0], dest)
    elif direct and m.kind == "gate_up":
        gate, up = dest.chunk(2, dim=0)
        reader.read_into(m.hf[0], gate)
        reader.read_into(m.hf[1], up)
    else:  # interleaved QKV, or a dtype change (e.g. bf16 norms into fp32 parameters)
        dest.copy_(to_mcore(m, [reader.get(n) for n in m.hf], arch))


def _copy_extra_files(src_dir: str, dst_dir: str) -> None:
    os.makedirs(dst_dir, exist_ok=True)
    for name in _EXTRA_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def _atomic_dir(out: str) -> str:
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(out):
        raise FileExistsError(f"output {out!r} already exists; remove it or choose another path")
    return tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=parent)


def save_model_checkpoint(
    model: torch.nn.Module, ckpt_dir: str, arch: ArchSpec, hf_config: dict[str, Any],
    dtype: torch.dtype, consume: bool = False,
) -> None:
    """Save a (possibly TP/PP-sharded) model as a distributed checkpoint into an empty folder.

    Collective: every rank of the model's groups calls it.

    Args:
        consume: the model is not needed afterwards. megatron-core's writer clones every CPU
            tensor that is a view (the gate and up halves of ``linear_fc1``); with ``consume``
            no second copy is made (see :func:`_detach_views`).
    """
    sharded = model.sharded_state_dict()
    if consume:
        apply_factories(sharded)
        _detach_views(sharded, model)
    dist_checkpointing.save(sharded, ckpt_dir)
    if torch.distributed.get_rank() == 0:
        write_meta(ckpt_dir, arch, hf_config, dtype)


def save_model_checkpoint_atomic(model: torch.nn.Module, dest: str, arch: ArchSpec, hf_config: dict[str, Any],
                                 dtype: torch.dtype, extra_from: str | None = None) -> None:
    """Save under ``dest + ".tmp"`` (with ``extra_from/hf_extra`` copied in), then rename to
    ``dest``, so a folder named ``dest`` is always complete. Collective."""
    tmp = dest + ".tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    try:
        with explain_write_errors(dest, "model checkpoint"):
            save_model_checkpoint(model, tmp, arch, hf_config, dtype)
            torch.distributed.barrier()
            if rank0:
                extra = os.path.join(extra_from, EXTRA_DIR) if extra_from else ""
                if extra and os.path.isdir(extra):
                    shutil.copytree(extra, os.path.join(tmp, EXTRA_DIR))
                os.replace(tmp, dest)
    except BaseException:
        if rank0:  # nothing half-written is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    torch.distributed.barrier()


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
    """Load a model checkpoint into a built model at any TP/PP layout.

    Args:
        model: this rank's model (unwrapped GPTModel or RewardGPTModel).
        ckpt_dir: a folder written by :func:`save_model_checkpoint` or ``hf-to-mcore``.
        arch: the architecture the model was built with; checked against the checkpoint's.

    Raises:
        ValueError: the checkpoint's architecture or a tensor's global shape differs.
    """
    ckpt_arch, _, _ = read_meta(ckpt_dir)
    if arch is not None and arch != ckpt_arch:
        diffs = {k: (v, getattr(ckpt_arch, k)) for k, v in arch.to_dict().items()
                 if ckpt_arch.to_dict()[k] != v}
        raise ValueError(f"checkpoint {ckpt_dir!r} does not match the model: "
                         + ", ".join(f"{k}: model {a} vs checkpoint {b}" for k, (a, b) in diffs.items()))
    sharded = model.sharded_state_dict()
    check_checkpoint_files(ckpt_dir)
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

    out = []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor):
            out.append((v.key, v))
        elif hasattr(v, "build"):  # ShardedTensorFactory (e.g. swiglu fc1): check its parts
            built = v.build()
            out.extend((t.key, t) for t in nested_values(built) if isinstance(t, ShardedTensor))
    return out


def hf_to_mcore(hf_dir: str, out: str, model_type: str | None = None, head_std: float | None = None) -> ArchSpec:
    """Convert an HF safetensors folder into a cooper_mcore model checkpoint.

    Args:
        hf_dir: HF model folder (config.json + safetensors).
        out: output folder; must not exist.
        model_type: "causal_lm" or "reward"; default: from the config's architecture.
        head_std: the std of a new reward head (``model_type="reward"`` from a causal LM, which has
            no ``score.weight``); default the config's ``initializer_range``; 0 for a zero head.

    Raises:
        ValueError: a negative ``head_std``.
    """
    if head_std is not None and head_std < 0:
        raise ValueError(f"head_std must be >= 0, got {head_std}")
    cfg = load_hf_config(hf_dir)
    try:
        arch = ArchSpec.from_hf_config(cfg, model_type)
    except ValueError as e:
        raise ValueError(f"{os.path.join(hf_dir, 'config.json')}: {e}") from None
    reader = HFCheckpointReader(hf_dir)
    dtype = _hf_dtype(reader, cfg)
    check_hf_shapes(reader, arch, hf_dir)
    tmp = _atomic_dir(out)
    try:
        with single_process_world():
            model = build_model(arch, ParallelConfig(), dtype=dtype, init_weights=False, use_te=False)
            load_hf_weights(model, hf_dir, arch, head_std=head_std)
            del reader
            with explain_write_errors(out, "converted checkpoint"):
                save_model_checkpoint(model, tmp, arch, cfg, dtype, consume=True)
            del model
        with explain_write_errors(out, "converted checkpoint"):
            _copy_extra_files(hf_dir, os.path.join(tmp, EXTRA_DIR))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s (%s %s, %s)", out, arch.family, arch.model_type, dtype_name(dtype))
    return arch


def hf_config_for(arch: ArchSpec, base_config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of an export: the original config with the architecture's fields."""
    cfg = dict(base_config)
    cfg["architectures"] = [arch.hf_architecture()]
    cfg["model_type"] = arch.family
    cfg["dtype"] = dtype_name(dtype)
    cfg.pop("torch_dtype", None)
    cfg["tie_word_embeddings"] = arch.tie_word_embeddings
    if arch.model_type == "reward":
        cfg["num_labels"] = 1
        cfg["id2label"] = {"0": "LABEL_0"}
        cfg["label2id"] = {"LABEL_0": 0}
        if arch.pad_token_id is None and cfg.get("pad_token_id") is None:
            cfg["pad_token_id"] = cfg.get("eos_token_id") if isinstance(cfg.get("eos_token_id"), int) else 0
    return cfg


def hf_tensors(model: torch.nn.Module, arch: ArchSpec, layer_offset: int = 0):
    """Yield ``(hf_name, tensor)`` for every parameter of a TP=1 model (or PP stage).

    Args:
        model: a model (or pipeline stage) holding full, unsharded tensors.
        arch: its architecture.
        layer_offset: global number of this stage's first layer.
    """
    params = {canonical_mcore_name(k, layer_offset): v for k, v in model.state_dict().items()
              if not k.endswith("_extra_state")}
    for m in param_mappings(arch):
        if m.mcore not in params:
            continue  # another pipeline stage holds it
        yield from zip(m.hf, to_hf(m, params[m.mcore], arch))


def _ckpt_key(mcore_name: str) -> tuple[str, int | None]:
    """Distributed-checkpoint key and layer index of a mapping name.

    megatron-core stacks the layers of a block under one key with a leading layer axis, and
    stores the local spec's norm weights under Transformer Engine's names.
    """
    match = _LAYER_RE.match(mcore_name)
    if not match:
        return mcore_name, None
    rest = _LOCAL_TO_TE.get(match.group(2), match.group(2))
    return f"decoder.layers.{rest}", int(match.group(1))


def _export_order(arch: ArchSpec) -> list[tuple[ParamMapping, str, int | None]]:
    """Mappings grouped by checkpoint key (first-seen order), then by layer."""
    keyed = [(m, *_ckpt_key(m.mcore)) for m in param_mappings(arch)]
    first = {}
    for i, (_, key, _) in enumerate(keyed):
        first.setdefault(key, i)
    return sorted(keyed, key=lambda x: (first[x[1]], -1 if x[2] is None else x[2]))


def stream_checkpoint_tensors(ckpt: str, arch: ArchSpec):
    """Yield ``(hf_name, tensor)`` from a model checkpoint, reading one stored tensor at a time.

    No model is built. megatron-core stacks all layers of a parameter under one key, so the
    largest read is one parameter of all layers (e.g. ``linear_fc1``), never the whole model.
    The order is :func:`_export_order`'s. Needs torch.distributed initialised (one process).
    """
    check_checkpoint_files(ckpt)
    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    current_key, value = None, None
    for m, key, layer in _export_order(arch):
        if key != current_key:
            if key not in meta:
                raise ValueError(f"tensor {key!r} is missing from checkpoint {ckpt!r}")
            shape = tuple(meta[key].global_shape)
            if layer is not None and shape[0] != arch.num_layers:
                raise ValueError(f"tensor {key!r}: checkpoint has {shape[0]} layers, "
                                 f"the architecture {arch.num_layers}")
            value = None  # free the previous key first
            request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=meta[key].dtype))}
            value = dist_checkpointing.load(request, ckpt)[key]
            current_key = key
        yield from zip(m.hf, to_hf(m, value if layer is None else value[layer], arch))


def mcore_to_hf(ckpt: str, out: str, max_shard_bytes: int = 5 * 2**30) -> ArchSpec:
    """Export a cooper_mcore model checkpoint as an HF folder (safetensors + config.json).

    Streams: one stored tensor (one parameter of all layers) is in memory at a time.
    """
    arch, base_cfg, dtype = read_meta(ckpt)
    tmp = _atomic_dir(out)
    try:
        with single_process_world():
            shapes = hf_shapes(arch)
            layout = [(n, shapes[n], dtype) for m, _, _ in _export_order(arch) for n in m.hf]
            # the torch-native spec keeps norm weights in fp32; export them in the model dtype
            tensors = ((n, t.to(dtype)) for n, t in stream_checkpoint_tensors(ckpt, arch))
            with explain_write_errors(out, "exported model"):
                write_tensors(tmp, layout, tensors, max_shard_bytes)
        with explain_write_errors(out, "exported model"):
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(hf_config_for(arch, base_cfg, dtype), f, indent=2)
            extra = os.path.join(ckpt, EXTRA_DIR)
            if os.path.isdir(extra):
                for name in os.listdir(extra):
                    shutil.copy2(os.path.join(extra, name), os.path.join(tmp, name))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s (%s)", out, arch.hf_architecture())
    return arch
