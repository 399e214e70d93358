"""Sizes for the memory planner (:mod:`cooper_mcore.planner.plan`): parameters of a model or of one
TP/PP/EP rank as megatron-core lays them out, training state, KV cache, activations and logits.

Mixture-of-experts models (Qwen3-MoE, :class:`~cooper_mcore.models.arch.MoeSpec`): a sparse layer
holds the router (``E h``, replicated) and ``E / ep`` experts of ``3 h I_e / etp`` parameters on
each rank instead of the dense MLP; with EP > 1 expert optimizer state is sharded over the expert
data-parallel group (``world / (ep etp pp)``), the rest over DP; the experts' activations are
counted per routed token copy and the all-to-all buffers once per pass.

Pure arithmetic on :class:`~cooper_mcore.models.arch.ArchSpec`; the conventions (what autograd
keeps, which copies the loss makes) are documented in :mod:`cooper_mcore.planner.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cooper_mcore.algo.vocab import DEFAULT_CHUNK_TOKENS
from cooper_mcore.models.arch import ArchSpec

__all__ = ["CUDA_CONTEXT_GIB", "DTYPE_BYTES", "GIB", "H100_80GB_GIB", "MOE_ROUTING_MARGIN", "active_numel",
           "backward_workspace_bytes", "check_layout", "expert_layer_numel", "final_norm_bytes",
           "forward_activation_bytes", "kv_bytes_per_token", "largest_tensor_numel", "layer_activation_bytes",
           "layer_numel", "logits_bytes", "model_numel", "moe_activation_bytes", "routed_tokens",
           "routing_margin_bytes", "serving_numel", "stage_expert_numel", "stage_layers", "stage_numel",
           "sync_buffer_bytes", "training_state"]

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
CUDA_CONTEXT_GIB = 0.75
"""One process's CUDA context on one GPU, cuBLAS initialised: 736 MiB (618 MiB before the first
matmul) measured with nvidia-smi for torch 2.11+cu130 on an H100 80GB HBM3, driver 580.159."""
H100_80GB_GIB = 79.18
"""What ``torch.cuda.mem_get_info()`` reports as the total memory of an H100 80GB HBM3 (measured)."""
MOE_ROUTING_MARGIN = 1.5
"""Token copies one EP rank's experts receive, as a multiple of the mean (``experts_per_token`` per
token): an allowance for uneven routing, not measured (the planner's ``routing_margin`` component;
the simulation routes evenly). Megatron's dispatcher is dropless here (no capacity factor), so the
worst case is every token on one rank's experts."""


def check_layout(arch: ArchSpec, tp: int, pp: int, name: str = "model", ep: int = 1, etp: int = 1) -> None:
    """Raise ValueError if ``arch`` cannot be split ``tp`` x ``pp`` (and its experts ``ep`` x ``etp``)
    as the model builder requires."""
    checks = [("num_layers", arch.num_layers, "pp", pp), ("num_key_value_heads", arch.num_query_groups, "tp", tp),
              ("num_attention_heads", arch.num_attention_heads, "tp", tp), ("vocab_size", arch.vocab_size, "tp", tp)]
    if arch.moe is not None:
        checks += [("num_experts", arch.moe.num_experts, "ep", ep),
                   ("moe_intermediate_size", arch.moe.expert_ffn_hidden_size, "etp", etp)]
    for what, value, by, div in checks:
        if value % div:
            raise ValueError(f"{name}: {what}={value} is not divisible by {by}={div}")


