"""Hugging Face <-> megatron-core conversion of model checkpoints.

``hf-to-mcore`` (:func:`hf_to_mcore`) builds the model once at TP=PP=1 without random init, fills
it one HF tensor at a time and saves it as a model checkpoint (:mod:`cooper_mcore.checkpoint.model`)
without extra copies; ``mcore-to-hf`` (:func:`mcore_to_hf`) builds no model and reads the
checkpoint one stored tensor at a time. Neither needs the model in memory twice. Folders are written under
a temporary name and renamed when complete; a write that fails (a full disk is reported as such,
naming the output: :mod:`cooper_mcore.files`) removes the temporary folder. ``mcore-to-hf`` reads
only a checkpoint that :func:`~cooper_mcore.checkpoint.model.open_model_checkpoint` passes (finished,
matching its manifest), and its export always holds a tokenizer: the checkpoint's, or one given.

The per-parameter names and layouts are :mod:`cooper_mcore.models.hf_mapping`'s; the safetensors
reader and writer :mod:`cooper_mcore.checkpoint.safetensors_io`'s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from cooper_mcore.checkpoint.model import (
    CHECKPOINT_DTYPES,
    EXTRA_DIR,
    copy_extra_files,
    dtype_name,
    open_model_checkpoint,
    save_model_checkpoint,
)
from cooper_mcore.checkpoint.safetensors_io import HFCheckpointReader, write_tensors
from cooper_mcore.checkpoint.tokenizer import load_checkpoint_tokenizer, tokenizer_folder
from cooper_mcore.data.tokenizer import check_tokenizer_fits
from cooper_mcore.files import explain_write_errors
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.hf_mapping import (
    _LAYER_RE,
    _LOCAL_EXPERT_RE,
    _LOCAL_TO_TE,
    ParamMapping,
    hf_shapes,
    mapping_tensors,
    param_mappings,
    to_hf,
    to_mcore,
)
from cooper_mcore.parallel import ParallelConfig, single_process_world

logger = logging.getLogger(__name__)

def _hf_dtype(reader: HFCheckpointReader, cfg: dict[str, Any]) -> torch.dtype:
    """The HF folder's dtype: its config's, else that of its embedding."""
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name in CHECKPOINT_DTYPES:
        return CHECKPOINT_DTYPES[name]
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
    params = mapped_state(model)
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


def mapped_state(model: torch.nn.Module, layer_offset: int = 0) -> dict[str, torch.Tensor]:
    """A TP=1 model's (or stage's) state by mapping name: one tensor per name, stacked expert weights
    as one view per expert (writing into them fills the model)."""
    return {name: t for k, v in model.state_dict().items() if not k.endswith("_extra_state")
            for name, t in mapping_tensors(k, v, layer_offset)}


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


def _atomic_dir(out: str) -> str:
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(out):
        raise FileExistsError(f"output {out!r} already exists; remove it or choose another path")
    return tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=parent)


def hf_to_mcore(hf_dir: str, out: str, model_type: str | None = None, head_std: float | None = None) -> ArchSpec:
    """Convert an HF safetensors folder into a cooper_mcore model checkpoint.

    Args:
        hf_dir: HF model folder (config.json + safetensors).
        out: output folder; must not exist.
        model_type: "causal_lm" or "reward"; default: from the config's architecture.
        head_std: the std of a new reward head (``model_type="reward"`` from a causal LM, which has
            no ``score.weight``); default the config's ``initializer_range``; 0 for a zero head.

    Raises:
        ValueError: a negative ``head_std``, or a config the converter cannot take (refused
            before any tensor is read).
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
                save_model_checkpoint(model, tmp, arch, cfg, dtype, consume=True, extra_from=hf_dir)
            del model
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
    params = mapped_state(model, layer_offset)
    for m in param_mappings(arch):
        if m.mcore not in params:
            continue  # another pipeline stage holds it
        yield from zip(m.hf, to_hf(m, params[m.mcore], arch))


@dataclass(frozen=True)
class CkptKey:
    """Where a mapping's tensor is stored in a distributed checkpoint.

    Attributes:
        key: the stored tensor's key.
        layer: index along a leading layer axis (layers stacked under one key), else None.
        expert: index along the expert axis (after the layer axis, if any), else None.
    """

    key: str
    layer: int | None = None
    expert: int | None = None


