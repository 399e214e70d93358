"""Checkpoints are verified wherever they are read, and an HF export always has its tokenizer.

Training checkpoints are written by the trainer's own :func:`save_training_checkpoint` (a policy
with its optimizer and a reward model, two steps; and a checkpoint of a ``model.init=random``
run, whose models come from no checkpoint and so carry no tokenizer). Then one flipped byte in a
shard, or an unfinished ``step_<n>.tmp``, is refused with one line by ``cooper convert``, ``cooper
eval``, ``cooper eval-rm`` and the loaders the trainers and the rehearsal use, and nothing is written.
CRC-32s of pieces are checked against zlib's CRC-32 of the whole.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import zlib
from pathlib import Path

import pytest

from cooper_mcore.checkpoint import manifest
from cooper_mcore.checkpoint.manifest import MANIFEST, crc32_combine, verify_checkpoint, write_manifest
from cooper_mcore.checkpoint.model import load_checkpoint_model, load_checkpoint_tensors, open_model_checkpoint
from cooper_mcore.checkpoint.training import save_training_checkpoint
from cooper_mcore.cli import main as cli_main
from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf
from cooper_mcore.models.tiny import save_tiny_hf_model, save_tiny_tokenizer
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.offload import ModelOffloader
from cooper_mcore.train.step import OptimConfig, build_scheduler, wrap_for_training

ROOT = Path(__file__).resolve().parents[2]
VERIFYBENCH = str(ROOT / "tests" / "fixtures" / "verifybench_tiny.jsonl")


def _state(name: str, ckpt: str) -> ModelState:
    """A model as the trainer holds it: loaded, wrapped for training, with its optimizer and schedule."""
    module, arch = load_checkpoint_model(ckpt, ParallelConfig())
    ddp, opt = wrap_for_training(module, OptimConfig(lr=1e-3))
    _, hf_config, dtype = open_model_checkpoint(ckpt)
    return ModelState(name, module, arch, hf_config, dtype, ckpt, tokenizer=None, offloader=ModelOffloader(ddp, opt),
                      ddp=ddp, optimizer=opt, scheduler=build_scheduler(opt, 1e-3, 0, 10, 0.0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``run/checkpoints/step_{1,2}/{policy,rm}`` (models converted with a tokenizer) and
    ``random/checkpoints/step_1/policy`` (a ``model.init=random`` run's: no tokenizer files)."""
    root = tmp_path_factory.mktemp("ckptverify")
    hf = save_tiny_hf_model(str(root / "hf"), "qwen2", num_hidden_layers=2)
    save_tiny_tokenizer(hf)
    hf_to_mcore(hf, str(root / "policy_src"))
    hf_to_mcore(hf, str(root / "rm_src"), model_type="reward")
    with single_process_world():
        policy, rm = _state("policy", str(root / "policy_src")), _state("rm", str(root / "rm_src"))
        for step in (1, 2):
            save_training_checkpoint(str(root / "run" / "checkpoints"), step, [policy, rm], {})
        policy.source_ckpt = ""  # built with random weights: no checkpoint, so no tokenizer files
        save_training_checkpoint(str(root / "random" / "checkpoints"), 1, [policy], {})
    return root


