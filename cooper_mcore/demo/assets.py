"""Tiny, self-made assets for CPU runs: math prompts, a sentencepiece tokenizer, a tiny Qwen2
policy and reward model (HF folders with the tokenizer) and their Megatron checkpoints.

``cooper tiny-assets --out DIR`` writes them; ``examples/tiny_cpu.yaml`` points at them. By
default the policy gets a short Megatron SFT on worked solutions (:data:`DEFAULT_SFT_STEPS`
steps, about half a minute on two cores), so that it solves some of the problems and a Cooper
run on these assets forms reward-model pairs from its first steps; the reward model stays random.
``sft_steps=0`` keeps the policy random (the many tests that only need a model of the right
shape, and the demo, which pre-trains its own policy).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import torch

from cooper_mcore.config.schema import OptimSection, SFTConfig, SFTTrainConfig
from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf
from cooper_mcore.data.datasets import write_prompts
from cooper_mcore.data.mathgen import MathTaskConfig, generate_prompts, tokenizer_corpus
from cooper_mcore.data.templates import rm_input
from cooper_mcore.data.tokenizer import load_tokenizer, train_tiny_tokenizer, widen_tokenizer
from cooper_mcore.jobs.sft import math_sft_examples, sft
from cooper_mcore.models.tiny import FAMILIES, save_tiny_hf_model
from cooper_mcore.types import Prompt

logger = logging.getLogger(__name__)

#: SFT steps of the policy in ``cooper tiny-assets`` (batch :data:`SFT_BATCH`, lr :data:`SFT_LR`).
DEFAULT_SFT_STEPS = 150
SFT_BATCH = 64
SFT_LR = 3e-3
#: the task of ``cooper tiny-assets``: two steps on operands 0-9, which a policy of hidden size 64
#: learns within a short SFT (operands up to 99 need far longer)
TINY_TASK = MathTaskConfig(num_steps=2, max_operand=9, operators=("+", "-"))


def build_tiny_assets(out: str, n_train: int = 512, n_eval: int = 64, seed: int = 0,
                      hidden_size: int = 64, num_layers: int = 2, task: Optional[MathTaskConfig] = None,
                      rm_hidden_size: Optional[int] = None, rm_num_layers: Optional[int] = None,
                      vocab_size: int = 128, max_positions: int = 512,
                      sft_steps: int = DEFAULT_SFT_STEPS, family: str = "qwen2_tied", rm_family: str = "qwen2",
                      shape: Optional[dict[str, Any]] = None, dtype: torch.dtype = torch.float32,
                      prompts: Optional[tuple[list[Prompt], list[Prompt]]] = None,
                      corpus: Optional[list[str]] = None, isolate: str = "") -> dict[str, str]:
    """Write the tiny assets under ``out`` (existing pieces are reused); return their paths.

    Args:
        out: the folder.
        n_train / n_eval: train and held-out prompts (disjoint by construction).
        seed: problems, tokenizer corpus, model initialisation and the SFT's data order.
        hidden_size / num_layers: the policy's size (and the RM's unless given separately).
        task: the arithmetic problem family (default :data:`TINY_TASK`).
        rm_hidden_size / rm_num_layers: the reward model's size.
        vocab_size: the tokenizer's target vocabulary (the models' is padded to a multiple of 8).
        max_positions: the models' ``max_position_embeddings``.
        sft_steps: steps of the policy's SFT on the ``n_train`` problems' worked solutions
            (:func:`cooper_mcore.jobs.sft.sft`); 0 leaves the policy random.
        family / rm_family: the models' families (:data:`cooper_mcore.models.tiny.FAMILIES`);
            ``qwen3_moe`` gives a mixture-of-experts model (8 experts, top 2, the last layer dense)
            of ``hidden_size`` / ``num_layers``, its experts ``moe_intermediate_size`` wide.
        shape: config fields of both models that override the above (attention heads, key/value
            heads, head_dim, ... or a whole shape: hidden and FFN sizes, layers, vocabulary).
        dtype: the models' parameter dtype (the SFT keeps fp32 main parameters in megatron's optimizer).
        prompts: the train and held-out prompts to write instead of drawing them from ``task``.
        corpus: the tokenizer's training texts instead of ``task``'s questions and worked solutions.
        isolate: characters the tokenizer keeps as tokens of their own
            (:func:`cooper_mcore.data.tokenizer.train_tiny_tokenizer`).

    Raises:
        ValueError: ``sft_steps`` is negative, or ``family`` / ``rm_family`` is not a tiny family.
    """
    if sft_steps < 0:
        raise ValueError(f"sft_steps must be >= 0, got {sft_steps}")
    for what, name in (("family", family), ("rm_family", rm_family)):
        if name not in FAMILIES:  # before the tokenizer and models are built
            raise ValueError(f"{what} {name!r} is not a tiny family; choose from {FAMILIES}")
    task = task or TINY_TASK
    paths = build_task_assets(out, n_train, n_eval, seed, task, vocab_size, prompts, corpus, isolate)
    paths.update({k: os.path.join(out, v) for k, v in {
        "policy_hf": "policy_hf", "policy_ckpt": "policy_mcore", "rm_hf": "rm_hf", "rm_ckpt": "rm_mcore"}.items()})
    tok = load_tokenizer(paths["tokenizer"])
    maker = _RandomModels(paths["tokenizer"], {"causal_lm": family, "reward": rm_family}, seed, dtype,
                          dict(vocab_size=-(-len(tok) // 8) * 8, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, max_position_embeddings=max_positions),
                          shape or {})
    if not os.path.exists(paths["rm_ckpt"]):
        maker.save("reward", paths["rm_hf"], paths["rm_ckpt"], rm_hidden_size or hidden_size,
                   rm_num_layers or num_layers)
    if not os.path.exists(paths["policy_ckpt"]):
        if not sft_steps:
            maker.save("causal_lm", paths["policy_hf"], paths["policy_ckpt"], hidden_size, num_layers)
        else:
            _sft_policy(out, paths, maker, hidden_size, num_layers,
                        math_sft_examples(tok, n_train, task, seed=seed), sft_steps, n_train, seed)
    if not os.path.exists(paths["policy_hf"]):  # the SFT policy's HF folder (the rollout engine's start)
        mcore_to_hf(paths["policy_ckpt"], paths["policy_hf"])
    logger.info("tiny assets in %s", out)
    return paths


def build_task_assets(out: str, n_train: int = 512, n_eval: int = 64, seed: int = 0,
                      task: Optional[MathTaskConfig] = None, vocab_size: int = 128,
                      prompts: Optional[tuple[list[Prompt], list[Prompt]]] = None,
                      corpus: Optional[list[str]] = None, isolate: str = "") -> dict[str, str]:
    """The task's prompts and the tiny tokenizer under ``out`` (prompts already there are reused):
    ``{"train", "eval", "tokenizer"}`` paths. The arguments are :func:`build_tiny_assets`'s."""
    task = task or TINY_TASK
    paths = {"train": os.path.join(out, "train.jsonl"), "eval": os.path.join(out, "eval.jsonl"),
             "tokenizer": os.path.join(out, "tokenizer")}
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(paths["train"]):
        _write_prompts_once(out, paths, prompts or (generate_prompts(n_train, task, split="train", seed=seed),
                                                    generate_prompts(n_eval, task, split="test", seed=seed)))
    if corpus is None:
        corpus = tokenizer_corpus(2000, config=task, seed=seed)
        # the VerifyRM template's tags too, so that each is a few tokens rather than one <unk> per letter
        corpus += [rm_input(q, "0", c) for q, c in zip(corpus[0::3], corpus[1::3])][:200]
    train_tiny_tokenizer(corpus, paths["tokenizer"], vocab_size=vocab_size, isolate=isolate)
    return paths


