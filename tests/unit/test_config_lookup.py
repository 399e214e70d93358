"""`cooper config KEY`: a lookup of settings (value and doc), fast, with a did-you-mean; an override
without ``=`` is refused rather than read as null; the config library's errors are one line that
names the key."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from cooper_mcore.cli import main as cli_main
from cooper_mcore.config.schema import AlgoConfig, field_docs, load_config
from tests.conftest import ROOT

TINY = str(ROOT / "examples" / "tiny_cpu.yaml")


def _shown(out: str) -> dict[str, tuple[str, str]]:
    """``{key: (value, doc)}`` of a listing."""
    rows = [line.split("  # ", 1) for line in out.strip().splitlines()]
    return {kv.split("=", 1)[0]: (kv.split("=", 1)[1].strip(), doc) for kv, doc in rows}


def test_a_key_shows_its_value_and_doc_only(capsys):
    assert cli_main(["config", "algo.tis_cap"]) == 0
    assert _shown(capsys.readouterr().out) == {"algo.tis_cap": ("null", field_docs(AlgoConfig)["tis_cap"])}


def test_several_keys_and_a_section_from_a_preset_with_overrides(capsys):
    assert cli_main(["config", "--config", TINY, "rollout.group_size", "algo.kl_coef=0.5", "algo", "algo.kl_coef"]) == 0
    shown = _shown(capsys.readouterr().out)
    algo = [f"algo.{name}" for name in field_docs(AlgoConfig)]
    assert list(shown) == ["rollout.group_size", *algo]  # each once, in the order asked
    assert shown["rollout.group_size"][0] == "4" and shown["algo.kl_coef"][0] == "0.5"  # the preset's; the override


def test_an_unknown_key_gets_a_did_you_mean(caplog, capsys):
    with caplog.at_level(logging.ERROR):
        assert cli_main(["config", "tis_cap", "algo.kl_coeff"]) == 2
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert error == "unknown setting 'tis_cap' (did you mean algo.tis_cap?); `cooper config` lists every setting"
    assert capsys.readouterr().out == ""
    caplog.clear()
    assert cli_main(["config", "--job", "sft", "train.seeed"]) == 2  # another job's settings
    assert "unknown setting 'train.seeed' (did you mean train.seed?)" in caplog.text


def test_the_lookup_imports_neither_torch_nor_megatron():
    """A lookup answers in a fraction of a second: it needs the schema only."""
    code = ("import sys\n"
            "from cooper_mcore.cli import main\n"
            "assert main(['config', 'algo.tis_cap']) == 0\n"
            "print(sorted(m for m in ('megatron', 'torch', 'transformers', 'wandb') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_an_override_without_a_value_is_refused_not_read_as_null():
    with pytest.raises(ValueError) as info:
        load_config(None, ["algo.tis_cap"])
    assert str(info.value) == ("override 'algo.tis_cap' has no '=': write algo.tis_cap=VALUE (null to unset); "
                               "`cooper config algo.tis_cap` shows its value and doc")
    assert load_config(None, ["algo.tis_cap=null"]).algo.tis_cap is None


@pytest.mark.parametrize("override, message", [
    ("algo.kl_coef=abc", "algo.kl_coef: Value 'abc' of type 'str' could not be converted to Float"),
    ("train.steps=1.5", "train.steps: Value '1.5' of type 'float' could not be converted to Integer"),
    ("logging.wandb=maybe", "logging.wandb: Value 'maybe' is not a valid bool (type str)"),
    ("train.steps=null", "train.steps: Incompatible value 'None' for field of type 'int'"),
    ("rollout.stop=abc", "rollout.stop: a list is expected: write rollout.stop=[a,b] ([] for none)"),
    ("rm.rewrite_kinds=[bad]", "rm.rewrite_kinds[0]: Invalid value 'bad', expected one of ['step', 'copy', 'final']"),
    ("algo.kl_coeff=1", "unknown setting algo.kl_coeff (did you mean algo.kl_coef?)"),
    ("algo.kl_coef.x=1", "algo.kl_coef is a setting, not a section: write algo.kl_coef=VALUE"),
    ("algo=1", "algo is a section, not a setting: name one of its settings (algo.clip_low, algo.clip_high, "
               "algo.clip_ratio_c, ...)"),
    ("=1", "a setting without a name (key=value is expected)"),
    ("data.template={question}", "the value of data.template reads as a YAML mapping; quote it: "
                                 "data.template='{question}'"),
])
def test_config_library_errors_are_one_line_naming_the_key(override, message, caplog):
    with caplog.at_level(logging.ERROR):
        assert cli_main(["config", override]) == 2
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert error.getMessage() == f"bad config (override {override!r}): {message}"


@pytest.mark.parametrize("text, message", [
    ("algo:\n  kl_coef: ${nowhere}\n", "algo.kl_coef: Interpolation key 'nowhere' not found"),
    ("train:\n  steps: ${algo.kl_coef}\n", "train.steps: While dereferencing interpolation '${algo.kl_coef}': "
                                           "Value '0.001' of type 'float' could not be converted to Integer"),
    ("algo: 3\n", "algo is a section, not a setting: name one of its settings (algo.clip_low, algo.clip_high, "
                  "algo.clip_ratio_c, ...)"),
    ("algo:\n  tis_cp: 2\n", "unknown setting algo.tis_cp (did you mean algo.tis_cap?)"),
])
def test_a_presets_library_errors_are_one_line_too(text, message, tmp_path, caplog):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    with caplog.at_level(logging.ERROR):
        assert cli_main(["config", "--config", str(preset)]) == 2
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert error.getMessage() == f"bad config ({preset}): {message}"
