"""A test-only stand-in for ``sgl_kernel`` (SGLang's compiled kernels), for running SGLang 0.5.23
on its CPU backend in tests/sglang.

The published ``sglang-kernel`` wheels are CUDA builds (``import sgl_kernel`` needs
``libcuda.so.1``) and no CPU build is published. SGLang's CPU backend (``SGLANG_USE_CPU_ENGINE=1``)
falls back to plain PyTorch in its model layers when the ``torch.ops.sgl_kernel`` CPU ops are
absent (``cpu_has_amx_support()`` is then False; this module registers no torch ops), but some
modules import ``*_cpu`` kernel functions from ``sgl_kernel`` at import time.

This module:

* makes every name that SGLang 0.5.23 imports from ``sgl_kernel`` and its submodules importable
  (:data:`NAMES`, checked against the installed sglang by ``tests/sglang/test_stand_in.py``);
* raises ``NotImplementedError`` naming the op when any of them is called, except
* ``sgl_kernel.scalar_type`` (``ScalarType``, ``scalar_types``: pure-Python data that SGLang reads
  at import time, no kernels) is the real module of the installed ``sglang-kernel`` wheel,
  loaded by its file path;
* the ops a tiny Qwen2 calls on the CPU path, written here in plain torch from the semantics of
  the Triton kernels they replace (:data:`IMPLEMENTED`);
* SGLang's routed-experts capture gets a plain host buffer where SGLang pins one with
  ``cudaHostRegister`` (:data:`HOST_ALLOC_MODULE`), so the rest of its capture runs on CPU.

It is put first on ``sys.path`` (and ``PYTHONPATH``) by ``tests/sglang/conftest.py`` only; the
package itself never imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable

import torch

__version__ = "0.0.0+cooper-test-stand-in"

# Every name SGLang 0.5.23 imports from sgl_kernel (``from sgl_kernel[.sub] import name``), by module.
NAMES: dict[str, tuple[str, ...]] = {
    "sgl_kernel": (
        "apply_token_bitmask_inplace_cuda", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
        "assign_req_to_token_pool_cpu", "awq_dequantize", "biased_topk", "build_draft_decode_metadata_cpu",
        "build_tree_kernel_efficient", "build_tree_kernel_efficient_cpu", "compress_norm_rope_store", "concat_mla_k",
        "copy_all_layer_kv_cache_cpu", "cutlass_w4a8_moe_mm", "es_fp8_blockwise_scaled_grouped_mm",
        "es_sm100_mxfp8_blockscaled_grouped_mm", "es_sm100_mxfp8_blockscaled_grouped_quant",
        "fast_topk_transform_fused", "fast_topk_transform_ragged_fused", "fast_topk_v2",
        "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "flash_compress128_decode",
        "flash_compress128_prefill", "flash_compress4_decode", "flash_compress4_prefill", "flash_mla_decode",
        "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size", "flash_mla_prefill",
        "flash_mla_prefill_get_workspace_size", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
        "fp8_blockwise_scaled_grouped_mm", "fp8_mqa_logits", "fp8_paged_mqa_logits", "fp8_paged_mqa_logits_triton",
        "fused_add_rmsnorm", "fused_experts", "fused_hc_head", "fused_inplace_qknorm_rope",
        "fused_k_norm_rope_flashmla", "fused_q_indexer_rope_hadamard_quant", "fused_q_norm_rope",
        "fused_qk_rope_with_cos_sin_cache_inplace", "gdn_attention", "gelu_and_mul", "gelu_quick",
        "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "get_cutlass_w4a8_moe_mm_data",
        "hadamard_transform", "hash_topk", "hc_post", "hc_split_sinkhorn", "infllmv2_attn_stage1", "int8_scaled_mm",
        "load_cache_to_device_buffer_dsv4_mla", "load_cache_to_device_buffer_mla", "max_pooling_1d_varlen",
        "merge_state_v2", "metal", "mhc_fused_post_pre", "mhc_pre", "min_p_sampling_from_probs",
        "minimax_decode_topk", "moe_fused_gate", "moe_sum", "moe_sum_reduce", "multimodal_rotary_embedding",
        "plan_compress_decode", "plan_compress_decode_legacy", "plan_compress_prefill",
        "plan_compress_prefill_legacy", "rmsnorm", "rotary_embedding", "rotate_input_ids_cpu",
        "sgl_per_tensor_quant_fp8", "sgl_per_token_quant_fp8", "shuffle_rows", "silu_and_mul",
        "silu_and_mul_clamp", "spatial", "store_cache_xpu", "top_k", "top_k_renorm_prob",
        "top_k_top_p_sampling_from_probs", "top_p_renorm_prob", "topk_sigmoid", "topk_softmax",
        "transfer_cache_dsv4_mla", "tree_speculative_sampling_target_only", "verify_tree_greedy",
        "verify_tree_greedy_cpu", "weak_ref_tensor",
    ),
    "sgl_kernel.allreduce": (),
    "sgl_kernel.elementwise": ("copy_to_gpu_no_ce",),
    "sgl_kernel.flash_attn": ("build_bidirectional_block_ids", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                              "get_scheduler_metadata"),
    "sgl_kernel.kvcacheio": (
        "get_device_accessible_ptr", "transfer_embedding_ranges_direct", "transfer_kv_all_layer",
        "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph",
        "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct", "transfer_kv_per_layer",
        "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    ),
    "sgl_kernel.mamba": ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"),
    "sgl_kernel.quantization": ("ggml_dequantize", "ggml_moe_a8", "ggml_moe_a8_vec", "ggml_mul_mat_a8",
                                "ggml_mul_mat_vec_a8"),
    "sgl_kernel.speculative": ("reconstruct_indices_from_tree_mask",),
    "sgl_kernel.utils": ("is_arch_support_pdl",),
}


# Pure-Python modules of the installed sglang-kernel wheel, used as they are (no compiled code).
REAL_MODULES = ("sgl_kernel.scalar_type",)


class StandInNotImplementedError(NotImplementedError):
    """An ``sgl_kernel`` op the stand-in does not implement was called."""


def _unimplemented(qualname: str) -> Callable[..., None]:
    def op(*args: object, **kwargs: object) -> None:
        raise StandInNotImplementedError(
            f"{qualname} is not implemented by the test stand-in for sgl_kernel "
            "(tests/sglang/stand_in/sgl_kernel); SGLang reached a kernel this CPU test tier does not provide")

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    return op


# -- implemented ops (plain torch, semantics of the Triton kernels SGLang uses on GPU) --------
def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Request ``i`` gets ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` =
    the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the requests' slots
    are packed one after another), as ``assign_req_to_token_pool`` in
    ``sglang/srt/mem_cache/allocation.py`` does.
    """
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


