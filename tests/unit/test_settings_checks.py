"""Every setting checked where it is used, by the same code: floats in the dtype the run computes
them in, integers and seeds within what their users take, the rollout engine's package, and the
same checks for ``cooper train``, ``cooper plan`` and ``cooper rehearse``; a symlinked output folder
whose target is missing. What each command tells the user about a bad setting, a bad number on its
command line or a demo seed are cases of the bad-input tier (``tests/badinput/settings.py``)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from cooper_mcore import cli
from cooper_mcore.cli import main as cli_main
from cooper_mcore.commands import check_output_folder
from cooper_mcore.config import checks
from cooper_mcore.config.checks import MAX_SEED, Elsewhere, Range, config_problems, float_problem
from cooper_mcore.config.presets import shipped_presets
from cooper_mcore.config.schema import load_config
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.planner.report import load_shapes
from cooper_mcore.rehearsal import run as rehearsal_run
from tests.conftest import ROOT

TINY_NORMAL = float(np.finfo(np.float32).tiny)  # numpy as the independent reference of float32's limits
F32_MAX = float(np.finfo(np.float32).max)
QWEN = ROOT / "examples" / "model_configs" / "qwen2.5-1.5b-instruct.json"


def _problems(*overrides: str) -> list[str]:
    """The problems of the default config with ``overrides`` (its missing paths among them)."""
    return config_problems(load_config(None, list(overrides)), 1)


# -- floats in the dtype they are used in ---------------------------------------------------------


def test_a_tis_cap_that_float32_makes_zero_or_infinite_is_refused_naming_it():
    with np.errstate(over="ignore"):
        assert np.float32(1e-300) == 0 and np.isinf(np.float32(1e300))  # what the run would compute with
    tiny, huge = _problems("algo.tis_cap=1e-300"), _problems("algo.tis_cap=1e300")
    assert (f"algo.tis_cap=1e-300 is 0 in float32, the type the run computes it in (its reciprocal and log are "
            f"not finite there): use a magnitude of at least {TINY_NORMAL:.3g} (or null: off)") in tiny
    assert (f"algo.tis_cap=1e+300 overflows float32, the type the run computes it in (at most {F32_MAX:.3g}) "
            "(or null: off)") in huge
    assert not any("tis_cap" in p for p in _problems("algo.tis_cap=2.0") + _problems("algo.tis_cap=null"))


@pytest.mark.parametrize("name, allowed", [("algo.tis_cap", Range(0, low_open=True)), ("optim.lr", Range(0)),
                                           ("rollout.temperature", Range(0)), ("algo.kl_coef", Range(0))])
def test_every_float_setting_is_checked_as_float32_would_hold_it(name, allowed):
    subnormal = TINY_NORMAL / 4  # nonzero in float32, but its reciprocal overflows: 1 / (tiny / 4) > max
    with np.errstate(over="ignore"):
        assert np.float32(subnormal) != 0 and np.isinf(np.float32(1) / np.float32(subnormal))
    assert float_problem(name, subnormal, allowed).startswith(f"{name}={subnormal:g} is the subnormal ")
    assert float_problem(name, TINY_NORMAL, allowed) is None and float_problem(name, 1e30, allowed) is None
    assert "overflows float32" in float_problem(name, 1e39, allowed)
    assert float_problem(name, float("nan"), allowed) == f"{name} must be {allowed.describe()} and finite, got nan"
    assert float_problem(name, float("inf"), allowed) == f"{name} must be {allowed.describe()} and finite, got inf"
    assert float_problem(name, -1.0, allowed) == f"{name} must be {allowed.describe()}, got -1.0"
    assert float_problem(name, None, allowed) is None  # null: off, where the schema allows it


def test_the_config_checks_name_each_bad_float_of_a_run():
    problems = _problems("optim.lr=1e-300", "rm.optim.lr=nan", "rollout.temperature=1e-40", "algo.entropy_coef=1e39",
                         "rollout.sglang_mem_fraction=1.0", "reward.verifier_timeout_s=inf")
    for name in ("optim.lr=1e-300 is 0 in float32", "rm.optim.lr must be >= 0 and finite, got nan",
                 "rollout.temperature=1e-40 is the subnormal", "algo.entropy_coef=1e+39 overflows float32",
                 "rollout.sglang_mem_fraction must be in (0, 1), got 1.0",
                 "reward.verifier_timeout_s must be > 0 and finite, got inf"):
        assert sum(p.startswith(name) for p in problems) == 1, (name, problems)


def test_integers_and_seeds_are_checked_within_what_takes_them():
    problems = _problems("train.steps=100000000000000000000", f"train.seed={MAX_SEED + 1}")
    assert "train.steps=100000000000000000000 does not fit in a 64-bit integer" in problems
    assert (f"train.seed must be in 0..{MAX_SEED} (a seed every random generator takes), got {MAX_SEED + 1}"
            in problems)
    assert not any("seed" in p for p in _problems(f"train.seed={MAX_SEED}"))


# -- the rollout engine's package -------------------------------------------------------------------


def test_sglang_without_the_package_is_refused_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(checks, "sglang_installed", lambda: False)
    hint = ("rollout.engine=sglang needs SGLang, which is not installed here: pip install 'sglang==0.5.23' (also in "
            "cooper_mcore's gpu extra); or set rollout.engine=hf (the transformers engine)")
    assert hint not in _problems("rollout.engine=hf")  # and in rollout.engine=sglang's: a bad-input case
    cfg = load_config(None, ["rollout.engine=sglang"])  # away from its machines the package is not looked for
    assert hint not in config_problems(cfg, 8, Elsewhere(None, None))
    monkeypatch.setattr(checks, "sglang_installed", lambda: True)
    assert hint not in _problems("rollout.engine=sglang")


# -- cooper plan and cooper rehearse run the trainer's checks ----------------------------------------


def test_plan_checks_the_run_as_the_trainer_does():
    """``cooper plan`` checks away from the machines (:class:`Elsewhere`) with the shapes it found: what it
    refuses (a bad-input case: ``parallel.ep=2`` on a dense model) is the trainer's list, at the planned world."""
    hf = json.loads(QWEN.read_text())
    policy, rm = ArchSpec.from_hf_config(hf, "causal_lm"), ArchSpec.from_hf_config(hf, "reward")
    cfg = load_config(None, ["parallel.ep=2", "model.policy_ckpt=p", "model.rm_ckpt=r", "rm.negatives=perturb"])
    assert [p for p in config_problems(cfg, 8, Elsewhere(policy, rm)) if "parallel.ep" in p] == [
        "parallel.ep=2 needs a mixture-of-experts model, but model.policy_ckpt (p) and model.rm_ckpt (r) are dense"]


