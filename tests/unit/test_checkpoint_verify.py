"""Checkpoints are verified wherever they are read, and an HF export always has its tokenizer: the
library's side.

The trainer's own checkpoints (:func:`tests.conftest.checkpoint_runs`: written by
``save_training_checkpoint``; and a ``model.init=random`` run's, whose models carry no tokenizer):
one flipped byte in a shard, or an unfinished ``step_<n>.tmp``, is refused by the loaders the
trainers and the rehearsal use, and by the converter; model checkpoints carry a manifest (older ones
are read with a warning); an export given ``--tokenizer`` writes the one transformers loads; no
checkpoint reader skips the check. CRC-32s of pieces are checked against zlib's CRC-32 of the whole.
What ``cooper convert``, ``cooper eval``, ``eval-rm``, ``train``, ``sft`` and ``train-rm`` tell the user
about these checkpoints are cases of the bad-input tier (``tests/badinput/checkpoints.py``).
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
from cooper_mcore.checkpoint.model import load_checkpoint_model, load_checkpoint_tensors
from cooper_mcore.cli import main as cli_main
from cooper_mcore.convert.hf import mcore_to_hf
from cooper_mcore.parallel import ParallelConfig, single_process_world
from tests.conftest import ROOT, flip_a_byte


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


def test_a_flipped_byte_is_refused_by_every_loader(checkpoint_runs, tmp_path):
    shutil.copytree(checkpoint_runs / "run", tmp_path / "run")
    room = tmp_path / "run" / "checkpoints"
    policy, rm = room / "step_2" / "policy", room / "step_2" / "rm"
    shard = flip_a_byte(policy)
    rm_shard = flip_a_byte(rm)

    def refusal(ckpt: Path, shard: str) -> str:
        return (rf"^checkpoint '{re.escape(str(ckpt))}' is damaged: {ckpt.name}/{re.escape(shard)} has CRC-32 "
                rf"[0-9a-f]{{8}}, the manifest says [0-9a-f]{{8}} \({re.escape(str(room / 'step_2' / MANIFEST))}\); "
                rf"use the previous step's checkpoint, e.g. the newest other complete one: "
                rf"{re.escape(str(room / 'step_1' / ckpt.name))}$")

    with single_process_world():  # the loaders of the trainers (RL, SFT, train-rm) and of the rehearsal
        with pytest.raises(ValueError, match=refusal(policy, shard)):
            load_checkpoint_model(str(policy), ParallelConfig())
        with pytest.raises(ValueError, match=refusal(rm, rm_shard)):
            load_checkpoint_tensors(str(rm))
    with pytest.raises(ValueError, match=refusal(policy, shard)):
        mcore_to_hf(str(policy), str(tmp_path / "hf"))
    _nothing_written(tmp_path, "hf")
    # the previous step, named in the message, is whole and exports (with the tokenizer it was trained with)
    mcore_to_hf(str(room / "step_1" / "policy"), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_an_unfinished_checkpoint_is_refused(checkpoint_runs, tmp_path):
    room = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoint_runs / "run" / "checkpoints" / "step_1", room / "step_1")
    shutil.copytree(checkpoint_runs / "run" / "checkpoints" / "step_2", room / "step_4.tmp")  # its writer was killed
    os.remove(room / "step_4.tmp" / MANIFEST)
    ckpt = room / "step_4.tmp" / "policy"
    line = (f"checkpoint '{ckpt}' is unfinished: its training checkpoint {room / 'step_4.tmp'} was never completed "
            "(no manifest, not renamed); use the previous step's checkpoint, e.g. the newest other complete one: "
            f"{room / 'step_1' / 'policy'}")
    with single_process_world(), pytest.raises(ValueError, match=re.escape(line)):
        load_checkpoint_model(str(ckpt), ParallelConfig())
    # a model checkpoint whose writer never renamed it (save_model_checkpoint_atomic's, hf_to_mcore's)
    tmp_model = tmp_path / "sft_out.tmp"
    shutil.copytree(checkpoint_runs / "policy_src", tmp_model)
    with pytest.raises(ValueError, match=rf"^checkpoint '{re.escape(str(tmp_model))}' is unfinished: it is a "
                                         r"temporary folder its writer never renamed into place; write it again"):
        mcore_to_hf(str(tmp_model), str(tmp_path / "hf"))
    _nothing_written(tmp_path, "hf")


def test_model_checkpoints_carry_a_manifest_and_older_ones_are_read_with_a_warning(checkpoint_runs, tmp_path,
                                                                                    caplog):
    src = checkpoint_runs / "policy_src"  # hf_to_mcore's output
    listed = set(json.loads((src / MANIFEST).read_text())["files"])
    assert listed == {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert "hf_extra/tokenizer.json" in listed
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = flip_a_byte(bad)
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


def test_an_export_given_a_tokenizer_writes_the_one_transformers_loads(checkpoint_runs, tmp_path):
    """A ``model.init=random`` run's checkpoint has no tokenizer: ``--tokenizer`` gives the one the export
    carries (the refusals without it are bad-input cases)."""
    import transformers

    ckpt = checkpoint_runs / "random" / "checkpoints" / "step_1" / "policy"
    out = tmp_path / "hf"
    assert cli_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out),
                     "--tokenizer", str(checkpoint_runs / "hf")]) == 0
    tok, source = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (out, checkpoint_runs / "hf"))
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
