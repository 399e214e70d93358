"""Settings: values the run cannot use (checked as it uses them: floats in float32, integers in 64 bits,
seeds), the same checks in ``cooper plan`` and ``cooper rehearse``, a rollout engine that is not
installed, numbers on the command line, presets that are not YAML mappings of sections, the config
library's errors, and lookups of settings that do not exist."""

from __future__ import annotations

import json

from cooper_mcore.cli import MAX_SEED
from cooper_mcore.config import checks
from cooper_mcore.models.arch import ArchSpec
from tests.badinput.case import TINY_RUN, Case, Env
from tests.conftest import ROOT

QWEN = ROOT / "examples" / "model_configs" / "qwen2.5-1.5b-instruct.json"
TRAIN = ("train", *TINY_RUN, "--out", "{tmp}/run")
PLAN = ("plan", "--config", "{tmp}/dense.yaml", "--gpus-per-node", "8", "--gpu-memory-gib", "80")


def dense_run(env: Env) -> dict[str, str]:
    """``{tmp}/dense.yaml``: a run whose policy and RM checkpoints hold a dense Qwen2.5-1.5B shape, as the
    trainer reads them."""
    hf = json.loads(QWEN.read_text())
    (env.tmp / "policy_hf").mkdir()
    (env.tmp / "policy_hf" / "config.json").write_text(json.dumps(hf))
    for name, model_type in (("policy", "causal_lm"), ("rm", "reward")):
        (env.tmp / name).mkdir()
        arch = ArchSpec.from_hf_config(hf, model_type).to_dict()
        (env.tmp / name / "cooper_model.json").write_text(json.dumps({"arch": arch, "hf_config": hf,
                                                                       "dtype": "bfloat16"}))
    (env.tmp / "dense.yaml").write_text(f"model:\n  policy_ckpt: {env.tmp / 'policy'}\n  rm_ckpt: {env.tmp / 'rm'}\n"
                                        f"  policy_hf: {env.tmp / 'policy_hf'}\n  dtype: bfloat16\n"
                                        "rm:\n  negatives: perturb\n")
    return {}


def no_sglang(env: Env) -> dict[str, str]:
    """A machine without SGLang (whatever this one has)."""
    env.monkeypatch.setattr(checks, "sglang_installed", lambda: False)
    return {}


def preset(text: str):
    """A setup: ``{tmp}/p.yaml`` holds ``text``."""

    def setup(env: Env) -> dict[str, str]:
        (env.tmp / "p.yaml").write_text(text)
        return {}

    return setup


def number_case(argv: tuple[str, ...], flag: str, why: str) -> Case:
    """A number the parser refuses: ``argument --flag: must be <why>, got '<the value>'``."""
    value = argv[argv.index(flag) + 1]
    return Case(f"{flag} {value}", argv, (f"error: argument {flag}: must be {why}, got {value!r}",), usage=True)


def override_case(override: str, message: str) -> Case:
    """An override the config library refuses, in one line naming it."""
    return Case(f"override {override}", ("config", override), (f"bad config (override {override!r}): {message}",))


def preset_case(name: str, text: str, *names: str) -> Case:
    """A preset file refused, in one line naming the file (and what is wrong where)."""
    return Case(f"preset {name}", ("config", "--config", "{tmp}/p.yaml"), ("{tmp}/p.yaml", *names), preset(text))


FIRST_SETTINGS = "name one of its settings (algo.clip_low, algo.clip_high, algo.clip_ratio_c, ...)"