def build_real_shape_assets(out: str, vocab_size: int, n_train: int = 512, n_eval: int = 16,
                            seed: int = 0) -> dict[str, str]:
    """What a run with random weights at a real shape reads (``model.init: random``): the tiny
    task's prompts and the tiny tokenizer widened to the model's ``vocab_size``
    (:func:`~cooper_mcore.data.tokenizer.widen_tokenizer`: every id the random policy samples reads
    back as one token, so the reward model's inputs are as long as the completions). A few hundred
    kilobytes of prompts and a tokenizer: no model is written. Returns ``{"train", "eval", "tokenizer"}``."""
    wide = os.path.join(out, f"tokenizer_v{vocab_size}")
    paths = {"train": os.path.join(out, "train.jsonl"), "eval": os.path.join(out, "eval.jsonl"), "tokenizer": wide}
    if not (os.path.isfile(paths["train"]) and os.path.isfile(os.path.join(wide, "tokenizer.json"))):
        widen_tokenizer(build_task_assets(out, n_train, n_eval, seed)["tokenizer"], wide, vocab_size)
    return paths


def _write_prompts_once(out: str, paths: dict[str, str], prompts: tuple[list[Prompt], list[Prompt]]) -> None:
    """The held-out file, then the train file written and renamed last: its presence marks both complete."""
    train, held_out = prompts
    write_prompts(held_out, paths["eval"])
    tmp = os.path.join(out, "train.tmp.jsonl")
    write_prompts(train, tmp)
    os.replace(tmp, paths["train"])


