"""Sequence packing at TP=1: the pack layout, SDPA on packed segments against a block-diagonal
reference, and packed rows against the same sequences unpacked (logits, log-probabilities,
reward-model scores, gradients of a token-mean loss).

Tolerances: the packed and unpacked forwards run the same fp32 operations on differently shaped
tensors, so only the kernels' blocking, i.e. the order of fp32 additions, differs. Each logit
goes through 4 layers of dot products of at most 96 terms with values of order 1; reordering a
sum of K such terms moves it by about sqrt(K) x 2^-24 ~ 1e-6 at most per layer, so 1e-5 bounds
the logit difference with room (measured: below 5e-7). The sensitivity check below shows what a
real error (attention crossing sequences) costs: differences of order 1e-1.
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.micro_batching.packing import pack_micro_batches, pack_rows, pack_sequences, right_pad
from cooper_mcore.micro_batching.runner import MicroBatching, forward_packed
from cooper_mcore.models import spec
from cooper_mcore.models.forward import forward_only, position_ids_for, shifted_labels
from cooper_mcore.models.spec import SDPAttention
from cooper_mcore.parallel import ParallelConfig
from cooper_mcore.train.reward_model import rm_scores
from cooper_mcore.train.tokens import TokenBatch, compute_logprobs, token_logprobs

ATOL = 1e-5


# --------------------------------------------------------------------------- the layout


def test_pack_layout_by_hand():
    ids, lengths = right_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    pack = pack_rows(ids, lengths, rows=[2, 0, 1], pad_id=0, multiple_of=4)
    assert pack.input_ids.tolist() == [[9, 10, 5, 6, 7, 8, 0, 0]]
    assert pack.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    assert pack.cu_seqlens.tolist() == [0, 2, 5, 6, 8] and pack.cu_seqlens.dtype == torch.int32
    assert pack.lengths.tolist() == [2, 3, 1] and pack.rows.tolist() == [2, 0, 1]
    assert pack.num_tokens == 6 and pack.width == 8 and pack.max_seqlen == 3
    assert pack.last_token_positions.tolist() == [1, 4, 5]
    # a pack that fills its row has no padding segment
    assert pack_sequences([[1, 2], [3, 4]], pad_id=0, multiple_of=4).cu_seqlens.tolist() == [0, 2, 4]
    assert pack_sequences([[1, 2, 3]], pad_id=0, pad_to=5).cu_seqlens.tolist() == [0, 3, 5]


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4, 1, 7, 3, 5])
    ids, _ = right_pad([torch.randint(1, 50, (int(n),), generator=g) for n in lengths], pad_id=0)
    values = torch.randn(5, 7, 3, generator=g)
    packs = pack_micro_batches(ids, lengths, [[3, 0], [2], [4, 1]], pad_id=0, multiple_of=4, same_width=True)
    assert {p.width for p in packs} == {8}
    out = torch.full_like(values, float("nan"))
    for p in packs:
        packed = p.pack(values, fill=-1.0)
        assert packed.shape == (1, 8, 3) and (packed[0, p.num_tokens:] == -1).all()
        back = p.unpack(packed, width=7, fill=0.0)
        for i, r in enumerate(p.rows.tolist()):
            assert torch.equal(back[i, :lengths[r]], values[r, :lengths[r]])
            assert (back[i, lengths[r]:] == 0).all()
        p.scatter_into(out, packed)
        adv = p.pack_per_sequence(torch.arange(5.0))
        assert adv[0, :p.num_tokens].tolist() == [float(r) for r, n in zip(p.rows, p.lengths) for _ in range(n)]
    mask = torch.arange(7)[None, :] < lengths[:, None]
    assert torch.equal(out[mask], values[mask]) and out[~mask].isnan().all()


def test_pack_errors():
    ids, lengths = right_pad([[1, 2], [3]], pad_id=0)
    with pytest.raises(ValueError, match="no row"):
        pack_rows(ids, lengths, [], pad_id=0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 2\]"):
        pack_rows(ids, torch.tensor([2, 0]), [0, 1], pad_id=0)
    with pytest.raises(ValueError, match="non-empty"):
        right_pad([[1], []], pad_id=0)
    pack = pack_rows(ids, lengths, [0, 1], pad_id=0)
    with pytest.raises(ValueError, match="expected 3 packed positions"):
        pack.unpack(torch.zeros(1, 4))


# --------------------------------------------------------------------------- attention


def _attention(mask_type):
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            kv_channels=16, attention_dropout=0.0, use_cpu_initialization=True)
    return SDPAttention(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def _block_diagonal_reference(q, k, v, cu, causal):
    """Softmax attention over all t tokens with a block-diagonal (causal) mask, written out."""
    t, heads, d = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / d**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).reshape(t, heads * d)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_sdpa_packed_equals_block_diagonal_mask(mask_type):
    g = torch.Generator().manual_seed(1)
    cu = [0, 3, 4, 9, 16]
    q = torch.randn(16, 4, 16, generator=g, requires_grad=True)
    k, v = torch.randn(16, 2, 16, generator=g), torch.randn(16, 2, 16, generator=g)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=7, max_seqlen_kv=7)
    out = _attention(mask_type)(q, k, v, None, packed_seq_params=params)
    ref = _block_diagonal_reference(q, k, v, cu, mask_type == AttnMaskType.causal)
    assert out.shape == (16, 64)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    out.sum().backward()  # gradients flow through the per-segment calls
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_sdpa_packed_rejects_other_layouts():
    att = _attention(AttnMaskType.causal)
    q, kv = torch.zeros(4, 4, 16), torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="'thd' only"):
        att(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu))
    with pytest.raises(ValueError, match="cu_seqlens_q_padded must be None or equal"):
        att(q, kv, kv, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=torch.tensor([0, 3, 4], dtype=torch.int32)))
    with pytest.raises(ValueError, match="must run from 0"):
        att(q, kv, kv, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32)))


def test_varlen_kwargs_follow_torch_signature(monkeypatch):
    """torch's varlen_attn changed its signature between releases; the CUDA path adapts (the call
    itself needs a GPU: measured on an H100 with torch 2.11, see docs/measurements.md)."""
    def v29(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        """torch 2.9-2.10"""

    def v211(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        """torch 2.11"""

    def v213(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
             enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        """torch 2.13"""

    monkeypatch.setattr(spec, "varlen_attn", v29)
    assert spec._varlen_kwargs(True, 0.125, 64, gqa=True) == {"is_causal": True}
    assert spec._varlen_kwargs(True, 0.5, 64, gqa=False) is None  # cannot pass a non-default scale
    monkeypatch.setattr(spec, "varlen_attn", v211)
    assert spec._varlen_kwargs(True, 0.5, 64, gqa=True) == {"window_size": (-1, 0), "scale": 0.5}
    monkeypatch.setattr(spec, "varlen_attn", v213)
    assert spec._varlen_kwargs(False, 0.5, 64, gqa=True) == {"window_size": (-1, -1), "scale": 0.5,
                                                             "enable_gqa": True}
    assert not spec._use_varlen(torch.zeros(2, 2, 2, dtype=torch.bfloat16), 0.0)  # CPU: per-segment SDPA


# --------------------------------------------------------------------------- whole models


def _sequences(vocab, lengths, seed, pad_id=0):
    g = torch.Generator().manual_seed(seed)
    return right_pad([torch.randint(1, vocab, (n,), generator=g) for n in lengths], pad_id)


LENGTHS = [9, 3, 16, 1, 12, 5]
MICRO = [[2, 3, 0], [5, 1, 4]]  # two packs, rows out of order
#: what the trainer's passes get for these lengths: packs by a 26-token budget
PACKED = MicroBatching(3, max_tokens=26, pack=True)


def _load(tiny_models, family, model_type="causal_lm"):
    model, arch = load_checkpoint_model(tiny_models[(family, model_type)][1], ParallelConfig())
    return model.eval(), arch


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "llama", "qwen3"])
def test_packed_logits_equal_unpacked(tiny_models, world, family):
    model, arch = _load(tiny_models, family)
    ids, lengths = _sequences(arch.vocab_size, LENGTHS, seed=2)
    ref = forward_only(model, ids)
    worst = 0.0
    for pack in pack_micro_batches(ids, lengths, MICRO, pad_id=0, multiple_of=8):
        assert pack.width % 8 == 0 and pack.width > pack.num_tokens  # a padding segment too
        with torch.no_grad():
            logits = forward_packed(model, pack)
        back = pack.unpack(logits)
        for i, r in enumerate(pack.rows.tolist()):
            n = int(lengths[r])
            worst = max(worst, float((back[i, :n] - ref[r, :n]).abs().max()))
            # sensitivity: the same row without PackedSeqParams attends across sequences
        with torch.no_grad():
            crossing = pack.unpack(model(pack.input_ids, pack.position_ids, None))
        late = pack.rows[-1].item()
        assert float((crossing[-1, :lengths[late]] - ref[late, :lengths[late]]).abs().max()) > 1e-2
    assert worst < ATOL, worst


def test_megatron_rope_ignores_position_ids(tiny_models, world):
    """Why packing needs PackedSeqParams: GPTModel's rotary embedding does not read position_ids,
    so restarting them alone would leave the positions running on across sequences."""
    model, arch = _load(tiny_models, "qwen2")
    ids, _ = _sequences(arch.vocab_size, [10], seed=3)
    restarted = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        a = model(ids, position_ids_for(ids), None)
        b = model(ids, restarted, None)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_logprobs_equal_unpacked(tiny_models, world, family):
    model, arch = _load(tiny_models, family)
    ids, lengths = _sequences(arch.vocab_size, LENGTHS, seed=4)
    logp = compute_logprobs(model, TokenBatch(ids, torch.zeros(ids.shape), lengths=lengths), PACKED)
    # reference: full-vocabulary log-softmax of the unpacked logits at the shifted labels
    ref = torch.log_softmax(forward_only(model, ids).double(), -1).gather(-1, shifted_labels(ids)[..., None])[..., 0]
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    torch.testing.assert_close(logp[mask].double(), ref[mask], rtol=0, atol=ATOL)
    assert (logp[~mask] == 0).all()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_packed_rm_scores_equal_unpacked(tiny_models, world, family):
    model, arch = _load(tiny_models, family, "reward")
    ids, lengths = _sequences(arch.vocab_size, LENGTHS, seed=5, pad_id=arch.pad_token_id or 0)
    ref = forward_only(model, ids, sequence_lengths=lengths)
    scores = rm_scores(model, ids, lengths, batching=PACKED)
    torch.testing.assert_close(scores, ref.float(), rtol=0, atol=ATOL)
    assert ref.abs().min() > 1e-3  # real scores, not zeros
    with pytest.raises(ValueError, match="not both"):
        model(ids, position_ids_for(ids), None, sequence_lengths=lengths, score_positions=lengths)


def test_token_mean_gradient_packed_equals_unpacked(tiny_models, world):
    """Gradients of the token-mean loss over two packed micro-batches (each returning its loss
    sum, divided once by the total token count, as megatron's per-token loss mode does) equal
    those of the same loss on the unpacked batch."""
    model, arch = _load(tiny_models, "qwen2")
    model.train()
    ids, lengths = _sequences(arch.vocab_size, LENGTHS, seed=6)
    labels = shifted_labels(ids)
    g = torch.Generator().manual_seed(7)
    mask = (torch.arange(ids.shape[1])[None, :] < (lengths[:, None] - 1)).float()
    mask *= (torch.rand(mask.shape, generator=g) > 0.3).float()  # some prompt tokens excluded
    weight = torch.randn(ids.shape, generator=g)  # per-token weights, like advantages

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    logp = token_logprobs(model(ids, position_ids_for(ids), None), labels)
    ((weight * logp * mask).sum() / mask.sum()).backward()
    ref = grads()
    total = mask.sum()
    for pack in pack_micro_batches(ids, lengths, MICRO, pad_id=0, multiple_of=8):
        logp = token_logprobs(forward_packed(model, pack), pack.pack(labels))
        ((pack.pack(weight) * logp * pack.pack(mask)).sum() / total).backward()
    packed = grads()
    scale = max(float(g.abs().max()) for g in ref.values())
    for name in ref:
        torch.testing.assert_close(packed[name], ref[name], rtol=0, atol=1e-5 * scale, msg=name)
    assert scale > 1e-3
