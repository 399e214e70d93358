"""The shapes of a run whose models are built with random weights (``model.init: random``).

Such a run reads no checkpoint: the policy's shape is the HF config ``model.policy_config`` names (a
file, a folder or a shipped name; default ``model.policy_hf``'s ``config.json``), the reward
model's is ``model.rm_config``'s or, by default, the policy's backbone with a scalar head (VerifyRM
is a fine-tuned model of the policy's size, as ``cooper plan`` assumes too). The trainer
(:mod:`cooper_mcore.rl.setup`), the config checks and the planner read the shapes here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from cooper_mcore.config.presets import read_model_config
from cooper_mcore.config.schema import ModelConfig
from cooper_mcore.models.arch import ArchSpec


@dataclass(frozen=True)
class ModelShape:
    """One model's shape.

    Attributes:
        arch: the architecture the builder makes.
        hf_config: the HF ``config.json`` it corresponds to (the engine's model is built from the
            policy's; both are written into checkpoints as a converted model's are).
        source: where it came from, for messages (a setting and its value).
    """

    arch: ArchSpec
    hf_config: dict[str, Any]
    source: str


def reward_hf_config(policy: dict[str, Any]) -> dict[str, Any]:
    """The HF config of a reward model with the backbone of the policy config ``policy``: its
    ``...ForSequenceClassification`` with one label and no tied embeddings."""
    arch = ArchSpec.from_hf_config(policy, "causal_lm")
    out = {k: v for k, v in policy.items() if k not in ("id2label", "label2id")}
    out.update(architectures=[dataclasses.replace(arch, model_type="reward").hf_architecture()], num_labels=1,
               tie_word_embeddings=False)
    return out


def _shape(setting: str, given: str, model_type: str) -> ModelShape:
    try:
        hf = read_model_config(given)
        return ModelShape(ArchSpec.from_hf_config(hf, model_type), hf, f"{setting}={given}")
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{setting}={given!r}: {e}") from None


def random_init_shapes(model: ModelConfig, uses_rm: bool) -> tuple[ModelShape, Optional[ModelShape]]:
    """The policy's and (``uses_rm``) the reward model's shapes of a run with ``model.init: random``.

    Raises:
        ValueError: a config that cannot be found or read, or an architecture the builder does not
            support (naming the setting).
    """
    if model.policy_config:
        policy = _shape("model.policy_config", model.policy_config, "causal_lm")
    elif model.policy_hf and os.path.isfile(os.path.join(model.policy_hf, "config.json")):
        policy = _shape("model.policy_hf", model.policy_hf, "causal_lm")
    else:
        raise ValueError(f"model.init=random needs the policy's shape: set model.policy_config (a config.json or a "
                         f"shipped name such as qwen2.5-1.5b-instruct); model.policy_hf={model.policy_hf!r} has no "
                         "config.json")
    if not uses_rm:
        return policy, None
    if model.rm_config:
        return policy, _shape("model.rm_config", model.rm_config, "reward")
    hf = reward_hf_config(policy.hf_config)
    return policy, ModelShape(ArchSpec.from_hf_config(hf, "reward"), hf, f"the policy's backbone ({policy.source})")
