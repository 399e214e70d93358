"""Micro-batches of a mini-batch as forward passes take them: a fixed number of right-padded rows,
or rows binned by a token budget, padded or packed end to end into one row (megatron-core's ``thd``
layout).

GRPO batches are ragged: responses run from a few tokens to the length limit. Fixed micro-batches
pad every row to the longest of the micro-batch; a token budget
(:func:`~cooper_mcore.micro_batching.planning.plan_micro_batches`, longest first into the emptiest
bin) puts similar lengths together and fills each micro-batch up to the budget; packing removes the
padding (attention stays inside each sequence and rotary positions restart per sequence:
:mod:`cooper_mcore.micro_batching.packing`, run here with megatron's ``PackedSeqParams`` by
:func:`forward_packed`). The four passes of a Cooper step (old/reference log-probabilities, the
policy update, RM scoring, the RM update) take a :class:`MicroBatching` and go through
:class:`MicroBatch`, so each pass has one code path for the three modes.

Every data-parallel rank bins its own rows and runs as many micro-batches as the rank with the
most (:func:`micro_batch_plan`); ranks do not exchange rows, so their token counts are balanced
only as far as their mini-batches are. The loss stays exactly the token (or pair) mean over the
whole mini-batch across micro-batches and ranks: losses return sums and counts and megatron
divides once (per-token loss mode), whatever the micro-batches.

megatron-core 0.16's ``GPTModel`` does not use ``position_ids`` for rotary embeddings (it builds
positions ``0..max_seqlen-1`` and ``Attention`` applies them per ``cu_seqlens`` segment); a pack's
``position_ids`` are passed for completeness only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from cooper_mcore.collectives import all_reduce
from cooper_mcore.micro_batching.packing import PackedBatch, pack_rows, round_up
from cooper_mcore.micro_batching.planning import plan_micro_batches
from cooper_mcore.models.forward import moe_padding_kwargs, position_ids_for, valid_tokens
from cooper_mcore.models.routing_replay import arm as arm_replay
from cooper_mcore.parallel import device

#: the token that fills a micro-batch's row past its sequences: a pack's last segment, or the columns
#: past every length of padded rows (never read)
PACK_PAD_ID = 0


def packed_seq_params(pack: PackedBatch, dev: Optional[torch.device] = None) -> PackedSeqParams:
    """megatron-core's ``PackedSeqParams`` of a pack (``thd``, int32 ``cu_seqlens`` on ``dev``).

    The padding at the end of a pack is its own segment, so no ``cu_seqlens_*_padded`` are set.
    """
    cu = pack.cu_seqlens.to(device=dev or device(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=pack.max_seqlen, max_seqlen_kv=pack.max_seqlen)


def forward_packed(model: torch.nn.Module, pack: PackedBatch, **kwargs: Any) -> torch.Tensor:
    """Call this rank's stage on one packed row.

    Args:
        model: this rank's stage (inside a megatron forward step).
        pack: the packed micro-batch (on any device; moved to this rank's device).
        kwargs: passed to the model, e.g. ``score_positions=pack.last_token_positions`` for a
            reward model.

    Returns:
        What the stage returns: the hidden states on inner stages; on the last stage the logits
        ``[1, T, vocab / tp]`` (policy), per-token scores ``[1, T]`` or the scores at
        ``score_positions`` (reward model).
    """
    dev = device()
    return model(pack.input_ids.to(dev), pack.position_ids.to(dev), None,
                 packed_seq_params=packed_seq_params(pack, dev), **kwargs)


@dataclass(frozen=True)
class MicroBatching:
    """How a mini-batch is cut into micro-batches.

    Attributes:
        size: rows per micro-batch when there is no token budget.
        max_tokens: token budget per micro-batch (0: fixed ``size`` rows). With padding a
            micro-batch costs rows x its longest row; packed, the sum of its lengths.
        pack: with a budget, pack each micro-batch's sequences into one row.
    """

    size: int = 8
    max_tokens: int = 0
    pack: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or self.max_tokens < 0:
            raise ValueError(f"micro-batches need size >= 1 and max_tokens >= 0, got {self.size}, {self.max_tokens}")
        if self.pack and not self.max_tokens:
            raise ValueError("packing sequences needs a token budget (train.max_tokens_per_micro_batch > 0)")

    @property
    def by_tokens(self) -> bool:
        """Whether micro-batches are formed by the token budget."""
        return self.max_tokens > 0


@dataclass
class MicroBatch:
    """Some rows of a right-padded mini-batch as one forward pass takes them.

    Attributes:
        rows: ``[n]`` indices of the rows in the mini-batch, in micro-batch order.
        input_ids: ``[b, s]`` token ids: the rows right-padded (``b = n``) or packed (``b = 1``).
        lengths: ``[n]`` the rows' real lengths.
        pack: the packing, when packed.
    """

    rows: torch.Tensor
    input_ids: torch.Tensor
    lengths: torch.Tensor
    pack: Optional[PackedBatch] = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(b, s)`` of the token ids (what pipeline stages exchange)."""
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def layout(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """Per-token values of the mini-batch (``[N, S, ...]``) in this micro-batch's layout ``[b, s, ...]``."""
        if self.pack is not None:
            return self.pack.pack(values, fill)
        return fit_width(values[self.rows], self.shape[1], fill)

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """One value per row of the mini-batch (``[N]``): ``[b]`` padded, every token's ``[1, T]`` packed."""
        return self.pack.pack_per_sequence(values) if self.pack is not None else values[self.rows]

    def forward(self, model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
        """This rank's stage on the micro-batch (inside a megatron forward step); a mixture-of-experts
        model's routers leave the padding out of their load balancing (:func:`moe_padding_kwargs`) and,
        when the model is replaying the rollout's routing, take the micro-batch's routes
        (:func:`cooper_mcore.models.routing_replay.arm`)."""
        kwargs = {**moe_padding_kwargs(model, self.valid_tokens()), **kwargs}
        arm_replay(model, self.layout)
        if self.pack is not None:
            return forward_packed(model, self.pack, **kwargs)
        ids = self.input_ids.to(device())
        return model(ids, position_ids_for(ids), None, **kwargs)

    def valid_tokens(self) -> torch.Tensor:
        """``[b, s]`` True on the real tokens (not the padding) of the micro-batch's token ids."""
        lengths = torch.tensor([self.pack.num_tokens]) if self.pack is not None else self.lengths
        return valid_tokens(self.shape, lengths)

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return int(self.lengths.sum())

    def score_kwargs(self) -> dict[str, torch.Tensor]:
        """A reward model's arguments to read each row's score at its last token."""
        if self.pack is not None:
            return {"score_positions": self.pack.last_token_positions.to(device())}
        return {"sequence_lengths": self.lengths.to(device())}

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write per-token outputs ``[b, s, ...]`` back into the mini-batch's layout ``out`` ``[N, S, ...]``."""
        if self.pack is not None:
            self.pack.scatter_into(out, values)
            return
        width = min(self.shape[1], out.shape[1])
        out[self.rows, :width] = values[:, :width].to(out.dtype).to(out.device)


def micro_batch_plan(lengths: Sequence[int], batching: MicroBatching, dp_group: Optional[Any] = None,
                     allow_empty: bool = False) -> list[list[int]]:
    """This rank's micro-batches as row indices.

    Fixed: consecutive runs of ``batching.size`` rows. By tokens: binned to the budget, as many
    micro-batches as the data-parallel rank with the most (collective over ``dp_group`` when it has
    several ranks; every rank calls it). With ``allow_empty`` a rank may get empty micro-batches
    (it has fewer rows than micro-batches, or none), which the caller runs as masked fillers.
    """
    n = len(lengths)
    if not batching.by_tokens:
        return [list(range(i, min(i + batching.size, n))) for i in range(0, n, batching.size)]
    cost = "packed" if batching.pack else "padded"
    plan = plan_micro_batches(lengths, batching.max_tokens, cost=cost, allow_empty=allow_empty) if n else None
    count = plan.micro_batches_per_rank if plan is not None else 0
    k = count
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        k = int(all_reduce(torch.tensor([count]), dist.ReduceOp.MAX, dp_group).item())
    if plan is None:
        if not allow_empty:
            raise ValueError("micro_batch_plan: no rows")
        return [[] for _ in range(max(k, 1))]
    if k != count:
        plan = plan_micro_batches(lengths, batching.max_tokens, cost=cost, min_micro_batches=k, allow_empty=allow_empty)
    return plan.for_rank(0)


def fit_width(values: torch.Tensor, width: int, fill: float | int = 0) -> torch.Tensor:
    """Right-padded rows ``[b, s, ...]`` cut, or filled with ``fill`` on the right, to ``[b, width, ...]``."""
    if values.shape[1] >= width:
        return values[:, :width]
    pad = values.new_full((values.shape[0], width - values.shape[1], *values.shape[2:]), fill)
    return torch.cat([values, pad], dim=1)


def build_micro_batch(input_ids: torch.Tensor, lengths: torch.Tensor, rows: Sequence[int] | torch.Tensor,
                      batching: MicroBatching, multiple: int = 1) -> MicroBatch:
    """The micro-batch of ``rows`` of a right-padded mini-batch (widths rounded to ``multiple``).

    Fixed micro-batches keep the mini-batch's full width (as megatron's schedule wants one shape);
    by-token ones are cut to their longest row or packed. Rows are filled with :data:`PACK_PAD_ID`.
    """
    idx = torch.as_tensor(rows, dtype=torch.long)
    lens = lengths[idx]
    if batching.pack:
        pack = pack_rows(input_ids, lengths, idx, PACK_PAD_ID, multiple_of=multiple)
        return MicroBatch(idx, pack.input_ids, lens, pack)
    width = input_ids.shape[1] if not batching.by_tokens else int(lens.max())
    return MicroBatch(idx, fit_width(input_ids[idx], round_up(width, multiple), PACK_PAD_ID), lens)


def split_micro_batches(input_ids: torch.Tensor, lengths: torch.Tensor, batching: MicroBatching,
                        multiple: int = 1, dp_group: Optional[Any] = None) -> list[MicroBatch]:
    """Every row of a right-padded mini-batch, in this rank's micro-batches."""
    return [build_micro_batch(input_ids, lengths, rows, batching, multiple)
            for rows in micro_batch_plan(lengths.tolist(), batching, dp_group)]