def _flip_a_byte(folder: Path) -> str:
    """Flip one bit in the middle of the folder's first shard (inside a tensor); return the shard's name."""
    shard = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    data = bytearray((folder / shard).read_bytes())
    data[len(data) // 2] ^= 0x08
    (folder / shard).write_bytes(bytes(data))
    return shard


def _one_error(caplog) -> str:
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    caplog.clear()
    return errors[0]


def _nothing_written(parent: Path, name: str) -> None:
    assert not [n for n in os.listdir(parent) if n.startswith(name)], os.listdir(parent)


def test_crc32_of_pieces_combines_to_zlibs_and_ranks_share_the_work(tmp_path, monkeypatch):
    rng = random.Random(0)
    for n1, n2 in [(0, 0), (0, 5), (7, 0), (1, 1), (1000, 1), (3, 4096), (5000, 70000)]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b), (n1, n2)
    monkeypatch.setattr(manifest, "PIECE_BYTES", 1000)  # 5 pieces of one file, one of the other, an empty file
    (tmp_path / "m").mkdir()
    big, small = rng.randbytes(4500), rng.randbytes(999)
    (tmp_path / "m" / "big.distcp").write_bytes(big)
    (tmp_path / "m" / "small").write_bytes(small)
    (tmp_path / "m" / "empty").write_bytes(b"")
    files = write_manifest(str(tmp_path / "m"))["files"]
    assert files == {"big.distcp": {"size": 4500, "crc32": f"{zlib.crc32(big):08x}"},
                     "empty": {"size": 0, "crc32": "00000000"},
                     "small": {"size": 999, "crc32": f"{zlib.crc32(small):08x}"}}

    def three_ranks() -> list:
        """verify_checkpoint on three threads as three ranks, with an all-gather between them."""
        barrier, box, out = threading.Barrier(3), [None] * 3, [None] * 3

        def gather(mine):
            box[rank_of[threading.get_ident()]] = mine
            barrier.wait()
            return list(box)

        rank_of = {}

        def rank(r):
            rank_of[threading.get_ident()] = r
            out[r] = verify_checkpoint(str(tmp_path / "m"), rank=r, world=3, gather=gather)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    assert three_ranks() == [None] * 3
    data = bytearray(big)
    data[3210] ^= 1  # in the fourth piece: hashed by one rank only
    (tmp_path / "m" / "big.distcp").write_bytes(bytes(data))
    want = f"big.distcp has CRC-32 {zlib.crc32(bytes(data)):08x}, the manifest says {zlib.crc32(big):08x}"
    assert three_ranks() == [want] * 3


def test_a_flipped_byte_is_refused_by_every_reader(runs, tmp_path, caplog):
    shutil.copytree(runs / "run", tmp_path / "run")
    room = tmp_path / "run" / "checkpoints"
    policy, rm = room / "step_2" / "policy", room / "step_2" / "rm"
    shard = _flip_a_byte(policy)
    rm_shard = _flip_a_byte(rm)

    def refusal(ckpt: Path, shard: str) -> str:
        return (rf"^checkpoint '{re.escape(str(ckpt))}' is damaged: {ckpt.name}/{re.escape(shard)} has CRC-32 "
                rf"[0-9a-f]{{8}}, the manifest says [0-9a-f]{{8}} \({re.escape(str(room / 'step_2' / MANIFEST))}\); "
                rf"use the previous step's checkpoint, e.g. the newest other complete one: "
                rf"{re.escape(str(room / 'step_1' / ckpt.name))}$")

    out = tmp_path / "hf"
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(policy), "--out", str(out)]) == 2
    assert re.match(refusal(policy, shard), _one_error(caplog))
    _nothing_written(tmp_path, "hf")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "1+1?", "answer": "2"}\n')
    assert cli_main(["eval", "--model", str(policy), "--data", str(prompts), "--k", "1"]) == 2
    assert re.match(refusal(policy, shard), _one_error(caplog))
    pred = tmp_path / "pred.jsonl"
    assert cli_main(["eval-rm", "--ckpt", str(rm), "--data", VERIFYBENCH, "--predictions", str(pred)]) == 2
    assert re.match(refusal(rm, rm_shard), _one_error(caplog))
    _nothing_written(tmp_path, "pred")
    with single_process_world():  # the loaders of the trainers (RL, SFT, train-rm) and of the rehearsal
        with pytest.raises(ValueError, match=refusal(policy, shard)):
            load_checkpoint_model(str(policy), ParallelConfig())
        with pytest.raises(ValueError, match=refusal(rm, rm_shard)):
            load_checkpoint_tensors(str(rm))
    # the previous step, named in the message, is whole and exports (with the tokenizer it was trained with)
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(room / "step_1" / "policy"), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").is_file()


