"""Checkpoints move between layer specs whose modules differ in ``_extra_state``.

Transformer Engine's modules (its norms among them: ``q_layernorm``, ``k_layernorm``,
``final_layernorm``) carry ``_extra_state`` that the torch-native spec's do not; the converter
writes checkpoints with the torch-native spec. TE is not installed on CPU machines, so the TE side
is modelled here: a norm given ``get_extra_state``/``set_extra_state`` asks for an object the
checkpoint lacks (megatron-core refused that load with "Missing key in checkpoint state_dict"),
and a checkpoint written with it holds an object a plain model does not ask for.
"""

from __future__ import annotations

import io

import torch

from cooper_mcore.checkpoint.model import load_model_checkpoint, read_meta, save_model_checkpoint
from cooper_mcore.models.builder import build_model
from cooper_mcore.parallel import ParallelConfig, single_process_world


def _with_extra_state(module: torch.nn.Module) -> None:
    """Give ``module`` TE-like extra state (a class-level get/set_extra_state, as torch requires)."""
    def get_extra_state(self):
        buf = io.BytesIO()
        torch.save({"amax_history": torch.ones(2)}, buf)
        return buf

    def set_extra_state(self, state):
        self.loaded_extra_state = state

    cls = module.__class__
    module.__class__ = type(f"TELike{cls.__name__}", (cls,), {"get_extra_state": get_extra_state,
                                                             "set_extra_state": set_extra_state})


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def test_extra_state_missing_from_the_checkpoint_is_not_an_error(tiny_models):
    _, ckpt = tiny_models[("qwen3", "causal_lm")]  # q/k norms: where TE adds extra state the converter lacks
    with single_process_world():
        arch, _, dtype = read_meta(ckpt)
        plain = build_model(arch, ParallelConfig(), dtype=dtype, init_weights=False)
        load_model_checkpoint(plain, ckpt, arch)
        te_like = build_model(arch, ParallelConfig(), dtype=dtype, init_weights=False)
        _with_extra_state(te_like.decoder.final_layernorm)
        _with_extra_state(te_like.decoder.layers[0].self_attention.q_layernorm)
        load_model_checkpoint(te_like, ckpt, arch)
    a, b = _weights(plain), _weights(te_like)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_extra_state_in_the_checkpoint_loads_into_a_model_without_it(tiny_models, tmp_path):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    out = str(tmp_path / "with_extra")
    (tmp_path / "with_extra").mkdir()
    with single_process_world():
        arch, hf_config, dtype = read_meta(ckpt)
        te_like = build_model(arch, ParallelConfig(), dtype=dtype, init_weights=False)
        _with_extra_state(te_like.decoder.final_layernorm)
        load_model_checkpoint(te_like, ckpt, arch)
        save_model_checkpoint(te_like, out, arch, hf_config, dtype)
        plain = build_model(arch, ParallelConfig(), dtype=dtype, init_weights=False)
        load_model_checkpoint(plain, out, arch)
        reloaded = build_model(arch, ParallelConfig(), dtype=dtype, init_weights=False)
        _with_extra_state(reloaded.decoder.final_layernorm)
        load_model_checkpoint(reloaded, out, arch)
        assert hasattr(reloaded.decoder.final_layernorm, "loaded_extra_state")  # its own state came back
    a, b = _weights(te_like), _weights(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
