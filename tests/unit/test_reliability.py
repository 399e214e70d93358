"""Bad inputs get a clear error and nothing is lost (README "Reliability"), at the unit level:

* outputs written under a temporary name and renamed (every such writer) refuse a target that
  exists and is not a regular file (a FIFO, a link to /dev/null, a folder) instead of replacing it;
* ``cooper annotate`` on an input without rows, and a judge none of whose answers could be read,
  are errors (never a 0.0 score or an empty output with exit 0);
* a run folder that holds a run is continued or refused, never mixed (``check_run_folder``);
* Ctrl-C: the first is a stop signal, the second raises, forked children ignore both; the fault
  injection sends them;
* prompts too long for the policy's context are dropped and counted;
* a collective timeout is one clear line from the CLI.

The subprocess runs (a real trainer interrupted, a checkpoint write that fails, a collective that
times out) are in ``tests/multiproc/test_reliability_runs.py``; what ``cooper verify`` tells the user
about an output that is not a regular file or an input without rows are cases of the bad-input tier
(``tests/badinput/files.py``).

Only files under ``tmp_path`` are created or touched (``/dev/null`` is only pointed at).
"""

from __future__ import annotations

import json
import os
import signal
import stat
from types import SimpleNamespace

import pytest

from cooper_mcore.types import Prompt


