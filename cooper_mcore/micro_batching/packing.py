"""Sequence packing: several sequences end to end in one row, and back (torch only).

A :class:`PackedBatch` is megatron-core's ``thd`` layout with a batch of one: the token ids of
``n`` sequences concatenated into one row ``[1, T]``, described by ``cu_seqlens`` (the cumulative
segment boundaries ``[0, L_0, L_0 + L_1, ...]``). Attention stays inside each segment and rotary
positions restart at 0 in each (:func:`cooper_mcore.micro_batching.runner.forward_packed` turns a pack
into megatron's ``PackedSeqParams``; :class:`~cooper_mcore.models.spec.SDPAttention` and Transformer Engine read
it). When the row must be longer than its tokens (sequence parallelism needs ``T`` to be a
multiple of the TP size), the padding is appended as one extra segment of pad tokens, so it
attends only to itself and never changes a real token's output (megatron-LM and slime pad the
same way).

A pack remembers which rows of a right-padded source batch it holds (``rows``), so per-token
tensors laid out like that batch (loss masks, old log-probabilities, labels) are packed with
:meth:`PackedBatch.pack` into the same layout, and per-token outputs go back with
:meth:`PackedBatch.unpack` / :meth:`PackedBatch.scatter_into`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch


@dataclass
class PackedBatch:
    """Sequences packed into one row.

    Attributes:
        input_ids: ``[1, T]`` token ids; the real tokens first, then ``T - num_tokens`` pad ids.
        position_ids: ``[1, T]`` positions, restarting at 0 in every segment (padding included).
        cu_seqlens: ``[k + 1]`` int32 segment boundaries, ``cu_seqlens[0] = 0``,
            ``cu_seqlens[-1] = T``: the ``n`` sequences, then one padding segment if ``T`` exceeds
            the real tokens (``k = n`` or ``n + 1``).
        lengths: ``[n]`` int64 real lengths, in pack order.
        rows: ``[n]`` int64 indices of the packed sequences in their source batch, in pack order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor

    def __post_init__(self) -> None:
        n, t = self.lengths.numel(), self.input_ids.shape[-1]
        assert self.input_ids.shape == (1, t) and self.position_ids.shape == (1, t)
        assert self.cu_seqlens.dtype == torch.int32 and int(self.cu_seqlens[-1]) == t
        assert self.rows.shape == (n,) and self.cu_seqlens.numel() in (n + 1, n + 2)

    @property
    def num_sequences(self) -> int:
        """Real sequences in the pack."""
        return self.lengths.numel()

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return int(self.lengths.sum())

    @property
    def width(self) -> int:
        """The row length ``T``, padding included."""
        return self.input_ids.shape[1]

    @property
    def max_seqlen(self) -> int:
        """The longest segment (padding segment included), as megatron's ``max_seqlen_q``."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    @property
    def starts(self) -> torch.Tensor:
        """``[n]`` offset of each sequence in the row."""
        return self.cu_seqlens[:-1][: self.num_sequences].long()

    @property
    def last_token_positions(self) -> torch.Tensor:
        """``[n]`` position of each sequence's last token in the row (where an RM score is read)."""
        return self.starts + self.lengths - 1

    @cached_property
    def _token_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence i, column j) of every real token, in row order (computed once per pack)."""
        seq = torch.repeat_interleave(torch.arange(self.num_sequences), self.lengths)
        col = torch.arange(self.num_tokens) - torch.repeat_interleave(self.starts, self.lengths)
        return seq, col

    def pack(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """Pack a tensor laid out like the source batch into this pack's row.

        Args:
            values: ``[N, s, ...]`` per-token values of the source batch (right-padded rows,
                ``s`` at least the longest packed length), e.g. labels, a loss mask, log-probs.
            fill: value at padding positions.

        Returns:
            ``[1, T, ...]`` on ``values``' device.
        """
        if values.dim() < 2:
            raise ValueError(f"pack: values must be [N, s, ...], got shape {tuple(values.shape)}")
        if self.num_sequences and int(self.lengths.max()) > values.shape[1]:
            raise ValueError(f"pack: values have {values.shape[1]} columns, a packed sequence has "
                             f"{int(self.lengths.max())} tokens")
        seq, col = self._token_index
        out = values.new_full((self.width, *values.shape[2:]), fill)
        dev = values.device
        out[: self.num_tokens] = values[self.rows[seq].to(dev), col.to(dev)]
        return out.unsqueeze(0)

    def pack_per_sequence(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """Broadcast one value per source row (e.g. an advantage) to its tokens: ``[N]`` -> ``[1, T]``."""
        seq, _ = self._token_index
        out = values.new_full((self.width,), fill)
        out[: self.num_tokens] = values[self.rows[seq].to(values.device)]
        return out.unsqueeze(0)

    def unpack(self, packed: torch.Tensor, width: Optional[int] = None, fill: float | int = 0) -> torch.Tensor:
        """Per-token outputs of this pack back to right-padded rows, in pack order.

        Args:
            packed: ``[1, T, ...]`` or ``[T, ...]``.
            width: columns of the result (default: the longest sequence).
            fill: value past each sequence's end.

        Returns:
            ``[n, width, ...]``; row ``i`` is the sequence ``rows[i]`` of the source batch.
        """
        packed = self._flat(packed)
        width = int(self.lengths.max()) if width is None else width
        seq, col = self._token_index
        out = packed.new_full((self.num_sequences, width, *packed.shape[1:]), fill)
        dev = packed.device
        out[seq.to(dev), col.to(dev)] = packed[: self.num_tokens]
        return out

    def scatter_into(self, out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Write per-token outputs of this pack into the rows they came from (in place).

        Args:
            out: ``[N, s, ...]`` laid out like the source batch.
            packed: ``[1, T, ...]`` or ``[T, ...]``.
        """
        packed = self._flat(packed)
        seq, col = self._token_index
        dev = out.device
        out[self.rows[seq].to(dev), col.to(dev)] = packed[: self.num_tokens].to(out.dtype).to(dev)
        return out

    def _flat(self, packed: torch.Tensor) -> torch.Tensor:
        if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == self.width:
            packed = packed[0]
        if packed.shape[0] != self.width:
            raise ValueError(f"expected {self.width} packed positions, got shape {tuple(packed.shape)}")
        return packed


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pack_rows(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    rows: Sequence[int] | torch.Tensor,
    pad_id: int,
    multiple_of: int = 1,
    pad_to: Optional[int] = None,
) -> PackedBatch:
    """Pack chosen rows of a right-padded batch into one row.

    Args:
        input_ids: ``[N, s]`` right-padded token ids.
        lengths: ``[N]`` real lengths.
        rows: the rows to pack, in the order they are laid out (e.g. one micro-batch of
            :func:`cooper_mcore.micro_batching.planning.plan_micro_batches`).
        pad_id: token id of the padding.
        multiple_of: round the row length up to a multiple of this (the TP size under sequence
            parallelism).
        pad_to: make the row at least this long (e.g. one length for every micro-batch).

    Raises:
        ValueError: no row, a row of length 0 or longer than ``s``, bad ``multiple_of``.
    """
    if input_ids.dim() != 2 or lengths.shape != (input_ids.shape[0],):
        raise ValueError(f"pack_rows: input_ids [N, s] and lengths [N] expected, got "
                         f"{tuple(input_ids.shape)} and {tuple(lengths.shape)}")
    if multiple_of < 1:
        raise ValueError(f"pack_rows: multiple_of must be >= 1, got {multiple_of}")
    rows = torch.as_tensor(rows, dtype=torch.long).flatten()
    if rows.numel() == 0:
        raise ValueError("pack_rows: no row to pack")
    lens = lengths.cpu().long()[rows]
    if int(lens.min()) < 1 or int(lens.max()) > input_ids.shape[1]:
        raise ValueError(f"pack_rows: lengths must lie in [1, {input_ids.shape[1]}], got {lens.tolist()}")
    total = int(lens.sum())
    width = round_up(max(total, pad_to or 0), multiple_of)
    bounds = [0, *torch.cumsum(lens, 0).tolist()]
    if width > total:
        bounds.append(width)
    cu = torch.tensor(bounds, dtype=torch.int32)
    pack = PackedBatch(
        input_ids=torch.full((1, width), pad_id, dtype=input_ids.dtype),
        position_ids=torch.zeros((1, width), dtype=torch.long),
        cu_seqlens=cu,
        lengths=lens,
        rows=rows,
    )
    seq, col = pack._token_index
    pack.input_ids[0, :total] = input_ids.cpu()[rows[seq], col]
    seg_len = (cu[1:] - cu[:-1]).long()
    pack.position_ids[0] = torch.arange(width) - torch.repeat_interleave(cu[:-1].long(), seg_len)
    return pack


