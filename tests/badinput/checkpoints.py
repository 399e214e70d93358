"""Bad checkpoints and converter inputs: a damaged shard or an unfinished ``step_<n>.tmp`` refused by every
command that reads a checkpoint (with the step to use instead, which then works), an HF export without a
tokenizer, files that are not what the converter takes."""

from __future__ import annotations

import os
import shutil

from cooper_mcore.checkpoint.manifest import MANIFEST
from cooper_mcore.checkpoint.model import META_FILE
from cooper_mcore.models.tiny import save_tiny_tokenizer
from tests.badinput.case import TINY_RUN, Case, Env
from tests.conftest import flip_a_byte


def damaged_run(env: Env) -> dict[str, str]:
    """A copy of the trainer's two checkpoints, one bit flipped in a shard of step 2's policy and of its RM."""
    room = env.tmp / "run" / "checkpoints"
    shutil.copytree(env.runs / "run" / "checkpoints", room)
    policy, rm = room / "step_2" / "policy", room / "step_2" / "rm"
    return {"room": str(room), "policy": str(policy), "rm": str(rm), "shard": flip_a_byte(policy),
            "rm_shard": flip_a_byte(rm)}


def unfinished_run(env: Env) -> dict[str, str]:
    """Step 1 complete; ``step_4.tmp``, whose writer was killed before the manifest; ``step_3.tmp``, killed
    before even the policy's ``cooper_model.json``."""
    room = env.tmp / "run" / "checkpoints"
    shutil.copytree(env.runs / "run" / "checkpoints" / "step_1", room / "step_1")
    for step, drop in (("step_4.tmp", ()), ("step_3.tmp", ("policy/" + META_FILE,))):
        shutil.copytree(env.runs / "run" / "checkpoints" / "step_2", room / step)
        for name in (MANIFEST, *drop):
            os.remove(room / step / name)
    return {"room": str(room)}


def big_tokenizer(env: Env) -> dict[str, str]:
    """A tokenizer with 200 ids, past the tiny model's vocabulary of 128; a folder with no tokenizer."""
    (env.tmp / "empty").mkdir()
    return {"big": save_tiny_tokenizer(str(env.tmp / "big_tok"), 200)}


def garbage_common_pt(env: Env) -> dict[str, str]:
    """A converted model whose ``common.pt`` is not a torch file."""
    shutil.copytree(env.runs / "policy_src", env.tmp / "ckpt")
    (env.tmp / "ckpt" / "common.pt").write_bytes(b"not a checkpoint")
    return {"ckpt": str(env.tmp / "ckpt")}


def existing_output(env: Env) -> dict[str, str]:
    (env.tmp / "mc").mkdir()
    (env.tmp / "mc" / "notes.txt").write_text("mine")
    return {}


DAMAGED = ("checkpoint '{policy}' is damaged: policy/{shard} has CRC-32 ", "the manifest says",
           "({room}/step_2/manifest.json); use the previous step's checkpoint, e.g. the newest other complete one: "
           "{room}/step_1/policy")
DAMAGED_RM = ("checkpoint '{rm}' is damaged: rm/{rm_shard} has CRC-32 ", "the newest other complete one: "
              "{room}/step_1/rm")
UNFINISHED = ("is unfinished: its training checkpoint {room}/step_{n}.tmp was never completed (no manifest, not "
              "renamed); use the previous step's checkpoint, e.g. the newest other complete one: {room}/step_1/policy")
NO_TOKENIZER = ("checkpoint '{runs}/random/checkpoints/step_1/policy' has no tokenizer (no tokenizer files in its "
                "hf_extra/: the checkpoints of a model.init=random run carry none), so its export could not be used: "
                "give one with --tokenizer DIR",)
RM_JOB = ("--config", "{rm_preset}", "--out", "{tmp}/rm_out", "train.epochs=1", "data.train_path={verifybench}",
          "data.eval_path=''", "train.eval_at_start=false")
SFT_JOB = ("--config", "{sft_preset}", "--out", "{tmp}/sft_out", "train.steps=1", "data.num_examples=4",
           "train.global_batch_size=4", "train.micro_batch_size=4")
EXPORT_RANDOM = ("convert", "mcore-to-hf", "--ckpt", "{runs}/random/checkpoints/step_1/policy", "--out", "{tmp}/hf")

