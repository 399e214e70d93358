"""``cooper sft`` and ``cooper train-rm`` take a typed job config from a YAML preset
(``examples/jobs/``) and dotted overrides, as ``cooper train`` does; ``cooper config --job`` lists
their settings. Their refusals (no --ckpt, an output another run holds) are cases of the bad-input
tier (``tests/badinput/``)."""

from __future__ import annotations

import json

import pytest

from cooper_mcore.cli import main
from cooper_mcore.config import schema as C
from cooper_mcore.metric_names import MetricKey as K
from tests.conftest import ROOT

SFT_PRESET = str(ROOT / "examples" / "jobs" / "sft_tiny_cpu.yaml")
RM_PRESET = str(ROOT / "examples" / "jobs" / "verify_rm_tiny_cpu.yaml")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from cooper_mcore.demo.assets import build_tiny_assets

    return build_tiny_assets(str(tmp_path_factory.mktemp("job_assets")), n_train=16, n_eval=8, sft_steps=0)


@pytest.mark.parametrize("job, cls, preset", [("sft", C.SFTConfig, SFT_PRESET),
                                              ("train-rm", C.VerifyRMConfig, RM_PRESET)])
def test_config_lists_a_jobs_settings_from_its_preset(job, cls, preset, capsys):
    assert main(["config", "--job", job, "--config", preset, "train.seed=7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("=", 1)[0] for ln in lines] == [k for k, _, _ in C.describe(cls())]
    shown = {ln.split("=", 1)[0]: ln.split("=", 1)[1].split("  # ")[0].strip() for ln in lines}
    assert shown["train.seed"] == "7" and shown["ckpt"].startswith('"runs/tiny_assets/')
    assert all(ln.split("  # ", 1)[1].strip() for ln in lines)


def test_job_sections_are_documented_and_presets_load():
    for cls in (C.SFTConfig, C.VerifyRMConfig):
        for section in [cls] + [type(v) for _, v in vars(cls()).items() if hasattr(v, "__dataclass_fields__")]:
            docs = C.field_docs(section)
            assert all(docs.get(f) for f in section.__dataclass_fields__), section
    assert C.load_config(SFT_PRESET, ["data.mix_wrong=0.5"], cls=C.SFTConfig).data.mix_wrong == 0.5
    assert C.load_config(RM_PRESET, cls=C.VerifyRMConfig).data.label_key == "gold_correct"
    with pytest.raises(ValueError, match="no_such"):
        C.load_config(RM_PRESET, ["train.no_such=1"], cls=C.VerifyRMConfig)
    assert set(C.JOB_CONFIGS) == {"train", "sft", "train-rm"}


def test_cooper_sft_from_its_preset(assets, tmp_path, capsys):
    out = tmp_path / "policy"
    rc = main(["sft", "--config", SFT_PRESET, "--ckpt", assets["policy_ckpt"], "--out", str(out), "train.steps=2",
               "data.num_examples=8", "train.global_batch_size=4", "train.micro_batch_size=4"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["out"] == str(out) and (out / "cooper_model.json").is_file()


def test_cooper_train_rm_from_its_preset(assets, tmp_path, capsys):
    out = tmp_path / "rm"
    rc = main(["train-rm", "--config", RM_PRESET, "--ckpt", assets["rm_ckpt"], "--out", str(out), "train.epochs=1",
               f"data.train_path={ROOT / 'tests' / 'fixtures' / 'verifybench_tiny.jsonl'}",
               f"data.eval_path={ROOT / 'tests' / 'fixtures' / 'verifybench_tiny.jsonl'}"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if K.RM_TRAIN_LOSS in x]
    assert [x["step"] for x in train] == list(range(1, summary["steps"] + 1))
    assert [x["step"] for x in lines if K.RM_EVAL_ACCURACY in x] == [0, summary["steps"]]
    assert (out / "final" / "cooper_model.json").is_file() and (out / "summary.json").is_file()