def pack_sequences(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    pad_id: int,
    multiple_of: int = 1,
    pad_to: Optional[int] = None,
) -> PackedBatch:
    """Pack token id lists into one row (``rows`` are their indices ``0..n-1``).

    Args:
        sequences: non-empty token id lists or 1-D tensors.
        pad_id / multiple_of / pad_to: as in :func:`pack_rows`.
    """
    ids, lengths = right_pad(sequences, pad_id)
    return pack_rows(ids, lengths, range(len(sequences)), pad_id, multiple_of, pad_to)


def right_pad(sequences: Sequence[Sequence[int] | torch.Tensor], pad_id: int,
              multiple_of: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, s] right-padded ids, [N] lengths)`` of token id lists (``s`` rounded up to ``multiple_of``)."""
    lengths = [len(s) for s in sequences]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"right_pad: need non-empty sequences, got lengths {lengths}")
    ids = torch.full((len(sequences), round_up(max(lengths), multiple_of)), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : lengths[i]] = torch.as_tensor(s, dtype=torch.long)
    return ids, torch.tensor(lengths, dtype=torch.long)


def pack_micro_batches(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    micro_batches: Sequence[Sequence[int]],
    pad_id: int,
    multiple_of: int = 1,
    same_width: bool = False,
) -> list[PackedBatch]:
    """One :class:`PackedBatch` per micro-batch of row indices.

    Args:
        input_ids / lengths: the right-padded source batch.
        micro_batches: row indices of each micro-batch (one rank's list from
            :class:`cooper_mcore.micro_batching.planning.MicroBatchPlan`).
        pad_id / multiple_of: as in :func:`pack_rows`.
        same_width: pad every pack to the widest one (fixed pipeline shapes without
            ``variable_seq_lengths``).
    """
    packs = [pack_rows(input_ids, lengths, mb, pad_id, multiple_of) for mb in micro_batches]
    if same_width and packs:
        width = max(p.width for p in packs)
        packs = [p if p.width == width else pack_rows(input_ids, lengths, p.rows, pad_id, multiple_of, width)
                 for p in packs]
    return packs
