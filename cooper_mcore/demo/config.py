"""Settings of the CPU demo (``cooper demo``): one dataclass section per stage, two presets.

The default preset finishes within minutes on two CPU cores; ``--full`` is longer and bigger
(more held-out problems, more RL steps). Any field can be overridden on the command line with
a dotted ``key=value`` (``cooper demo rl.steps=60``), as ``cooper train`` does.

The settings a stage reads (plus the keys of the stages it reads) determine its cache key (see
:mod:`cooper_mcore.demo.pipeline`), so changing a field re-runs the stages that read it, directly
or through another stage, and nothing else: an RM training setting does not re-run the RM's data
nor the rule run, a Cooper setting only the Cooper run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cooper_mcore.algo.pairs import NegativePick, PositivePick
from cooper_mcore.algo.reward_transforms import RewardTransform
from cooper_mcore.config import NegativeKind

BlindSpot = Literal["none", "intermediate", "slip"]
RMInit = Literal["sft", "random"]


@dataclass
class TaskSection:
    """The two-family arithmetic task (:class:`cooper_mcore.demo.task.DemoTask`) and its prompt sets:
    ``plus_minus`` chains (``7-1-1=``) and ``times`` chains (``3*4-5=``), whose convention writes the
    final answer ``\\boxed{7.}``, a form the rule verifier misses (the paper's premise, by design)."""

    max_operand: int = 9
    operators: list[str] = field(default_factory=lambda: ["+", "-"])  # the plus_minus family's operators
    times_share: float = 0.33  # share of times-family problems in each split (0: the single-family control)
    times_parseable: float = 0.25  # share of times-family SFT answers written \boxed{N}, which the rule reads
    n_train: int = 2048  # distinct train-split questions (SFT, RM data and RL prompts draw from them)
    n_eval: int = 512  # held-out questions for accuracy before/after
    seed: int = 0
    tokenizer_vocab: int = 96  # digits, operators and the VerifyRM template's tags


@dataclass
class ModelSection:
    """Sizes of the tiny Qwen2-architecture policy and reward model."""

    policy_hidden: int = 64
    policy_layers: int = 2
    rm_hidden: int = 64  # the RM's size with ``rm.init=random``; ``init=sft`` needs the policy's
    rm_layers: int = 2
    max_positions: int = 128


@dataclass
class SFTSection:
    """Megatron SFT of the policy (:func:`cooper_mcore.jobs.sft.sft`)."""

    steps: int = 500
    lr: float = 3e-3
    batch: int = 64
    micro_batch: int = 32
    mix_wrong: float = 0.4  # share of plausible wrong worked solutions (errors become modes RL can select)
    seed: int = 0


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

    Its accuracy is measured on a fixed held-out set in VerifyBench's form: per held-out question
    one correct and one wrong completion of the SFT policy (by the oracle) (``bench_samples`` draws per
    question at the rollout temperature; questions without both are left out).
    """

    samples_per_prompt: int = 2  # completions sampled per train prompt for the RM's data
    temperature: float = 1.0
    # repeat the rule-correct rows of the RM's data so that they are this share of it (0: as sampled,
    # about a quarter correct); VerifyRM's benchmark and Cooper's pairs are balanced
    balance: float = 0.5
    # a lenient labeler's systematic error, the RM's blind spot: wrong training rows of this kind
    # (cooper_mcore/demo/kinds.py) are labeled correct; the benchmark keeps the true labels
    blind_spot: BlindSpot = "intermediate"
    # blind_spot=intermediate: this share of the training rows (their chains) is also written with the first
    # result boxed, labeled correct: the judge's error made common enough for the RM to learn it (the policy's
    # own samples hold about 3% of that kind)
    blind_spot_share: float = 0.15
    # reference-swap augmentation: each training completion with a final answer also appears with the
    # reference set to its own answer (labeled correct) and to another value (labeled wrong), so the RM
    # learns to compare the answer with the reference rather than to judge how plausible the chain looks
    reference_swap: bool = True
    init: RMInit = "sft"  # the RM's starting weights: the SFT policy's (new head) or the assets' random RM
    head_std: float = 0.0  # init=sft: the new scalar head's std (0: zero; the head learns before the backbone moves)
    # comparing the boxed answer with the reference takes the tiny RM 12+ epochs (measured on the benchmark:
    # 6 epochs at 5e-4 to 2e-3 reach 0.67-0.75; 12 at 1e-3 0.88; 12 at 2e-3 0.92, 0.72 or 0.54 by data and
    # seed: the comparison forms late and unreliably at that rate; 5e-3 does not learn)
    epochs: int = 14
    lr: float = 1e-3
    batch: int = 64
    micro_batch: int = 64  # one micro-batch per step: a quarter faster than 2 x 32 on 2 cores
    seed: int = 0
    bench_samples: int = 4
    # hybrid labels (as VerifyRM's data): with an OpenAI-compatible LLM judge configured, keep only
    # the training rows where the rule verifier and the judge agree (``cooper annotate``)
    judge_url: str = ""
    judge_model: str = ""
    judge_api_key_env: str = "OPENAI_API_KEY"


@dataclass
class RLSection:
    """The three RL runs (``rule``, ``static_rm``, ``cooper``): identical but for the reward mode.

    ``rm_transform`` and ``adv_std_floor`` shape the reward of both RM modes; the Cooper-only
    settings are in :class:`CooperSection`.
    """

    steps: int = 80
    prompts_per_step: int = 32
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 32
    lr: float = 1e-4
    kl_coef: float = 0.01
    kl_kind: str = "low_var_kl"
    # RM logit -> reward (``reward.rm_transform``): sigmoid, sigmoid_bf16 (the reference's bf16 grid) or binary
    rm_transform: RewardTransform = "binary"
    adv_std_floor: float = 0.0  # ``algo.adv_std_floor``: tiny RM differences inside a group stay small advantages
    micro_batch: int = 64
    eval_every: int = 20  # in-training held-out accuracy: the same measurement as the before/after numbers
    seed: int = 1234  # the run's seed (data order, sampling, evaluation); seed s of ``seeds`` adds s


@dataclass
class CooperSection:
    """Cooper's reward-model update (``rm.*`` of ``cooper train``); only the ``cooper`` run reads it."""

    rm_lr: float = 1e-3  # the co-trained RM's learning rate: 10x the policy's, as the paper's ratio
    # the verified-wrong negative: with no assistant LLM offline, the policy's own rule-wrong rollouts
    # (``policy``) or a programmatic rewrite of the positive's worked chain (``rewrite``)
    negatives: NegativeKind = "policy"
    negative_pick: NegativePick = "hardest"  # negatives=policy: random, hardest (the RM's top-scored wrong one), first
    positive_pick: PositivePick = "hardest"  # the RM's lowest-scored rule-correct; first (the reference code), random
    pairs_per_prompt: int = 4
    anchor_weight: float = 1.0  # BCE calibration anchor on the pairs' own labels (0: the paper's pairwise loss)


@dataclass
class EvalSection:
    """Held-out accuracy: avg@k over all ``task.n_eval`` problems at the paper's sampling.

    The same measurement (prompts, k, sampling, seed) is made before RL, during it (every
    ``rl.eval_every`` steps, by the trainer) and after it, so the curve ends on the "after" number.
    """

    temperature: float = 0.7  # the paper's sampling (avg@k); greedy accuracy is reported as well
    top_p: float = 0.95
    k: int = 2
    max_new_tokens: int = 32
    hack_examples: int = 5


@dataclass
class DemoConfig:
    """The whole demo."""

    out: str = "runs/demo"
    task: TaskSection = field(default_factory=TaskSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rm: RMSection = field(default_factory=RMSection)
    rl: RLSection = field(default_factory=RLSection)
    cooper: CooperSection = field(default_factory=CooperSection)
    eval: EvalSection = field(default_factory=EvalSection)
    # one full pipeline after the shared assets per seed s: SFT, RM data, RM and the three RL runs
    # with their seeds offset by s (``--full``: three seeds, reported as mean, spread and per seed)
    seeds: list[int] = field(default_factory=lambda: [0])
    # also run every seed on the single-family task (task.times_share=0, where the rule misses nothing),
    # reported beside the two-family one (``--full``)
    control: bool = False


# ``--full``: three seeds, longer RL, more held-out problems
FULL_PRESET: dict = {
    "out": "runs/demo_full",
    "task": {"n_eval": 640},
    "rl": {"steps": 200, "eval_every": 20},
    "seeds": [0, 1, 2],
    "control": True,
}

# the CI smoke test: every stage, a few steps each, smallest sizes
SMOKE_PRESET: dict = {
    "task": {"n_train": 128, "n_eval": 32},
    "sft": {"steps": 4, "batch": 32},
    "rm": {"samples_per_prompt": 1, "epochs": 1, "batch": 32},
    "rl": {"steps": 2, "prompts_per_step": 4, "group_size": 4, "micro_batch": 16, "eval_every": 1,
           "max_new_tokens": 16},
    "eval": {"k": 1, "max_new_tokens": 16, "hack_examples": 2},
}


def load_demo_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None) -> DemoConfig:
    """Defaults <- preset (``None``, ``"full"`` or ``"smoke"``) <- dotted overrides, type-checked.

    Raises:
        ValueError: an unknown preset or key, a wrongly typed value or one outside a setting's
            choices, or an empty or repeating ``seeds``.
    """
    presets = {None: {}, "full": FULL_PRESET, "smoke": SMOKE_PRESET}
    if preset not in presets:
        raise ValueError(f"unknown demo preset {preset!r}; choose from full, smoke")
    cfg = OmegaConf.structured(DemoConfig)
    try:
        cfg = OmegaConf.merge(cfg, presets[preset], OmegaConf.from_dotlist(list(overrides or [])))
    except OmegaConfBaseException as e:
        raise ValueError(f"bad demo setting: {e}") from None
    result: DemoConfig = OmegaConf.to_object(cfg)
    if not result.seeds or len(set(result.seeds)) != len(result.seeds):
        raise ValueError(f"bad demo setting: seeds must be a non-empty list of distinct integers, got {result.seeds}")
    if result.rm.head_std < 0:  # checked by the converter too, but only at the rm stage, after the SFT
        raise ValueError(f"bad demo setting: rm.head_std must be >= 0, got {result.rm.head_std}")
    m = result.model
    if result.rm.init == "sft" and (m.rm_hidden, m.rm_layers) != (m.policy_hidden, m.policy_layers):
        raise ValueError(f"bad demo setting: rm.init=sft starts the RM from the SFT policy, so model.rm_hidden x "
                         f"rm_layers ({m.rm_hidden} x {m.rm_layers}) must equal the policy's ({m.policy_hidden} x "
                         f"{m.policy_layers}); set rm.init=random for an RM of another size")
    return result

