"""Compare a Megatron model checkpoint with its Hugging Face original, at any TP/PP layout.

The checkpoint is loaded by :func:`cooper_mcore.checkpoint.model.load_checkpoint_model`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import transformers

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.collectives import all_reduce
from cooper_mcore.models.forward import forward_only
from cooper_mcore.parallel import ParallelConfig

logger = logging.getLogger(__name__)


def sample_batch(vocab_size: int, batch: int, seq: int, pad_id: int | None, seed: int):
    """Random right-padded token ids (no pad id inside rows) and their lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    if pad_id is not None:
        ids[ids == pad_id] = (pad_id + 1) % vocab_size
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 0 if pad_id is None else pad_id
    return ids, lengths


def logits_diff(model, arch, hf_dir: str, batch: int = 2, seq: int = 16, seed: int = 0) -> float:
    """Max |logit difference| between a loaded Megatron model and transformers on random input.

    For reward models, the difference of the scalar scores at the last non-pad token.
    Collective over the initialised world; every rank returns the same value.
    """
    dtype = model.config.params_dtype
    pad = arch.pad_token_id if arch.model_type == "reward" else None
    if arch.model_type == "reward" and pad is None:
        pad = transformers.AutoConfig.from_pretrained(hf_dir, trust_remote_code=False).pad_token_id
    ids, lengths = sample_batch(arch.vocab_size, batch, seq, pad, seed)
    if arch.model_type == "reward":
        out = forward_only(model, ids, sequence_lengths=lengths)
    else:
        out = forward_only(model, ids)
    diff = torch.zeros((), dtype=torch.float64)
    if out is not None:
        auto = (transformers.AutoModelForSequenceClassification if arch.model_type == "reward"
                else transformers.AutoModelForCausalLM)
        hf = auto.from_pretrained(hf_dir, dtype=dtype, use_safetensors=True, trust_remote_code=False).eval()
        with torch.no_grad():
            if arch.model_type == "reward":
                ref = hf(ids).logits.squeeze(-1)
                diff = (out.cpu().double() - ref.double()).abs().max()
            else:
                ref = hf(ids).logits
                mask = torch.arange(seq)[None, :] < lengths[:, None]
                diff = (out.cpu().double() - ref.double()).abs()[mask].max()
    return float(all_reduce(diff, dist.ReduceOp.MAX).item())


def compare_logits(hf_dir: str, ckpt: str, parallel: ParallelConfig, batch: int = 2,
                   seq: int = 16, seed: int = 0) -> float:
    """Load ``ckpt`` at the ``parallel`` layout and return :func:`logits_diff` against ``hf_dir``."""
    model, arch = load_checkpoint_model(ckpt, parallel)
    return logits_diff(model, arch, hf_dir, batch, seq, seed)
