"""`cooper config KEY`: a lookup of settings (value and doc), fast; an override without ``=`` is
refused rather than read as null. An unknown key's did-you-mean and the config library's errors, one
line naming the key, are cases of the bad-input tier (``tests/badinput/settings.py``)."""

from __future__ import annotations

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