@dataclass
class _RandomModels:
    """Writes randomly initialised tiny HF models (with the trained tokenizer) and their Megatron checkpoints."""

    tokenizer_dir: str
    families: dict[str, str]  # family per model kind ("causal_lm", "reward")
    seed: int
    dtype: torch.dtype
    common: dict[str, Any]  # config fields both models share (vocabulary, special ids, positions)
    shape: dict[str, Any]  # config fields that override the sizes

    def save(self, kind: str, hf_dir: str, ckpt: str, hidden: int, layers: int) -> None:
        """One model of ``kind`` at ``hidden`` x ``layers`` into ``hf_dir`` and ``ckpt``."""
        fields = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, **self.common)
        fields.update(self.shape)
        save_tiny_hf_model(hf_dir, self.families[kind], kind, seed=self.seed + (kind == "reward"), dtype=self.dtype,
                           **fields)
        # copy the files as trained: save_pretrained would rewrite tokenizer_class, and transformers 5
        # would then load a Qwen2Tokenizer next to the qwen2 config (different tokenization)
        shutil.copytree(self.tokenizer_dir, hf_dir, dirs_exist_ok=True)
        hf_to_mcore(hf_dir, ckpt)


def _sft_policy(out: str, paths: dict[str, str], maker: _RandomModels, hidden: int, layers: int,
                examples: list, sft_steps: int, n_train: int, seed: int) -> None:
    """A random policy fine-tuned on the worked solutions into ``paths["policy_ckpt"]``."""
    init_hf, init_ckpt = os.path.join(out, "policy_init_hf"), os.path.join(out, "policy_init_mcore")
    shutil.rmtree(init_hf, ignore_errors=True)
    shutil.rmtree(init_ckpt, ignore_errors=True)
    shutil.rmtree(paths["policy_hf"], ignore_errors=True)  # a random one from an interrupted run
    maker.save("causal_lm", init_hf, init_ckpt, hidden, layers)
    batch = min(SFT_BATCH, n_train)
    job = SFTConfig(ckpt=init_ckpt, out=paths["policy_ckpt"], optim=OptimSection(lr=SFT_LR),
                    train=SFTTrainConfig(steps=sft_steps, global_batch_size=batch, micro_batch_size=batch, seed=seed,
                                         log_every=max(sft_steps // 5, 1)))
    history = sft(job, examples)
    logger.info("tiny policy: SFT %d steps on %d worked solutions, loss %.3f -> %.3f", sft_steps, n_train,
                history["loss"][0], history["loss"][-1])
    shutil.rmtree(init_hf)
    shutil.rmtree(init_ckpt)