CASES = [
    Case("algo.tis_cap=1e-300, 0 in float32", (*TRAIN, "algo.tis_cap=1e-300"),
         ("invalid config: algo.tis_cap=1e-300 is 0 in float32, the type the run computes it in",)),
    Case("algo.tis_cap=1e300, past float32", (*TRAIN, "algo.tis_cap=1e300"),
         ("invalid config: algo.tis_cap=1e+300 overflows float32",)),
    Case("train.steps past 64 bits", (*TRAIN, "train.steps=100000000000000000000"),
         ("train.steps=100000000000000000000 does not fit in a 64-bit integer",)),
    Case("rollout.engine=sglang without SGLang", (*TRAIN, "rollout.engine=sglang"),
         ("rollout.engine=sglang needs SGLang, which is not installed here: pip install 'sglang==0.5.23'",
          "or set rollout.engine=hf"), no_sglang),
    Case("an override without =", (*TRAIN, "algo.tis_cap"),
         ("override 'algo.tis_cap' has no '=': write algo.tis_cap=VALUE (null to unset)",)),
    # cooper plan once said FITS where cooper train refuses: the trainer's check, its message
    Case("plan parallel.ep=2 for a dense model", (*PLAN, "parallel.ep=2"),
         ("invalid config: parallel.ep=2 needs a mixture-of-experts model, but model.policy_ckpt ({tmp}/policy) and "
          "model.rm_ckpt ({tmp}/rm) are dense",), dense_run, then=(*PLAN, "--json")),
    # the rehearsal swaps SGLang for the transformers engine: the preset's own port is checked before
    Case("rehearse rollout.sglang_base_port=70000", ("rehearse", "--config", "qwen2.5-1.5b_8xh100", "--out",
                                                     "{tmp}/rh", "rollout.sglang_base_port=70000"),
         ("rollout.sglang_base_port must be in 1024..60000 (each local rank takes 10 ports above it), got 70000",)),
    Case("plan without a model shape", ("plan", "--gpus-per-node", "8", "--gpu-memory-gib", "80", "reward.mode=rule"),
         ("--policy-config",)),
    Case("demo seeds past every generator's", ("demo", "--out", "{tmp}/demo", "seeds=[100000000000000000000]"),
         (f"bad demo setting: seeds entry 100000000000000000000 must be in 0..{MAX_SEED}",)),
    Case("demo seeds past with a stage's own seed", ("demo", "--out", "{tmp}/demo", f"seeds=[{MAX_SEED}]"),
         (f"rl.seed (1234) + seeds entry {MAX_SEED} = {MAX_SEED + 1234} is past {MAX_SEED}",)),
    number_case(("plan", "--gpus-per-node", "8", "--gpu-memory-gib", "nan"), "--gpu-memory-gib", "a finite number > 0"),
    number_case(("plan", "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--overhead-gib", "inf"), "--overhead-gib",
                "a finite number >= 0"),
    number_case(("convert", "mcore-to-hf", "--ckpt", "c", "--out", "o", "--max-shard-gib", "nan"), "--max-shard-gib",
                "a finite number > 0"),
    number_case(("convert", "mcore-to-hf", "--ckpt", "c", "--out", "o", "--max-shard-gib", "1e400"), "--max-shard-gib",
                "a finite number > 0"),
    number_case(("eval-rm", "--ckpt", "c", "--data", "d", "--threshold", "1"), "--threshold",
                "a finite number > 0 and < 1"),
    number_case(("eval", "--model", "m", "--data", "d", "--seed", "100000000000000000000"), "--seed",
                f"in 0..{MAX_SEED}"),
    number_case(("rehearse", "--config", "p", "--step-timeout", "0"), "--step-timeout", "a finite number > 0"),
    Case("several problems at once", (*TRAIN, "reward.mode=nope", "train.prompts_per_step=3",
                                      "train.micro_batch_size=4", "model.rm_ckpt={tmp}/missing"),
         ("reward.mode must be one of ('rule', 'static_rm', 'cooper'), got 'nope'",
          "model.rm_ckpt: '{tmp}/missing' does not exist"), listed=2),
    Case("train-rm with several problems", ("train-rm", "--ckpt", "{runs}/rm_src", "--train", "{tmp}/missing.jsonl",
                                            "--out", "{tmp}/o", "train.epochs=0"),
         ("data.train_path: '{tmp}/missing.jsonl' does not exist", "train.epochs must be >= 1"), listed=2),
    Case("train-rm without a checkpoint", ("train-rm", "--out", "{tmp}/o", "data.train_path={verifybench}"),
         ("--ckpt",)),
    Case("a preset that is a folder", ("config", "--config", "{tmp}"), ("{tmp}", "is a folder")),
    preset_case("with a tab", "train:\n\tsteps: 2\n", "line 2", "a tab: YAML indents with spaces only"),
    preset_case("with a duplicate key", "train:\n  steps: 2\n  steps: 3\n", "line 3", "found duplicate key steps"),
    preset_case("with a syntax error", "train: [1\nalgo: {}\n", "line 2", "did not find expected"),
    preset_case("that is empty", "", "is empty"),
    preset_case("of comments only", "# nothing but a comment\n", "is empty"),
    preset_case("that is a list", "- train\n- algo\n",
                "must be a mapping of sections (model:, train:, ...), got a list"),
    preset_case("with a missing interpolation", "algo:\n  kl_coef: ${nowhere}\n",
                "bad config ({tmp}/p.yaml): algo.kl_coef: Interpolation key 'nowhere' not found"),
    preset_case("with an interpolation of the wrong type", "train:\n  steps: ${algo.kl_coef}\n",
                "bad config ({tmp}/p.yaml): train.steps: While dereferencing interpolation '${algo.kl_coef}': "
                "Value '0.001' of type 'float' could not be converted to Integer"),
    preset_case("with a value for a section", "algo: 3\n",
                f"bad config ({{tmp}}/p.yaml): algo is a section, not a setting: {FIRST_SETTINGS}"),
    preset_case("with a misspelt setting", "algo:\n  tis_cp: 2\n",
                "bad config ({tmp}/p.yaml): unknown setting algo.tis_cp (did you mean algo.tis_cap?)"),
    override_case("algo.kl_coef=abc", "algo.kl_coef: Value 'abc' of type 'str' could not be converted to Float"),
    override_case("train.steps=1.5", "train.steps: Value '1.5' of type 'float' could not be converted to Integer"),
    override_case("logging.wandb=maybe", "logging.wandb: Value 'maybe' is not a valid bool (type str)"),
    override_case("train.steps=null", "train.steps: Incompatible value 'None' for field of type 'int'"),
    override_case("rollout.stop=abc", "rollout.stop: a list is expected: write rollout.stop=[a,b] ([] for none)"),
    override_case("rm.rewrite_kinds=[bad]",
                  "rm.rewrite_kinds[0]: Invalid value 'bad', expected one of ['step', 'copy', 'final']"),
    override_case("algo.kl_coeff=1", "unknown setting algo.kl_coeff (did you mean algo.kl_coef?)"),
    override_case("algo.kl_coef.x=1", "algo.kl_coef is a setting, not a section: write algo.kl_coef=VALUE"),
    override_case("algo=1", f"algo is a section, not a setting: {FIRST_SETTINGS}"),
    override_case("=1", "a setting without a name (key=value is expected)"),
    override_case("data.template={question}",
                  "the value of data.template reads as a YAML mapping; quote it: data.template='{question}'"),
    Case("look up settings that do not exist", ("config", "tis_cap", "algo.kl_coeff"),
         ("unknown setting 'tis_cap' (did you mean algo.tis_cap?); `cooper config` lists every setting",)),
    Case("look up another job's setting misspelt", ("config", "--job", "sft", "train.seeed"),
         ("unknown setting 'train.seeed' (did you mean train.seed?)",)),
    Case("tiny-assets of an unknown family", ("tiny-assets", "--out", "{tmp}/assets", "--rm-family", "qwen9"),
         ("rm_family 'qwen9'", "is not a tiny family")),
]
