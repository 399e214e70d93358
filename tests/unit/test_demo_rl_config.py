"""The ``cooper train`` config of each demo RL run, pinned: building it from the shared config
(a base plus per-mode dotted overrides) must give exactly the config the demo has always run."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from cooper_mcore.config.schema import to_dict
from cooper_mcore.demo.config import load_demo_config
from cooper_mcore.demo.pipeline import MODES, Stage, rl_config

PINNED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                      "demo_rl_configs.json")
#: every demo setting rl_config reads, moved off the CooperConfig default it might coincide with
CHANGED = ["rl.steps=11", "rl.prompts_per_step=5", "rl.group_size=3", "rl.temperature=0.9", "rl.max_new_tokens=17",
           "rl.lr=2e-4", "rl.kl_coef=0.02", "rl.kl_kind=k2", "rl.rm_transform=sigmoid_bf16", "rl.adv_std_floor=0.1",
           "rl.micro_batch=7", "rl.eval_every=3", "rl.seed=99", "cooper.rm_lr=3e-3", "cooper.negatives=policy",
           "cooper.rewrite_forms=positive",
           "cooper.negative_pick=first", "cooper.positive_pick=random", "cooper.pairs_per_prompt=2",
           "cooper.anchor_weight=0.25", "eval.temperature=0.6", "eval.top_p=0.9", "eval.k=3",
           "eval.max_new_tokens=19"]
CASES = {"default": (None, []), "full": ("full", []), "changed": (None, CHANGED)}


def _stages() -> tuple[Stage, Stage, Stage]:
    assets = Stage("assets", "a" * 12, "/cache/assets-a", {})
    sft = Stage("sft", "b" * 12, "/cache/sft-b", {})
    rm = Stage("rm", "c" * 12, "/cache/rm-c", SimpleNamespace(checkpoint="train/final"))
    return assets, sft, rm


def built(case: str, mode: str, seed: int) -> dict:
    """``to_dict`` of one RL run's config for a pinned case."""
    preset, overrides = CASES[case]
    assets, sft, rm = _stages()
    return to_dict(rl_config(load_demo_config(preset, overrides), mode, seed, assets, sft, rm, "/cache/rl/run"))


def all_built() -> dict:
    return {f"{case}/{mode}/seed{seed}": built(case, mode, seed) for case in CASES for mode in MODES for seed in (0, 2)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rl_config_of_every_mode_is_the_pinned_one(case):
    with open(PINNED, encoding="utf-8") as f:
        pinned = json.load(f)
    for mode in MODES:
        for seed in (0, 2):
            key = f"{case}/{mode}/seed{seed}"
            assert built(case, mode, seed) == pinned[key], key


def test_paths_reach_the_config_as_written():
    """Folders pass through the dotted overrides unchanged, whatever characters they hold."""
    assets, sft, rm = _stages()
    odd = "/tmp/a dir: with=odd #chars, [1] 'q' \"dq\""
    cfg = rl_config(load_demo_config(), "cooper", 0, assets, sft, rm, odd)
    assert cfg.out == odd and cfg.model.rm_ckpt == "/cache/rm-c/train/final"


if __name__ == "__main__":  # regenerate the pin (only when the demo's runs are meant to change)
    with open(PINNED, "w", encoding="utf-8") as f:
        json.dump(all_built(), f, indent=1, sort_keys=True)
        f.write("\n")