def per_layer_keys(arch: ArchSpec) -> bool:
    """Whether megatron-core stores this model's layers under per-layer keys, not stacked.

    ``TransformerBlock.sharded_state_dict`` stacks the layers of a block under one key with a
    leading layer axis unless they differ (``non_homogeneous_layers``): for the builder's models,
    a mixture-of-experts model with dense and sparse layers (its ``moe_layer_freq`` is a list).
    """
    return arch.moe is not None and not all(arch.moe_layers())


def _ckpt_key(mcore_name: str, per_layer: bool = False) -> CkptKey:
    """Distributed-checkpoint location of a mapping name.

    megatron-core stacks the layers of a block under one key with a leading layer axis (per-layer
    keys ``decoder.layers.{i}.*`` with ``per_layer``), stores the local spec's norm weights under
    Transformer Engine's names, and a ``SequentialMLP``'s experts under one key per weight with an
    expert axis of global expert numbers (after the layer axis when stacked).
    """
    match = _LAYER_RE.match(mcore_name)
    if not match:
        return CkptKey(mcore_name)
    layer, rest = int(match.group(1)), match.group(2)
    rest = _LOCAL_TO_TE.get(rest, rest)
    prefix = f"decoder.layers.{layer}." if per_layer else "decoder.layers."
    stacked = None if per_layer else layer
    expert = _LOCAL_EXPERT_RE.match(rest)
    if expert:
        return CkptKey(f"{prefix}mlp.experts.experts.{expert.group(2)}", stacked, int(expert.group(1)))
    return CkptKey(prefix + rest, stacked)


def _export_order(arch: ArchSpec) -> list[tuple[ParamMapping, CkptKey]]:
    """Mappings grouped by checkpoint key (first-seen order), then by layer; experts of one
    key and layer stay in expert order."""
    per_layer = per_layer_keys(arch)
    keyed = [(m, _ckpt_key(m.mcore, per_layer)) for m in param_mappings(arch)]
    first: dict[str, int] = {}
    for i, (_, ck) in enumerate(keyed):
        first.setdefault(ck.key, i)
    return sorted(keyed, key=lambda x: (first[x[1].key], -1 if x[1].layer is None else x[1].layer))


def _read_unit(ck: CkptKey) -> tuple[str, int | None]:
    """What :func:`stream_checkpoint_tensors` reads at once: a whole stored tensor, or one layer
    of a stacked expert tensor (all layers' experts would be most of the model)."""
    return ck.key, ck.layer if ck.expert is not None else None