@pytest.fixture
def specials(tmp_path):
    """Three targets that are not regular files, all in tmp_path: a FIFO, a link to /dev/null, a folder."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "null-link"
    os.symlink("/dev/null", link)
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"fifo": fifo, "link": link, "folder": folder}


def _untouched(specials):
    assert stat.S_ISFIFO(os.lstat(specials["fifo"]).st_mode)
    assert os.readlink(specials["link"]) == "/dev/null" and stat.S_ISCHR(os.stat(specials["link"]).st_mode)
    assert specials["folder"].is_dir()
    leftovers = [p.name for p in specials["fifo"].parent.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers, leftovers


# --------------------------------------------------------------------------- special files


@pytest.mark.parametrize("kind,what", [("fifo", "a FIFO"), ("link", "a character device"), ("folder", "a folder")])
def test_atomic_writes_refuse_a_target_that_is_not_a_regular_file(specials, kind, what):
    from cooper_mcore import atomic

    target = str(specials[kind])
    with pytest.raises(ValueError, match=rf"{target} exists and is not a regular file.*it is {what}"):
        atomic.check_output_path(target)
    with pytest.raises(ValueError, match="is not a regular file"):
        with atomic.atomic_open(target) as f:
            f.write("x")
    with pytest.raises(ValueError, match="is not a regular file"):
        atomic.write_json_atomic(target, {"a": 1})
    _untouched(specials)


def test_atomic_write_follows_a_link_to_a_regular_file_and_keeps_its_mode(tmp_path):
    from cooper_mcore import atomic

    real = tmp_path / "real.json"
    real.write_text("old")
    os.chmod(real, 0o640)
    link = tmp_path / "link.json"
    os.symlink(real.name, link)
    atomic.write_json_atomic(str(link), {"a": 1})
    assert os.path.islink(link) and json.loads(real.read_text()) == {"a": 1}
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o640
    new = tmp_path / "sub" / "new.txt"  # a new file in a new folder gets the umask's mode
    with atomic.atomic_open(str(new)) as f:
        f.write("hi")
    umask = os.umask(0)
    os.umask(umask)
    assert new.read_text() == "hi" and stat.S_IMODE(os.stat(new).st_mode) == 0o666 & ~umask


def test_a_failed_atomic_write_leaves_the_target_and_no_temporary_file(tmp_path):
    from cooper_mcore import atomic

    target = tmp_path / "out.txt"
    target.write_text("before")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.atomic_open(str(target)) as f:
            f.write("half")
            raise RuntimeError("boom")
    assert target.read_text() == "before" and os.listdir(tmp_path) == ["out.txt"]


def test_annotate_and_eval_rm_refuse_special_outputs_before_any_work(specials, tmp_path):
    from cooper_mcore.jobs.annotate import annotate
    from cooper_mcore.jobs.verify_rm import eval_rm

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"question": "1+1?", "reference": "2", "completion": "2"}) + "\n")
    judge = SimpleNamespace(chat_batch=lambda *a: pytest.fail("the judge was asked"))
    fifo, link = tmp_path / "fifo.jsonl", tmp_path / "null.parquet"  # annotate's outputs need a suffix
    os.mkfifo(fifo)
    os.symlink("/dev/null", link)
    with pytest.raises(ValueError, match="fifo.jsonl exists and is not a regular file"):
        annotate(str(inp), str(fifo), judge, None)
    with pytest.raises(ValueError, match="null.parquet exists and is not a regular file"):
        annotate(str(inp), str(tmp_path / "out.jsonl"), judge, None, judgements_path=str(link))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.readlink(link) == "/dev/null"
    # eval-rm's --predictions is checked before the checkpoint is even read
    with pytest.raises(ValueError, match="fifo exists and is not a regular file"):
        eval_rm(str(tmp_path / "no-such-ckpt"), str(inp), predictions_path=str(specials["fifo"]))
    assert not (tmp_path / "out.jsonl").exists()
    _untouched(specials)


def test_run_files_manifests_and_demo_files_refuse_special_targets(specials, tmp_path):
    from cooper_mcore.checkpoint.manifest import MANIFEST, write_manifest
    from cooper_mcore.demo.pipeline import write_jsonl
    from cooper_mcore.metrics import write_json_atomic

    with pytest.raises(ValueError, match="not a regular file"):
        write_json_atomic(str(specials["link"]), {"a": 1})  # run_config.json, summary.json
    with pytest.raises(ValueError, match="not a regular file"):
        write_jsonl(str(specials["fifo"]), [{"a": 1}])
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "data.bin").write_bytes(b"x")
    os.symlink("/dev/null", ckpt / MANIFEST)
    with pytest.raises(ValueError, match="not a regular file"):
        write_manifest(str(ckpt))
    assert os.readlink(ckpt / MANIFEST) == "/dev/null"
    _untouched(specials)


# --------------------------------------------------------------------------- nothing to do


class _Judge:
    url = "http://judge.example:8000/v1/chat/completions"
    model = "judge-7b"

    def __init__(self, answer):
        self.answer = answer

    def chat_batch(self, batch, temperature, max_tokens):
        return [self.answer] * len(batch)


class _AllRight:
    def verify_batch(self, golds, preds):
        return [SimpleNamespace(correct=True) for _ in preds]


def test_annotate_without_rows_or_without_a_readable_judge_answer_is_an_error(tmp_path):
    from cooper_mcore.jobs.annotate import JudgeUnavailable, annotate

    out = tmp_path / "out.jsonl"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: no valid rows"):
        annotate(str(empty), str(out), _Judge("yes"), _AllRight())
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"question": f"{i}+1?", "reference": str(i + 1), "completion": str(i + 1)})
                           + "\n" for i in range(3)))
    for answer, counts in (("", "0 requests failed after their retries, 3 answers had no text"),
                           ("   ", "3 answers had no text")):
        with pytest.raises(JudgeUnavailable, match=r"judge at http://judge\.example:8000/v1/chat/completions "
                                                   rf"\(model 'judge-7b'\) gave no answer with text .*{counts}"):
            annotate(str(inp), str(out), _Judge(answer), _AllRight(), judgements_path=str(tmp_path / "j.jsonl"))
        assert not out.exists() and not (tmp_path / "j.jsonl").exists()
    # a judge that answers but never yes or no: every row dropped as unparseable, counted, and said
    stats = annotate(str(inp), str(out), _Judge("maybe"), _AllRight(), judgements_path=str(tmp_path / "j.jsonl"))
    assert stats["kept"] == 0 and stats["dropped_judge_unparseable"] == 3 and out.read_text() == ""
    assert len((tmp_path / "j.jsonl").read_text().splitlines()) == 3
    out.unlink()
    stats = annotate(str(inp), str(out), _Judge("yes"), _AllRight())  # a judge that answers: as before
    assert stats["kept"] == 3 and out.exists()


def test_the_cli_reports_judge_and_collective_failures_in_one_line():
    from cooper_mcore import cli
    from cooper_mcore.jobs.annotate import JudgeUnavailable
    from cooper_mcore.parallel import CollectiveTimeout, collective_timeout

    assert cli.user_error(JudgeUnavailable("the judge is down")) == "the judge is down"
    e = CollectiveTimeout("rank 1 of 2: torch.distributed.barrier timed out", 1, "barrier", [0, 1])
    assert cli.user_error(e) == "rank 1 of 2: torch.distributed.barrier timed out"
    assert collective_timeout(RuntimeError("Timed out waiting 5000ms")) is None  # not from a collective
    assert collective_timeout(ValueError("timed out")) is None


# --------------------------------------------------------------------------- run folders


def _finished_run(out):
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "config.yaml").write_text("out: x\n")
    (out / "notes.txt").write_text("mine")


def test_a_run_folder_with_a_run_is_continued_or_refused_never_mixed(tmp_path):
    from cooper_mcore.rl.run_folder import check_run_folder, clear_run_folder

    out = tmp_path / "run"
    assert check_run_folder(str(out), "none", False) is False  # no folder yet
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # an empty history: a run that failed before its first step
    (out / "checkpoints").mkdir()
    assert check_run_folder(str(out), "none", False) is False
    _finished_run(out)
    with pytest.raises(FileExistsError, match=r"run folder .*run' already holds a run \(metrics.jsonl, checkpoints/\); "
                                              r"checkpoint.resume=none would .*use --resume auto to continue it, "
                                              r"another --out, or --overwrite \(checkpoint.overwrite=true\) to "
                                              r"start over"):
        check_run_folder(str(out), "none", False)
    other = tmp_path / "other" / "checkpoints" / "step_5"
    with pytest.raises(FileExistsError, match="already holds a run"):
        check_run_folder(str(out), str(other), False)  # another run's checkpoint into this folder
    assert check_run_folder(str(out), "auto", False) is False
    assert check_run_folder(str(out), str(out / "checkpoints" / "step_2"), False) is False
    assert check_run_folder(str(out), "none", True) is True
    assert check_run_folder(str(out), "auto", True) is True  # overwrite starts over, auto then finds nothing
    with pytest.raises(ValueError, match="including the checkpoint"):
        check_run_folder(str(out), str(out / "checkpoints" / "step_2"), True)
    clear_run_folder(str(out))
    assert sorted(os.listdir(out)) == ["notes.txt"]  # only what a run writes is deleted
    assert check_run_folder(str(out), "none", False) is False


def test_overwrite_is_a_documented_setting_and_a_train_option(tmp_path, monkeypatch):
    import cooper_mcore.commands.train as train_command
    from cooper_mcore import cli
    from cooper_mcore.config.schema import CheckpointConfig, field_docs

    assert CheckpointConfig().overwrite is False and "overwrite" in field_docs(CheckpointConfig)
    seen = []
    monkeypatch.setattr(train_command, "train_run", seen.append)
    preset = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_cpu.yaml")
    for flag, want in ((["--overwrite"], True), ([], False)):
        assert cli.main(["train", "--config", preset, "--out", str(tmp_path / "run"), *flag]) == 0
        assert seen.pop().checkpoint.overwrite is want


# --------------------------------------------------------------------------- Ctrl-C


def test_first_ctrl_c_is_a_stop_signal_the_second_raises():
    from cooper_mcore.job import StopSignal

    def unhandled(*_):  # what a SIGINT that StopSignal does not catch meets (not pytest's KeyboardInterrupt)
        raise AssertionError("SIGINT is not one of StopSignal's signals")

    before = signal.signal(signal.SIGINT, unhandled)
    stop = StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.caught == "SIGINT" and stop.any_rank()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs (and raises) before the next line
            pytest.fail("the second Ctrl-C did not raise")
    finally:
        stop.restore()
        assert signal.getsignal(signal.SIGINT) is unhandled
        signal.signal(signal.SIGINT, before)


def test_forked_children_ignore_the_stop_signals():
    """megatron-core forks its checkpoint writers while the trainer's handlers are installed: a
    Ctrl-C to the process group must not kill them (nor raise KeyboardInterrupt in them)."""
    from cooper_mcore.job import StopSignal

    stop = StopSignal()
    try:
        pid = os.fork()
        if pid == 0:  # the child: two Ctrl-C, a SIGTERM, a SIGUSR1; it must get to the end
            code = 1
            try:
                for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                    os.kill(os.getpid(), sig)
                code = 0 if stop.caught is None else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        stop.restore()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert stop.caught is None  # nothing reached the parent


def test_fault_specs_for_ctrl_c():
    from cooper_mcore.train.faults import format_fault, parse_fault

    assert parse_fault("ckpt_files@2/INT") == ("ckpt_files", 2, 0.0, signal.SIGINT)
    assert parse_fault("ckpt_policy@2+0.5/INT2") == ("ckpt_policy", 2, 0.5, signal.SIGINT)
    assert format_fault("ckpt_policy", 2, sig=signal.SIGINT, times=2) == "ckpt_policy@2/INT2"
    assert format_fault("ckpt_files", 2, sig=signal.SIGINT) == "ckpt_files@2/INT"
    with pytest.raises(ValueError, match="INT2"):
        parse_fault("ckpt_files@2/INT3")


# --------------------------------------------------------------------------- prompts too long


def _prompt(i, n):
    return Prompt(id=f"p{i}", question="q", answer="a", text="t", token_ids=list(range(n)))


def test_prompts_too_long_for_the_context_are_dropped_and_counted(caplog):
    from cooper_mcore.rl.setup import drop_too_long

    prompts = [_prompt(0, 10), _prompt(1, 30), _prompt(2, 24), _prompt(3, 25)]
    kept = drop_too_long(prompts, context=32, max_new_tokens=8, what="data.train_path x")
    assert [p.id for p in kept] == ["p0", "p2"]
    assert "skipping 2 of 4 prompts longer than 24 tokens" in caplog.text and "first ids: p1, p3" in caplog.text
    assert drop_too_long(prompts[:1], context=32, max_new_tokens=8, what="x") == prompts[:1]
    with pytest.raises(ValueError, match="every one of the 2 prompts is longer than 24 tokens.*first ids: p1, p3"):
        drop_too_long([prompts[1], prompts[3]], context=32, max_new_tokens=8, what="x")
    with pytest.raises(ValueError, match="max_new_tokens=32 leaves no room"):
        drop_too_long(prompts, context=32, max_new_tokens=32, what="x")