def _attention_numel(arch: ArchSpec, tp: int) -> int:
    """Norms and attention of one layer on one TP rank."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, 2 * arch.num_query_groups * d
    n = 2 * h  # input and pre-MLP RMSNorm weights (replicated)
    n += (q + kv) * h // tp + ((q + kv) // tp if arch.qkv_bias else 0)
    n += 2 * d if arch.qk_norm else 0
    n += h * q // tp  # attention output projection
    return n


def expert_layer_numel(arch: ArchSpec, ep: int = 1, etp: int = 1) -> int:
    """Expert parameters of one sparse layer on one rank: ``E/ep`` experts of ``3 h I_e / etp`` each
    (gate+up, down); 0 for a dense model."""
    if arch.moe is None:
        return 0
    m = arch.moe
    return m.num_experts // ep * 3 * arch.hidden_size * m.expert_ffn_hidden_size // etp


def layer_numel(arch: ArchSpec, tp: int = 1, sparse: bool = False, ep: int = 1, etp: int = 1) -> int:
    """Parameters of one transformer layer on one rank.

    Args:
        arch: the model.
        tp: tensor-parallel size (attention and dense MLP).
        sparse: a mixture-of-experts layer: router ``E h`` (replicated) and the local experts
            (:func:`expert_layer_numel`) instead of the dense MLP.
        ep / etp: expert-parallel and expert tensor-parallel sizes (sparse layers only).

    Raises:
        ValueError: ``sparse`` for a dense model.
    """
    n = _attention_numel(arch, tp)
    if not sparse:
        return n + 3 * arch.hidden_size * arch.ffn_hidden_size // tp  # gate+up, down
    if arch.moe is None:
        raise ValueError(f"sparse=True: {arch.hf_architecture()} has no experts")
    return n + arch.moe.num_experts * arch.hidden_size + expert_layer_numel(arch, ep, etp)


def stage_layers(arch: ArchSpec, pp: int, stage: int) -> list[bool]:
    """Whether each layer of pipeline stage ``stage`` is sparse (megatron splits the layers evenly).

    Raises:
        ValueError: ``stage`` is not in ``[0, pp)``.
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is not a pipeline stage of pp={pp}")
    per = arch.num_layers // pp
    return arch.moe_layers()[stage * per:(stage + 1) * per]


def stage_expert_numel(arch: ArchSpec, pp: int = 1, stage: int = 0, ep: int = 1, etp: int = 1) -> int:
    """Expert parameters on one rank of pipeline stage ``stage`` (with EP > 1, those megatron marks
    ``allreduce=False``, reduces and shards over the expert data-parallel group); 0 for a dense model."""
    return sum(stage_layers(arch, pp, stage)) * expert_layer_numel(arch, ep, etp)


def stage_numel(arch: ArchSpec, tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1, etp: int = 1) -> int:
    """Parameters on one rank of pipeline stage ``stage`` (megatron-core's layout), experts included."""
    h = arch.hidden_size
    embedding = arch.vocab_size * h // tp
    n = sum(layer_numel(arch, tp, sparse, ep, etp) for sparse in stage_layers(arch, pp, stage))
    if stage == 0:
        n += embedding
    if stage == pp - 1:
        n += h  # final norm
        if arch.model_type == "reward":
            n += h  # scalar head, replicated
        elif not arch.tie_word_embeddings or pp > 1:
            n += embedding
    return n


def serving_numel(arch: ArchSpec, tp: int = 1) -> int:
    """Parameters on one GPU of an SGLang server at ``tp_size=tp``: attention, MLPs and vocabulary
    split ``tp`` ways, and each expert's FFN too (SGLang's default MoE tensor parallelism, no EP)."""
    etp = tp if arch.moe is not None and arch.moe.expert_ffn_hidden_size % tp == 0 else 1
    return stage_numel(arch, tp, 1, 0, 1, etp)


def model_numel(arch: ArchSpec) -> int:
    """Parameters of the whole model (equal to the Hugging Face count)."""
    return stage_numel(arch)


def active_numel(arch: ArchSpec) -> int:
    """Parameters one token computes with: all but the experts it is not routed to (each sparse
    layer contributes its router and ``experts_per_token`` experts); the whole model if dense."""
    if arch.moe is None:
        return model_numel(arch)
    unused = (arch.moe.num_experts - arch.moe.experts_per_token) * expert_layer_numel(arch) // arch.moe.num_experts
    return model_numel(arch) - sum(arch.moe_layers()) * unused


