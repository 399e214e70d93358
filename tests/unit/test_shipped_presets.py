"""Presets and model configs found by name (cooper_mcore.config.presets): a path that exists wins,
else the shipped file of that name; an unknown name is an error that lists the shipped ones."""

from __future__ import annotations

import os

import pytest

from cooper_mcore.config.presets import (
    resolve_model_config,
    resolve_preset,
    shipped_model_config,
    shipped_presets,
)
from cooper_mcore.config.schema import SFTConfig, load_config
from cooper_mcore.planner.report import load_shapes
from tests.conftest import ROOT


def test_every_preset_of_examples_is_shipped_by_name():
    names = shipped_presets()
    on_disk = {os.path.relpath(os.path.join(d, f), ROOT / "examples")[:-5]
               for d, _, fs in os.walk(ROOT / "examples") for f in fs if f.endswith(".yaml")}
    assert set(names) == on_disk
    assert {"tiny_cpu", "jobs/sft_tiny_cpu", "jobs/verify_rm_tiny_cpu"} <= set(names)


@pytest.mark.parametrize("given", ["tiny_cpu", "tiny_cpu.yaml", "examples/tiny_cpu.yaml"])
def test_a_preset_by_name(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no examples/ here: the shipped one is found
    assert resolve_preset(given) == str(shipped_presets()["tiny_cpu"])
    assert load_config(given).rollout.group_size == 4


def test_a_job_preset_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("jobs/sft_tiny_cpu", cls=SFTConfig).train.steps > 0


def test_a_file_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_cpu.yaml").write_text("rollout:\n  group_size: 6\n")
    assert load_config("tiny_cpu.yaml").rollout.group_size == 6
    assert load_config("tiny_cpu").rollout.group_size == 4


def test_an_unknown_preset_names_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match=r"'no_such' not found.*shipped: .*tiny_cpu"):
        resolve_preset("no_such")


def test_model_configs_by_name_and_for_a_placeholder_path():
    path = resolve_model_config("qwen2.5-1.5b-instruct")
    assert path.endswith("model_configs/qwen2.5-1.5b-instruct.json")
    assert resolve_model_config("examples/model_configs/qwen2.5-1.5b-instruct.json").endswith(".json")
    assert shipped_model_config("/models/Qwen2.5-1.5B-Instruct") == path
    assert shipped_model_config("/models/Unknown-Model") is None
    with pytest.raises(FileNotFoundError, match=r"shipped: .*qwen3-4b"):
        resolve_model_config("no-such-model")


def test_the_planner_finds_a_presets_shape_without_the_model():
    """`cooper plan --config qwen2.5-1.5b_8xh100` works before the model is downloaded."""
    cfg = load_config("qwen2.5-1.5b_8xh100")
    policy, _, notes = load_shapes(cfg)
    assert (policy.hidden_size, policy.num_layers) == (1536, 28)
    assert any("shipped qwen2.5-1.5b-instruct.json" in n for n in notes)
