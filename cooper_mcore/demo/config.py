"""Settings of the CPU demo (``cooper demo``): one dataclass section per stage, two presets.

The default preset finishes within minutes on two CPU cores; ``--full`` is longer and bigger
(more held-out problems, more RL steps). Any field can be overridden on the command line with
a dotted ``key=value`` (``cooper demo rl.steps=60``): the demo's config is loaded by the shared
loader of :mod:`cooper_mcore.config.schema` (the same typing, presets and dotted overrides as ``cooper
train``), and every field carries its doc string as the trainer's do.

The settings a stage reads (plus the keys of the stages it reads) determine its cache key (see
:mod:`cooper_mcore.demo.pipeline`), so changing a field re-runs the stages that read it, directly
or through another stage, and nothing else: an RM training setting does not re-run the RM's data
nor the rule run, a Cooper setting only the Cooper run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from cooper_mcore.algo.pairs import NegativePick, PositivePick
from cooper_mcore.algo.reward_transforms import RewardTransform
from cooper_mcore.config.checks import MAX_SEED, choice_problems, seed_problems
from cooper_mcore.config.schema import KLKind, NegativeKind, load_sections
from cooper_mcore.negatives.rewrites import RewriteForms

BlindSpot = Literal["none", "intermediate", "slip"]
RMInit = Literal["sft", "random"]


@dataclass
class TaskSection:
    """The two-family arithmetic task (:class:`cooper_mcore.demo.task.DemoTask`) and its prompt sets:
    ``plus_minus`` chains (``7-1-1=``) and ``times`` chains (``3*4-5=``), whose convention writes the
    final answer ``\\boxed{7.}``, a form the rule verifier misses (the paper's premise, by design)."""

    max_operand: int = 9
    """Largest operand of a problem."""
    operators: list[str] = field(default_factory=lambda: ["+", "-"])
    """The plus_minus family's operators."""
    times_share: float = 0.33
    """Share of times-family problems in each split (0: the single-family control)."""
    times_parseable: float = 0.25
    """Share of times-family SFT answers written \\boxed{N}, which the rule reads."""
    unreadable_share: float = 0.3
    """Share of the problems (a hash of the question) whose reference is \\text{N.}: the rule can never verify them."""
    n_train: int = 2048
    """Distinct train-split questions (SFT, RM data and RL prompts draw from them)."""
    n_eval: int = 512
    """Held-out questions for accuracy before/after."""
    seed: int = 0
    """Seed of the problem splits and the tokenizer corpus."""
    tokenizer_vocab: int = 200
    """Tokenizer size: digits, operators, the VerifyRM template's tags (and with number_tokens 10-99)."""
    number_tokens: bool = True
    """Whole numbers 10-99 are one token each, so the RM compares an answer with the reference by one token."""


@dataclass
class ModelSection:
    """Sizes of the tiny Qwen2-architecture policy and reward model."""

    policy_hidden: int = 64
    """The policy's hidden size."""
    policy_layers: int = 2
    """The policy's layers."""
    rm_hidden: int = 64
    """The RM's hidden size with rm.init=random; rm.init=sft needs the policy's."""
    rm_layers: int = 2
    """The RM's layers with rm.init=random; rm.init=sft needs the policy's."""
    max_positions: int = 128
    """Longest sequence both models take, in tokens."""


@dataclass
class SFTSection:
    """Megatron SFT of the policy (:func:`cooper_mcore.jobs.sft.sft`)."""

    steps: int = 500
    """Optimizer steps."""
    lr: float = 3e-3
    """Learning rate."""
    batch: int = 64
    """Global batch size (sequences per step)."""
    micro_batch: int = 32
    """Sequences per forward/backward (at most batch)."""
    mix_wrong: float = 0.4
    """Share of plausible wrong worked solutions (errors become modes RL can select)."""
    seed: int = 0
    """SFT seed; seed s of the demo's seeds adds s."""


@dataclass
class RMSection:
    """The tiny VerifyRM: trained with BCE on the SFT policy's samples labeled by a simulated judge
    (the task's oracle, which reads every answer form, with ``blind_spot``'s systematic error), not by
    the rule verifier, whose false negatives the RM would otherwise learn; with an LLM judge
    configured, the rows where the rule and the judge agree instead (VerifyRM's hybrid labels). Then
    reference-swap augmented and balanced.

    It starts (``init="sft"``) from the SFT policy's weights with a new scalar head, as VerifyRM
    starts from an instruct model: the converter's ``hf_to_mcore(..., "reward", head_std)`` on the
    policy's HF export. ``init="random"`` starts from the assets' random RM of ``model.rm_hidden`` x
    ``model.rm_layers`` instead (it needs a higher ``lr``, about 2e-3).

    It trains until its accuracy on validation rows (the SFT policy's answers to ``val_share`` of the
    train questions, kept out of its training; as many right as wrong per family) reaches ``gate`` on
    every family, for at most ``epochs`` epochs, and keeps its best epoch; the report says when the
    gate is missed. Its accuracy is also measured on a fixed held-out set in VerifyBench's form: per
    held-out question one correct and one wrong completion of the SFT policy (by the oracle)
    (``bench_samples`` draws per question at the rollout temperature; questions without both are left
    out).

    Comparing the boxed answer with the reference is what the tiny RM learns slowly (validation accuracy
    per family at 1e-3, 2026-11-27: with numbers and the template's tags as single tokens, seed 0 0.85 /
    0.83 after 15 epochs and 0.91 / 0.91 after 25, seed 2 0.70 / 0.78 after 10; 2e-3 no faster; with
    one token per digit, seed 0 0.63 / 0.59 after 15 epochs).
    """

    samples_per_prompt: int = 2
    """Completions sampled per train prompt for the RM's data."""
    temperature: float = 1.0
    """Sampling temperature of the RM's training completions."""
    balance: float = 0.5
    """Repeat the correct-labeled rows of the RM's data so that they are this share of it (0: as sampled,
    about a quarter correct); VerifyRM's benchmark and Cooper's pairs are balanced."""
    blind_spot: BlindSpot = "intermediate"
    """A lenient labeler's systematic error, the RM's blind spot: wrong training rows of this kind
    (cooper_mcore/demo/kinds.py) are labeled correct; the benchmark keeps the true labels."""
    blind_spot_share: float = 0.15
    """blind_spot=intermediate: this share of the training rows (their chains) is also written with the first
    result boxed, labeled correct: the judge's error made common enough for the RM to learn it (the policy's
    own samples hold about 3% of that kind)."""
    reference_swap: bool = True
    """Each training completion with a final answer also appears with the reference set to its own answer
    (labeled correct) and to another value (labeled wrong), so the RM compares the answer with the reference
    rather than judging how plausible the chain looks."""
    init: RMInit = "sft"
    """The RM's starting weights: the SFT policy's (a new head) or the assets' random RM."""
    head_std: float = 0.0
    """init=sft: the new scalar head's std (0: zero; the head learns before the backbone moves)."""
    epochs: int = 24
    """Most passes over the RM's training rows: it stops at the first epoch that reaches the gate and keeps the best."""
    gate: float = 0.93
    """Validation accuracy (the policy's answers to rm.val_share of the train questions, kept out of training, both
    labels alike per family) every family must reach."""
    val_share: float = 0.15
    """Share of the train questions whose completions are the RM's validation rows instead of training rows."""
    lr: float = 1e-3
    """Learning rate."""
    batch: int = 64
    """Global batch size."""
    micro_batch: int = 64
    """Rows per forward/backward: one micro-batch per step is a quarter faster than 2 x 32 on 2 cores."""
    seed: int = 0
    """RM data and training seed; seed s of the demo's seeds adds s."""
    bench_samples: int = 4
    """Completions drawn per held-out question for the benchmark's correct/wrong pair."""
    judge_url: str = ""
    """Hybrid labels (as VerifyRM's data): an OpenAI-compatible LLM judge; only the training rows where the
    rule verifier and the judge agree are kept (cooper annotate). Empty: the simulated judge."""
    judge_model: str = ""
    """Model name sent to the judge endpoint."""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the judge's API key (never the key itself)."""


@dataclass
class RLSection:
    """The three RL runs (``rule``, ``static_rm``, ``cooper``): identical but for the reward mode.

    ``rm_transform`` and ``adv_std_floor`` shape the reward of both RM modes; the Cooper-only
    settings are in :class:`CooperSection`.
    """

    steps: int = 80
    """RL steps of each run (train.steps)."""
    prompts_per_step: int = 32
    """Prompts per step (train.prompts_per_step)."""
    group_size: int = 8
    """Completions per prompt (rollout.group_size)."""
    temperature: float = 1.0
    """Rollout sampling temperature (rollout.temperature); also the RM benchmark's sampling."""
    max_new_tokens: int = 32
    """Longest rollout in tokens (rollout.max_new_tokens); also the RM data's."""
    lr: float = 1e-4
    """The policy's learning rate (optim.lr)."""
    kl_coef: float = 0.01
    """KL-to-reference weight (algo.kl_coef)."""
    kl_kind: KLKind = "low_var_kl"
    """KL estimator (algo.kl_kind)."""
    rm_transform: RewardTransform = "binary"
    """RM logit -> reward (reward.rm_transform): sigmoid, sigmoid_bf16 (the reference's bf16 grid) or binary."""
    adv_std_floor: float = 0.0
    """algo.adv_std_floor: tiny RM differences inside a group stay small advantages."""
    micro_batch: int = 64
    """Sequences per forward/backward (train.micro_batch_size)."""
    eval_every: int = 20
    """In-training held-out accuracy every N steps: the same measurement as the before/after numbers."""
    seed: int = 1234
    """The run's seed (data order, sampling, evaluation); seed s of the demo's seeds adds s."""


@dataclass
class CooperSection:
    """Cooper's reward-model update (``rm.*`` of ``cooper train``); only the ``cooper`` run reads it."""

    rm_lr: float = 1e-3
    """The co-trained RM's learning rate (rm.optim.lr): 10x the policy's, as the paper's ratio."""
    negatives: NegativeKind = "rewrite"
    """The negative: as the paper's assistant makes them, a rewrite of the positive into a wrong one, its value
    changed (rewrite: the offline stand-in, no LLM); or the policy's own rule-wrong rollouts (policy)."""
    rewrite_forms: RewriteForms = "rollouts"
    """negatives=rewrite: the rewrite's final answer in the form of one of the prompt's rollouts (\\boxed{N.}
    included, which the rule cannot read) or of the positive."""
    negative_pick: NegativePick = "hardest"
    """negatives=policy: random, hardest (the RM's top-scored wrong one) or first."""
    positive_pick: PositivePick = "hardest"
    """hardest (the RM's lowest-scored rule-correct), first (the reference code) or random."""
    pairs_per_prompt: int = 4
    """Preference pairs per prompt."""
    anchor_weight: float = 1.0
    """BCE calibration anchor on the pairs' own labels (0: the paper's pairwise loss)."""


@dataclass
class EvalSection:
    """Held-out accuracy: avg@k over all ``task.n_eval`` problems at the paper's sampling.

    The same measurement (prompts, k, sampling, seed) is made before RL, during it (every
    ``rl.eval_every`` steps, by the trainer) and after it, so the curve ends on the "after" number.
    """

    temperature: float = 0.7
    """The paper's sampling (avg@k); greedy accuracy is reported as well."""
    top_p: float = 0.95
    """Nucleus sampling mass."""
    k: int = 2
    """Samples per held-out problem (avg@k)."""
    max_new_tokens: int = 32
    """Longest held-out completion in tokens."""
    hack_examples: int = 5
    """Completions the RM over-scores shown per RM run in the report."""


@dataclass
class DemoConfig:
    """The whole demo."""

    out: str = "runs/demo"
    """Output folder: stages/ (the content cache) and report/."""
    task: TaskSection = field(default_factory=TaskSection)
    """The arithmetic task and its prompt sets."""
    model: ModelSection = field(default_factory=ModelSection)
    """The tiny models' sizes."""
    sft: SFTSection = field(default_factory=SFTSection)
    """SFT of the policy."""
    rm: RMSection = field(default_factory=RMSection)
    """The VerifyRM's data and training."""
    rl: RLSection = field(default_factory=RLSection)
    """The three RL runs."""
    cooper: CooperSection = field(default_factory=CooperSection)
    """Cooper's reward-model update."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Held-out accuracy."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """One full pipeline after the shared assets per seed s: SFT, RM data, RM and the three RL runs with their
    seeds offset by s (--full: three seeds, reported as mean, spread and per seed)."""
    control: bool = False
    """Also run every seed on the single-family task (task.times_share=0 and task.unreadable_share=0, where the rule
    misses nothing), reported beside the two-family one (--full)."""


#: ``cooper demo --full`` and ``--preset smoke``: presets (nested mappings of sections) over the defaults
PRESETS: dict[str, dict[str, Any]] = {
    # three seeds, longer RL, more held-out problems
    "full": {
        "out": "runs/demo_full",
        "task": {"n_eval": 640},
        "rl": {"steps": 200, "eval_every": 20},
        "seeds": [0, 1, 2],
        "control": True,
    },
    # the CI smoke test: every stage, a few steps each, smallest sizes
    "smoke": {
        "task": {"n_train": 128, "n_eval": 32},
        "sft": {"steps": 4, "batch": 32},
        "rm": {"samples_per_prompt": 1, "epochs": 1, "batch": 32},
        "rl": {"steps": 2, "prompts_per_step": 4, "group_size": 4, "micro_batch": 16, "eval_every": 1,
               "max_new_tokens": 16},
        "eval": {"k": 1, "max_new_tokens": 16, "hack_examples": 2},
    },
}


def load_demo_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None) -> DemoConfig:
    """Defaults <- preset (``None`` or a name of :data:`PRESETS`) <- dotted overrides, type-checked by
    the shared loader (:func:`cooper_mcore.config.schema.load_sections`), then checked as a whole.

    Raises:
        ValueError: an unknown preset or key, a wrongly typed value or one outside a setting's
            choices, an empty or repeating ``seeds``, or an RM made from the policy at another size.
    """
    result = load_sections(DemoConfig, preset, overrides, presets=PRESETS)
    problems = demo_problems(result)
    if problems:
        raise ValueError("bad demo setting: " + "; ".join(problems))
    return result


def demo_problems(cfg: DemoConfig) -> list[str]:
    """Every problem of a demo config: values outside their choices, then the settings that cannot go together."""
    out = choice_problems(cfg)
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        out.append(f"seeds must be a non-empty list of distinct integers, got {cfg.seeds}")
    stages = [("task.seed", cfg.task.seed), ("sft.seed", cfg.sft.seed), ("rm.seed", cfg.rm.seed),
              ("rl.seed", cfg.rl.seed)]
    out += seed_problems(stages + [(f"seeds entry {s}", s) for s in cfg.seeds])
    if not out:  # each stage runs with its seed plus each entry of seeds
        out += [f"{name} ({base}) + seeds entry {s} = {base + s} is past {MAX_SEED}, the largest seed every random "
                "generator takes" for name, base in stages for s in cfg.seeds if base + s > MAX_SEED]
    if cfg.rm.head_std < 0:  # checked by the converter too, but only at the rm stage, after the SFT
        out.append(f"rm.head_std must be >= 0, got {cfg.rm.head_std}")
    m = cfg.model
    if cfg.rm.init == "sft" and (m.rm_hidden, m.rm_layers) != (m.policy_hidden, m.policy_layers):
        out.append(f"rm.init=sft starts the RM from the SFT policy, so model.rm_hidden x rm_layers ({m.rm_hidden} x "
                   f"{m.rm_layers}) must equal the policy's ({m.policy_hidden} x {m.policy_layers}); set "
                   f"rm.init=random for an RM of another size")
    return out