def training_state(numel: int, dtype_bytes: int, dp: int, distributed_optimizer: bool = True,
                   trainable: bool = True, expert_numel: int = 0, expert_dp: int = 1) -> dict[str, int]:
    """Bytes of parameters, gradients and Adam state on one rank.

    Args:
        numel: parameters on the rank, experts included.
        dtype_bytes: bytes per parameter in the model dtype.
        dp: data-parallel size: the distributed optimizer shards the non-expert state over it.
        distributed_optimizer: shard the optimizer state (else every rank holds all of it).
        trainable: False: parameters only.
        expert_numel: of ``numel``, the expert parameters, whose state megatron shards over the
            expert data-parallel group instead (``expert_dp = world / (ep * etp * pp)``).
        expert_dp: that group's size.

    Raises:
        ValueError: ``expert_numel`` above ``numel``.
    """
    if not 0 <= expert_numel <= numel:
        raise ValueError(f"expert_numel={expert_numel} must be in [0, numel={numel}]")
    if not trainable:
        return {"params": numel * dtype_bytes, "grads": 0, "optimizer": 0}
    per_param = 8 + (4 if dtype_bytes < 4 else 0)  # two fp32 moments (+ fp32 main params for bf16)
    dense = numel - expert_numel
    shard = (math.ceil(dense / dp) + math.ceil(expert_numel / expert_dp)) if distributed_optimizer else numel
    return {"params": numel * dtype_bytes, "grads": numel * 4, "optimizer": shard * per_param}


def largest_tensor_numel(arch: ArchSpec) -> int:
    """Elements of the model's largest weight, whole (the weight push gathers each whole): the
    embedding (or output layer), the fused gate/up of an MLP, or the fused QKV."""
    h = arch.hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim * h
    return max(arch.vocab_size * h, 2 * arch.ffn_hidden_size * h, qkv)


def sync_buffer_bytes(arch: ArchSpec, bucket_bytes: int, dtype_bytes: int, tp: int = 1, pp: int = 1, ep: int = 1,
                      flattened: bool = True, receiver: bool = True) -> int:
    """The weight push's own memory on a pipeline stage's first TP rank (the memory simulation's
    measure). The ``receiver`` (the first stage, whose rank hands the engine the buckets): the engine's
    flat copy of a bucket (SGLang's payload, ``flattened``), and, when the pushed tensors are not the
    parameters themselves (gathered over TP, EP or the pipeline), the bucket of them (at least the
    largest weight). A later stage: the gather of one whole weight at a time, the largest (its TP shards
    and the joined tensor)."""
    largest = largest_tensor_numel(arch) * dtype_bytes
    if not receiver:
        return (2 if tp > 1 else 1) * largest
    flat = bucket_bytes if flattened else 0
    if tp == 1 and pp == 1 and ep == 1:
        return flat
    return flat + max(bucket_bytes, largest)