IMPLEMENTED: dict[str, Callable[..., object]] = {
    "sgl_kernel.assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
}


def _populate() -> None:
    """Define every name of :data:`NAMES`: the implemented ops, a raising stub for the others.
    Submodules are registered in ``sys.modules``, so ``from sgl_kernel.flash_attn import x`` works."""
    this = sys.modules[__name__]
    for modname, names in NAMES.items():
        if modname == __name__:
            mod = this
        else:
            mod = types.ModuleType(modname, f"stand-in for {modname} (see {__name__})")
            sys.modules[modname] = mod
            setattr(this, modname.rsplit(".", 1)[-1], mod)
        for name in names:
            qualname = f"{modname}.{name}"
            setattr(mod, name, IMPLEMENTED.get(qualname) or _unimplemented(qualname))
    dist = importlib.metadata.distribution("sglang-kernel")
    for modname in REAL_MODULES:
        path = dist.locate_file(modname.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        setattr(this, modname.rsplit(".", 1)[-1], mod)



# -- SGLang's capture buffers on CPU -----------------------------------------------------------
#: SGLang 0.5.23 allocates the host buffer of its state capturers (routed experts) with
#: ``ALLOC_MEMORY_FUNCS[device]`` of this module; it has no ``"cpu"`` entry, and the default pins the
#: buffer with ``cudaHostRegister``, which dies without a driver.
HOST_ALLOC_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _alloc_unpinned(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator: object,
                    registration_granularity_bytes: object = None) -> torch.Tensor:
    """The buffer ``alloc_with_host_register`` allocates, without pinning it (CPU memory needs none)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _host_buffers_on_cpu(module: types.ModuleType) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_host_buffers_on_cpu` on :data:`HOST_ALLOC_MODULE` right after SGLang imports it
    (in every SGLang process: each imports this stand-in through ``PYTHONPATH``)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != HOST_ALLOC_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            _host_buffers_on_cpu(module)

        spec.loader.exec_module = exec_module
        return spec


_populate()
if HOST_ALLOC_MODULE in sys.modules:
    _host_buffers_on_cpu(sys.modules[HOST_ALLOC_MODULE])
else:
    sys.meta_path.insert(0, _PatchAfterImport())