def test_an_unfinished_checkpoint_is_refused(runs, tmp_path, caplog):
    room = tmp_path / "run" / "checkpoints"
    shutil.copytree(runs / "run" / "checkpoints" / "step_1", room / "step_1")
    shutil.copytree(runs / "run" / "checkpoints" / "step_2", room / "step_4.tmp")  # its writer was killed
    os.remove(room / "step_4.tmp" / MANIFEST)
    ckpt = room / "step_4.tmp" / "policy"
    line = (f"checkpoint '{ckpt}' is unfinished: its training checkpoint {room / 'step_4.tmp'} was never completed "
            "(no manifest, not renamed); use the previous step's checkpoint, e.g. the newest other complete one: "
            f"{room / 'step_1' / 'policy'}")
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    assert _one_error(caplog) == line
    _nothing_written(tmp_path, "hf")
    with single_process_world(), pytest.raises(ValueError, match=re.escape(line)):
        load_checkpoint_model(str(ckpt), ParallelConfig())
    # a model checkpoint whose writer never renamed it (save_model_checkpoint_atomic's, hf_to_mcore's)
    tmp_model = tmp_path / "sft_out.tmp"
    shutil.copytree(runs / "policy_src", tmp_model)
    with pytest.raises(ValueError, match=rf"^checkpoint '{re.escape(str(tmp_model))}' is unfinished: it is a "
                                         r"temporary folder its writer never renamed into place; write it again"):
        mcore_to_hf(str(tmp_model), str(tmp_path / "hf"))


def test_model_checkpoints_carry_a_manifest_and_older_ones_are_read_with_a_warning(runs, tmp_path, caplog):
    src = runs / "policy_src"  # hf_to_mcore's output
    listed = set(json.loads((src / MANIFEST).read_text())["files"])
    assert listed == {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert "hf_extra/tokenizer.json" in listed
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = _flip_a_byte(bad)
    with pytest.raises(ValueError, match=rf"^checkpoint '{re.escape(str(bad))}' is damaged: {re.escape(shard)} has "
                                         r"CRC-32 [0-9a-f]{8}, the manifest says [0-9a-f]{8} .*; write it again "):
        mcore_to_hf(str(bad), str(tmp_path / "hf"))
    _nothing_written(tmp_path, "hf")
    old = tmp_path / "old"  # written before model checkpoints carried a manifest
    shutil.copytree(src, old)
    os.remove(old / MANIFEST)
    (tmp_path / MANIFEST).write_text("{}")  # another tool's file beside it: not a training checkpoint's
    with caplog.at_level(logging.WARNING):
        mcore_to_hf(str(old), str(tmp_path / "hf"))
    assert f"checkpoint {old} has no {MANIFEST} (written before model checkpoints carried one): its files are not " \
           "checked against checksums" in caplog.text
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_an_export_without_a_tokenizer_is_refused_naming_the_flag(runs, tmp_path, caplog):
    import transformers

    ckpt = runs / "random" / "checkpoints" / "step_1" / "policy"
    out = tmp_path / "hf"
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)]) == 2
    assert _one_error(caplog) == (
        f"checkpoint '{ckpt}' has no tokenizer (no tokenizer files in its hf_extra/: the checkpoints of a "
        "model.init=random run carry none), so its export could not be used: give one with --tokenizer DIR (an HF "
        "model or tokenizer folder, e.g. the run's model.policy_hf)")
    _nothing_written(tmp_path, "hf")
    big = save_tiny_tokenizer(str(tmp_path / "big_tok"), 200)  # ids past the model's 128
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--tokenizer", big]) == 2
    assert "has 200 token ids (0..199), the model" in _one_error(caplog)
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out),
                     "--tokenizer", str(tmp_path)]) == 2
    assert _one_error(caplog).startswith(f"--tokenizer '{tmp_path}': no tokenizer files in")
    _nothing_written(tmp_path, "hf")
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out),
                     "--tokenizer", str(runs / "hf")]) == 0
    tok, source = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (out, runs / "hf"))
    assert tok.get_vocab() == source.get_vocab() and len(tok) == 128 and tok.eos_token == "<|endoftext|>"
    assert transformers.AutoModelForCausalLM.from_pretrained(str(out)).config.vocab_size == 128


def test_checkpoint_tensors_are_read_only_behind_the_check():
    """megatron-core's and torch's checkpoint readers are called only in the checkpoint room and the HF
    export, behind :func:`open_model_checkpoint` (or resume's verification): no reader skips it."""
    readers = re.compile(r"\b(dist_checkpointing\.load|load_plain_tensors|dcp\.load|load_tensors_metadata)\(")
    allowed = {"checkpoint/model.py", "checkpoint/training.py", "convert/hf.py"}
    package = ROOT / "cooper_mcore"
    calls = {str(p.relative_to(package)) for p in package.rglob("*.py") if readers.search(p.read_text())}
    assert calls <= allowed, calls - allowed