def kv_bytes_per_token(arch: ArchSpec, dtype_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes per token on one GPU: 2 (K, V) x layers x KV heads x head_dim x dtype bytes.

    With ``tp`` above the number of KV heads, each GPU keeps one (replicated) head.
    """
    heads = max(1, arch.num_query_groups // tp)
    return 2 * arch.num_layers * heads * arch.head_dim * dtype_bytes


def _replicated(arch: ArchSpec, tp: int, sequence_parallel: bool) -> int:
    """Elements per token of one hidden state on this rank: split over TP with sequence parallelism."""
    return arch.hidden_size // (tp if sequence_parallel else 1)


def _attention_kept(arch: ArchSpec, tp: int, sequence_parallel: bool) -> int:
    """Elements per token the norms and attention of one layer keep for backward (see the module doc)."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    attention = 5 * q + (3 * (q + kv) if arch.qk_norm else 0)
    return 8 * _replicated(arch, tp, sequence_parallel) + attention // tp


def layer_activation_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                           sequence_parallel: bool = False, sparse: bool = False, etp: int = 1) -> int:
    """Bytes autograd keeps for backward of one layer over ``tokens`` tokens, as the trainer's
    torch-native layers keep them (measured with the memory simulation, :mod:`cooper_mcore.planner.simulate`),
    per token in the model dtype: two RMSNorms of ``4 h`` each (their fp32 input is ``2 h``, the
    normalised and the weighted output ``h`` each; split over TP with sequence parallelism); attention
    ``5 q`` (q, k and v expanded to all heads, the attention output twice) plus ``3 (q + kv)`` for
    Qwen3's q/k norms; the gated MLP ``5 ffn`` (the gate/up output ``2 ffn``, silu, the ``up +
    offset`` copy megatron's GLU makes, their product), all over TP. A ``sparse`` layer keeps
    :func:`moe_activation_bytes` instead of the MLP's, at the mean routing (the uneven share is
    :func:`routing_margin_bytes`)."""
    attention = tokens * dtype_bytes * _attention_kept(arch, tp, sequence_parallel)
    if not sparse:
        return attention + tokens * dtype_bytes * 5 * arch.ffn_hidden_size // tp
    return attention + moe_activation_bytes(arch, tokens, dtype_bytes, tp, sequence_parallel, etp)


def routed_tokens(arch: ArchSpec, tokens: int, tp: int = 1, sequence_parallel: bool = False,
                  margin: float = 1.0) -> int:
    """Token copies one rank's experts process in one sparse layer: the rank's tokens (``tokens``
    split over TP with sequence parallelism) x ``experts_per_token`` (the mean: every EP rank gets its
    share), times ``margin`` (:data:`MOE_ROUTING_MARGIN` for the uneven share a router may give)."""
    if arch.moe is None:
        return 0
    local = tokens // (tp if sequence_parallel else 1)
    return math.ceil(local * arch.moe.experts_per_token * margin)


def _expert_elements(arch: ArchSpec, etp: int, train: bool) -> int:
    """Elements per routed token copy of one sparse layer: kept for backward (the permuted input ``h``,
    the experts' gate/up output ``2 I``, silu, ``up + offset``, their product and its
    probability-weighted copy, ``I`` each, over ETP), or alive at once in a forward-only pass (the
    dispatched, exchanged and sorted inputs ``3 h`` beside the same ``6 I``)."""
    assert arch.moe is not None
    return (1 if train else 3) * arch.hidden_size + 6 * arch.moe.expert_ffn_hidden_size // etp


def moe_activation_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                         sequence_parallel: bool = False, etp: int = 1) -> int:
    """Bytes autograd keeps for the MoE block of one sparse layer (megatron's alltoall dispatcher,
    the grouped experts) at the mean routing: the router's fp32 logits and scores (2 E x 4 B per
    local token) and :func:`_expert_elements` per routed token copy."""
    if arch.moe is None:
        raise ValueError(f"moe_activation_bytes: {arch.hf_architecture()} has no experts")
    local = tokens // (tp if sequence_parallel else 1)
    router = local * 2 * arch.moe.num_experts * 4
    return router + routed_tokens(arch, tokens, tp, sequence_parallel) * dtype_bytes * _expert_elements(arch, etp, True)


def routing_margin_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1, sequence_parallel: bool = False,
                         etp: int = 1, train: bool = True) -> int:
    """The allowance for uneven routing in one sparse layer: the expert memory of
    ``MOE_ROUTING_MARGIN - 1`` times the mean routed copies (kept for backward, or of a forward-only
    pass); 0 for a dense model. Not measured: the simulation routes evenly."""
    if arch.moe is None:
        return 0
    extra = routed_tokens(arch, tokens, tp, sequence_parallel, MOE_ROUTING_MARGIN) - routed_tokens(
        arch, tokens, tp, sequence_parallel)
    return extra * dtype_bytes * _expert_elements(arch, etp, train)