CASES = [
    Case("convert a checkpoint with a flipped byte", ("convert", "mcore-to-hf", "--ckpt", "{policy}", "--out",
                                                       "{tmp}/hf"), DAMAGED, damaged_run,
         then=("convert", "mcore-to-hf", "--ckpt", "{room}/step_1/policy", "--out", "{tmp}/hf")),
    Case("eval a checkpoint with a flipped byte", ("eval", "--model", "{policy}", "--data", "{runs}/prompts.jsonl",
                                                    "--k", "1"), DAMAGED, damaged_run),
    Case("eval-rm a checkpoint with a flipped byte", ("eval-rm", "--ckpt", "{rm}", "--data", "{verifybench}",
                                                       "--predictions", "{tmp}/pred.jsonl"), DAMAGED_RM, damaged_run),
    Case("train a policy with a flipped byte", ("train", *TINY_RUN, "--out", "{tmp}/new_run",
                                                 "model.policy_ckpt={policy}"), DAMAGED, damaged_run),
    Case("sft from a checkpoint with a flipped byte", ("sft", *SFT_JOB, "--ckpt", "{policy}"), DAMAGED, damaged_run),
    # the first attempt used to leave config.yaml and metrics.jsonl in --out: the retry was "not empty"
    Case("train-rm from a checkpoint with a flipped byte, then a good one", ("train-rm", *RM_JOB, "--ckpt", "{rm}"),
         DAMAGED_RM, damaged_run, then=("train-rm", *RM_JOB, "--ckpt", "{runs}/rm_src")),
    Case("convert an unfinished step_4.tmp", ("convert", "mcore-to-hf", "--ckpt", "{room}/step_4.tmp/policy",
                                               "--out", "{tmp}/hf"),
         ("checkpoint '{room}/step_4.tmp/policy' " + UNFINISHED.replace("{n}", "4"),), unfinished_run),
    # killed before its cooper_model.json: once read as an HF folder (transformers' "Unrecognized model")
    Case("eval a step_3.tmp killed before its metadata", ("eval", "--model", "{room}/step_3.tmp/policy", "--data",
                                                           "{runs}/prompts.jsonl"),
         ("checkpoint '{room}/step_3.tmp/policy' " + UNFINISHED.replace("{n}", "3"),), unfinished_run),
    Case("export a model.init=random checkpoint without --tokenizer", EXPORT_RANDOM, NO_TOKENIZER,
         then=(*EXPORT_RANDOM, "--tokenizer", "{runs}/hf")),
    Case("export with a --tokenizer past the model's vocabulary", (*EXPORT_RANDOM, "--tokenizer", "{big}"),
         ("{big}", "has 200 token ids (0..199), the model"), big_tokenizer),
    Case("export with a --tokenizer folder that holds none", (*EXPORT_RANDOM, "--tokenizer", "{tmp}/empty"),
         ("--tokenizer '{tmp}/empty': no tokenizer files in",), big_tokenizer),
    Case("convert a checkpoint whose common.pt is garbage", ("convert", "mcore-to-hf", "--ckpt", "{ckpt}", "--out",
                                                              "{tmp}/hf"), ("{ckpt}", "common.pt is unreadable"),
         garbage_common_pt),
    Case("convert into an output that exists", ("convert", "hf-to-mcore", "--hf-dir", "{runs}/hf", "--out",
                                                 "{tmp}/mc"), ("{tmp}/mc", "already exists"), existing_output),
    Case("convert a folder without config.json", ("convert", "hf-to-mcore", "--hf-dir", "{tmp}/nope", "--out",
                                                   "{tmp}/mc"), ("{tmp}/nope", "no config.json")),
    Case("export an HF folder as a checkpoint", ("convert", "mcore-to-hf", "--ckpt", "{runs}/hf", "--out",
                                                  "{tmp}/hf"), ("{runs}/hf", "not a cooper_mcore model checkpoint")),
    Case("convert with a negative --head-std", ("convert", "hf-to-mcore", "--hf-dir", "{runs}/hf", "--out",
                                                 "{tmp}/rm", "--model-type", "reward", "--head-std", "-1"),
         ("error: argument --head-std: must be a finite number >= 0, got '-1'",), usage=True),
]