class _RowsPlanner(DefaultLoadPlanner):
    """Reads the rows ``start:start + n`` (dim 0) of one stored tensor into the state dict's tensor
    of ``n`` rows.

    megatron-core's loader cannot read part of a tensor in a one-process world (it fills in the
    other parts' placement with this rank, then finds fewer local shards than placed), and
    torch's default planner reads a plain tensor whole; this plans the reads of one chunk.
    """

    def __init__(self, key: str, start: int) -> None:
        super().__init__()
        self._key, self._start = key, start

    def create_local_plan(self) -> LoadPlan:
        dest = self.state_dict[self._key]
        chunk = ChunkStorageMetadata(offsets=torch.Size([self._start] + [0] * (dest.dim() - 1)), sizes=dest.shape)
        return LoadPlan(create_read_items_for_chunk_list(self._key, self.metadata.state_dict_metadata[self._key],
                                                         [chunk]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the read items' offsets are relative to it already


def _load_unit(ckpt: str, meta: dict, arch: ArchSpec, ck: CkptKey) -> torch.Tensor:
    """Read one read unit (see :func:`_read_unit`) of ``ckpt``, checking its axes against ``arch``."""
    if ck.key not in meta:
        raise ValueError(f"tensor {ck.key!r} is missing from checkpoint {ckpt!r}")
    shape, dtype = tuple(meta[ck.key].global_shape), meta[ck.key].dtype
    if ck.layer is not None and shape[0] != arch.num_layers:
        raise ValueError(f"tensor {ck.key!r}: checkpoint has {shape[0]} layers, "
                         f"the architecture {arch.num_layers}")
    if ck.expert is not None:
        experts = shape[0 if ck.layer is None else 1]
        if experts != arch.moe.num_experts:
            raise ValueError(f"tensor {ck.key!r}: checkpoint has {experts} experts, "
                             f"the architecture {arch.moe.num_experts}")
    if ck.expert is not None and ck.layer is not None:  # one layer of the stacked experts
        dest = torch.empty((1, *shape[1:]), dtype=dtype)
        dcp.load({ck.key: dest}, storage_reader=FileSystemReader(ckpt), planner=_RowsPlanner(ck.key, ck.layer),
                 no_dist=True)
        return dest[0]
    request = ShardedTensor.from_rank_offsets(ck.key, torch.empty(shape, dtype=dtype))
    return dist_checkpointing.load({ck.key: request}, ckpt)[ck.key]


def stream_checkpoint_tensors(ckpt: str, arch: ArchSpec):
    """Yield ``(hf_name, tensor)`` from a model checkpoint, reading one stored tensor at a time.

    No model is built. megatron-core stacks all layers of a parameter under one key, so the
    largest read is one parameter of all layers (e.g. ``linear_fc1``), never the whole model;
    the experts of a sparse layer are read one layer at a time (all of that layer's experts of
    one weight). The order is :func:`_export_order`'s. Needs torch.distributed initialised (one
    process); the caller has checked the checkpoint (:func:`open_model_checkpoint`).
    """
    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    current, value = None, None
    for m, ck in _export_order(arch):
        if _read_unit(ck) != current:
            value = None  # free the previous unit first
            value = _load_unit(ckpt, meta, arch, ck)
            current = _read_unit(ck)
        tensor = value if ck.layer is None or ck.expert is not None else value[ck.layer]
        yield from zip(m.hf, to_hf(m, tensor if ck.expert is None else tensor[ck.expert], arch))


def mcore_to_hf(ckpt: str, out: str, max_shard_bytes: int = 5 * 2**30, tokenizer: Optional[str] = None,
                weights_only: bool = False) -> ArchSpec:
    """Export a cooper_mcore model checkpoint as an HF folder (safetensors, config.json, tokenizer).

    The checkpoint is checked first (:func:`open_model_checkpoint`: an unfinished or damaged one
    is refused). Streams: one stored tensor (one parameter of all layers, or one weight of one
    sparse layer's experts) is in memory at a time.

    Args:
        ckpt: a model checkpoint (``hf-to-mcore``'s output, a training checkpoint's ``policy/`` or ``rm/``).
        out: the HF folder to write; must not exist.
        max_shard_bytes: the safetensors files' size limit.
        tokenizer: the tokenizer to export with the model, from an HF model or tokenizer folder or a
            model checkpoint (its ``hf_extra/``); it must fit the model's vocabulary. None: the
            checkpoint's own ``hf_extra/`` (its tokenizer and generation files).
        weights_only: export without tokenizer files when the checkpoint has none (tests and logit
            comparisons: such a folder cannot tokenize or generate).

    Raises:
        ValueError: the checkpoint is unfinished or damaged, it has no tokenizer and none is given
            (the message names ``--tokenizer``), or the given tokenizer has none or does not fit.
    """
    arch, base_cfg, dtype = open_model_checkpoint(ckpt)
    extra = _export_extra(ckpt, arch, tokenizer, weights_only)
    tmp = _atomic_dir(out)
    try:
        with single_process_world():
            shapes = hf_shapes(arch)
            layout = [(n, shapes[n], dtype) for m, _ in _export_order(arch) for n in m.hf]
            # the torch-native spec keeps norm weights in fp32; export them in the model dtype
            tensors = ((n, t.to(dtype)) for n, t in stream_checkpoint_tensors(ckpt, arch))
            with explain_write_errors(out, "exported model"):
                write_tensors(tmp, layout, tensors, max_shard_bytes)
        with explain_write_errors(out, "exported model"):
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(hf_config_for(arch, base_cfg, dtype), f, indent=2)
            copy_extra_files(extra, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s (%s)", out, arch.hf_architecture())
    return arch


def _export_extra(ckpt: str, arch: ArchSpec, tokenizer: Optional[str], weights_only: bool) -> Optional[str]:
    """Where an export's tokenizer and generation files come from (:func:`copy_extra_files`'s source)."""
    if tokenizer is not None:
        try:
            tok = load_checkpoint_tokenizer(tokenizer)
        except ValueError as e:
            raise ValueError(f"--tokenizer {tokenizer!r}: {e}") from None
        check_tokenizer_fits(tok, arch.vocab_size, ckpt, tokenizer_path=tokenizer)
        logger.info("exporting the tokenizer of %s", tokenizer)
        return tokenizer
    if tokenizer_folder(ckpt) is None and not weights_only:
        raise ValueError(f"checkpoint {ckpt!r} has no tokenizer (no tokenizer files in its {EXTRA_DIR}/: the "
                         "checkpoints of a model.init=random run carry none), so its export could not be used: give "
                         "one with --tokenizer DIR (an HF model or tokenizer folder, e.g. the run's model.policy_hf)")
    return ckpt