def test_rehearse_validates_the_presets_own_engine_settings_before_swapping_them(tmp_path, caplog, monkeypatch):
    """A preset that passes the trainer's checks is rehearsed with the transformers engine where SGLang is not
    installed, saying so in one line (its bad settings are refused first: a bad-input case)."""
    out = tmp_path / "rh"

    def stop(plan, *args, **kwargs):
        raise ValueError(f"stopped before the runs; engine {plan.cfg.rollout.engine}")

    monkeypatch.setattr(rehearsal_run, "rehearse", stop)
    monkeypatch.setattr(rehearsal_run, "sglang_runs_here", lambda: False)
    with caplog.at_level(logging.INFO):
        assert cli_main(["rehearse", "--config", "qwen2.5-1.5b_8xh100", "--out", str(out)]) == 2
    said = [r.getMessage() for r in caplog.records if "swaps" in r.getMessage()]
    assert said == ["the preset's settings pass the trainer's checks; the rehearsal swaps rollout.engine: sglang -> hf "
                    "(SGLang is not installed here; the transformers engine models its release and weight-push "
                    "semantics)"]
    assert "stopped before the runs; engine hf" in caplog.text


def test_every_shipped_preset_passes_the_checks_away_from_its_machines():
    for name, path in shipped_presets().items():
        if name.startswith("jobs/") or name.startswith("tiny_cpu"):  # their shapes are made by `cooper tiny-assets`
            continue
        cfg = load_config(str(path))
        policy, rm, _ = load_shapes(cfg)
        assert config_problems(cfg, None, Elsewhere(policy, rm)) == [], name


# -- numbers on the command line ---------------------------------------------------------------------


def test_the_clis_seed_limit_is_the_checks():
    """cli.py imports no library module: its copy of the largest seed (its --seed type) must agree."""
    assert cli.MAX_SEED == MAX_SEED


# -- a symlinked output folder (one whose target cannot be made: a bad-input case) ------------------


def test_a_symlinked_out_whose_target_is_missing_gets_it_created(tmp_path, caplog):
    link, target = tmp_path / "run", tmp_path / "scratch" / "runs" / "r1"
    os.symlink(target, link)
    with caplog.at_level(logging.INFO, logger="cooper_mcore"):
        check_output_folder(str(link))
    assert target.is_dir() and link.resolve() == target
    assert f"{link} is a symlink to {target}, which did not exist: created it" in caplog.text
    check_output_folder(str(link))  # now an ordinary folder through its link