def forward_activation_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                             sequence_parallel: bool = False, etp: int = 1) -> int:
    """The most one layer holds at once in a forward-only pass over ``tokens`` tokens (nothing is kept
    for backward), the largest kind of layer: per token the residual stream and the norm (``4 h``,
    over TP with sequence parallelism, plus the gathered ``h`` it all-gathers) beside the MLP's
    ``5 ffn / tp``, or a sparse layer's :func:`_expert_elements` per routed copy at the mean routing."""
    hidden = 4 * _replicated(arch, tp, sequence_parallel) + (arch.hidden_size if sequence_parallel else 0)
    per = []
    for sparse in set(arch.moe_layers()):
        if sparse:
            local = tokens // (tp if sequence_parallel else 1)
            moe = local * 2 * arch.moe.num_experts * 4 + routed_tokens(arch, tokens, tp, sequence_parallel) * (
                dtype_bytes * _expert_elements(arch, etp, False))
            per.append(tokens * dtype_bytes * hidden + moe)
        else:
            per.append(tokens * dtype_bytes * (hidden + 5 * arch.ffn_hidden_size // tp))
    return max(per)


def backward_workspace_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                             sequence_parallel: bool = False, ep: int = 1, etp: int = 1,
                             layers: Sequence[bool] = ()) -> int:
    """Backward's own temporaries beyond what the forward kept, the largest of the ``layers`` kinds
    (default: the model's): a dense MLP's gradient (``2 ffn / tp`` per token), or a sparse layer's local
    experts' gate/up weight gradient and the copies' gradient (``E/ep x 2 I/etp x h + copies x 2 I/etp``)."""
    per = []
    for sparse in set(layers or arch.moe_layers()):
        if sparse:
            m = arch.moe
            two_i = 2 * m.expert_ffn_hidden_size // etp
            per.append(dtype_bytes * (m.num_experts // ep * two_i * arch.hidden_size
                                      + routed_tokens(arch, tokens, tp, sequence_parallel) * two_i))
        else:
            per.append(tokens * dtype_bytes * 2 * arch.ffn_hidden_size // tp)
    return max(per)


def final_norm_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                     sequence_parallel: bool = False) -> int:
    """What the last stage's final RMSNorm keeps for backward (``4 h`` per token, as a layer's norm)."""
    return tokens * dtype_bytes * 4 * _replicated(arch, tp, sequence_parallel)


def logits_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int, train: bool,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, entropy_grad: bool = False, packed: bool = False) -> int:
    """Peak bytes of the output logits and their loss temporaries on the last stage (per token and
    vocabulary entry on this TP rank, ``d`` the model dtype's bytes; ``c = min(chunk_tokens, tokens)``).

    The output layer writes ``[s, b, V/tp]`` logits and megatron copies them into a contiguous
    ``[b, s, V/tp]`` (both alive for a moment: ``2 d``; a ``packed`` micro-batch is one row, ``b = 1``,
    whose transpose is contiguous already: no copy). The log-probabilities (and the entropy) are read
    ``c`` positions at a time (:func:`cooper_mcore.algo.chunked_logprobs_entropy`), with fp32
    temporaries of ``c x V/tp``: one (``4 B``) for the log-probabilities alone, two with the entropy,
    which the update computes on every micro-batch (its metric). Training keeps the logits for
    backward, which writes their gradient (``d``) beside them a chunk at a time, with one fp32
    temporary (two with a differentiable entropy, ``algo.entropy_coef > 0``).
    """
    vocab = arch.vocab_size // tp
    chunk = min(chunk_tokens, tokens) * vocab
    logits = tokens * vocab * dtype_bytes
    if not train:
        return logits + 4 * chunk if packed else max(2 * logits, logits + 4 * chunk)
    backward = 2 * logits + (8 if entropy_grad else 4) * chunk
    return max(logits + 8 * chunk, backward)
