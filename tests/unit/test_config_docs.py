"""The typed config: every setting documented next to its field and listed by `cooper config --show`;
choices are Literals or enums that agree with the code that interprets them."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from cooper_mcore.algo import pairs, reward_transforms, vocab
from cooper_mcore.algo.losses import KL_ESTIMATORS
from cooper_mcore.cli import main as cli_main
from cooper_mcore.config import schema as C
from cooper_mcore.config.checks import config_problems
from cooper_mcore.data.mathgen import STYLES
from cooper_mcore.demo.config import DemoConfig, load_demo_config
from cooper_mcore.negatives import assistant, rewrites
from cooper_mcore.negatives.pairs import NEGATIVE_KINDS
from cooper_mcore.negatives.rewrites import REWRITE_KINDS
from tests.conftest import ROOT


def _sections(cls: type) -> list[type]:
    out = [cls]
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out += _sections(hint)
    return out


def test_every_setting_has_a_one_line_doc():
    for cls in _sections(C.CooperConfig):
        docs = C.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: fields without a doc: {missing}"


def test_config_show_lists_every_key_with_its_value_and_doc(capsys):
    assert cli_main(["config", "--show", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
                     "algo.kl_coef=0.02"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    keys = [k for k, _, _ in C.describe(C.CooperConfig())]
    assert [ln.split("=", 1)[0] for ln in lines] == keys
    shown = dict(ln.split("  # ")[0].split("=", 1) for ln in lines)
    assert shown["algo.kl_coef"].strip() == "0.02" and shown["reward.mode"].strip() == '"cooper"'
    assert shown["model.policy_ckpt"].strip() == '"runs/tiny_assets/policy_mcore"'  # from the preset
    assert all("  # " in ln and ln.split("  # ", 1)[1].strip() for ln in lines)


def test_the_dual_clip_is_on_by_default_and_listed(capsys):
    """``algo.clip_ratio_c``: verl's and the reference implementation's 3.0, shown by `cooper config`."""
    assert C.AlgoConfig().clip_ratio_c == 3.0
    assert cli_main(["config", "--show", "--config", str(ROOT / "examples" / "tiny_cpu.yaml")]) == 0
    shown = {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in capsys.readouterr().out.strip().splitlines()}
    value, doc = shown["algo.clip_ratio_c"].split("  # ")
    assert value.strip() == "3.0" and "null" in doc


def test_choices_agree_with_the_code_that_reads_them():
    assert set(typing.get_args(C.KLKind)) == set(KL_ESTIMATORS)
    assert set(typing.get_args(C.NegativeKind)) == set(NEGATIVE_KINDS)
    assert set(typing.get_args(C.RewriteKind)) == set(REWRITE_KINDS)
    assert set(typing.get_args(C.AnswerStyle)) == set(STYLES)
    # the library's own choices, written again in the schema so that it loads without torch
    for ours, theirs in ((C.RewardTransform, reward_transforms.RewardTransform), (C.PositivePick, pairs.PositivePick),
                         (C.NegativePick, pairs.NegativePick), (C.AssistantPrompt, assistant.AssistantPrompt),
                         (C.RewriteForms, rewrites.RewriteForms)):
        assert typing.get_args(ours) == typing.get_args(theirs)
    assert C.DEFAULT_CHUNK_TOKENS == vocab.DEFAULT_CHUNK_TOKENS
    assert [(m.value, m.uses_rm, m.trains_rm) for m in C.RewardMode] == [
        ("rule", False, False), ("static_rm", True, False), ("cooper", True, True)]


def test_bad_choices_from_python_or_yaml_are_reported_with_the_rest():
    cfg = C.CooperConfig()
    cfg.algo.kl_kind = "k9"  # a config built in Python bypasses OmegaConf's checks
    cfg.rm.rewrite_kinds = ["step", "shuffle"]
    problems = config_problems(cfg, 1)
    assert "algo.kl_kind must be one of ('k1', 'kl', 'k2', 'mse', 'k3', 'low_var_kl', 'abs'), got 'k9'" in problems
    assert "rm.rewrite_kinds must hold some of ('step', 'copy', 'final'), got 'shuffle'" in problems
    loaded = C.load_config(None, ["reward.mode=cooperative", "rollout.engine=vllm"])
    problems = config_problems(loaded, 1)
    assert "reward.mode must be one of ('rule', 'static_rm', 'cooper'), got 'cooperative'" in problems
    assert "rollout.engine must be one of ('hf', 'sglang'), got 'vllm'" in problems
    with pytest.raises(ValueError, match="train.steps"):  # a type error is an error at once
        C.load_config(None, ["train.steps=many"])
    with pytest.raises(ValueError, match="no_such_key"):
        C.load_config(None, ["algo.no_such_key=1"])


def test_reward_mode_from_a_string_in_python():
    assert C.RewardConfig(mode="static_rm").mode is C.RewardMode.static_rm
    with pytest.raises(ValueError, match="reward.mode must be one of"):
        C.RewardConfig(mode="nope")


def test_choice_properties_read_the_settings_they_name():
    cfg = C.load_config(None, ["rollout.engine=sglang", "rm.question=question", "eval.verifier=arithmetic_oracle"])
    assert cfg.rollout.uses_sglang and not C.RolloutConfig().uses_sglang
    assert not cfg.rm.question_as_prompted and C.RMUpdateConfig().question_as_prompted
    assert cfg.eval.uses_oracle and not C.EvalConfig().uses_oracle
    assert C.CooperConfig().uses_assistant  # the defaults: cooper mode, assistant negatives
    for overrides in (["reward.mode=static_rm"], ["rm.negatives=policy"], ["reward.mode=cooperative"]):
        assert not C.load_config(None, overrides).uses_assistant, overrides


def test_every_demo_setting_has_a_one_line_doc_and_choices_are_checked():
    """The demo's config is a config of sections like the trainer's: documented fields, checked choices."""
    for cls in _sections(DemoConfig):
        docs = C.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: fields without a doc: {missing}"
    keys = [k for k, _, doc in C.describe(load_demo_config(None, ["rl.steps=3"])) if doc]
    assert "rl.steps" in keys and "cooper.negative_pick" in keys
    with pytest.raises(ValueError, match="rl.kl_kind must be one of"):
        load_demo_config(None, ["rl.kl_kind=k9"])


def test_demo_show_lists_every_demo_setting_with_its_doc(capsys):
    assert cli_main(["demo", "--show", "--full", "rl.steps=7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("=", 1)[0] for ln in lines] == [k for k, _, _ in C.describe(DemoConfig())]
    shown = dict(ln.split("  # ")[0].split("=", 1) for ln in lines)
    assert shown["rl.steps"].strip() == "7" and shown["seeds"].strip() == "[0, 1, 2]"  # override, --full
    assert all(ln.split("  # ", 1)[1].strip() for ln in lines)
