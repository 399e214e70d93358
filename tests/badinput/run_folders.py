"""Run folders: one another run holds, a resume that would change what is trained, a folder that holds a
run started over by mistake, and output folders that cannot be written (read only, a dangling symlink
whose target cannot be made)."""

from __future__ import annotations

import os

from cooper_mcore.config.schema import load_config, to_dict
from cooper_mcore.config.versions import RECORD_FILE, ConfigRecord, write_record
from tests.badinput.case import FIXED, TINY_RUN, Case, Env, fill
from tests.conftest import hold_lock

HISTORY = '{"step": 1}\n{"step": 2}\n'


def held(lock: str):
    """A setup: another process holds the run-folder lock file ``lock`` (under ``{tmp}``) for the case."""

    def setup(env: Env) -> dict[str, str]:
        holder = hold_lock(lock.replace("{tmp}", str(env.tmp)))

        def stop() -> None:
            holder.kill()
            holder.wait()

        env.cleanup(stop)
        return {"pid": str(holder.pid)}

    return setup


def recorded(*settings: str):
    """A setup: ``{tmp}/run`` holds two steps of a tiny run whose ``config.yaml`` records ``settings``
    (what ``cooper train`` wrote when it started)."""

    def setup(env: Env) -> dict[str, str]:
        run = env.tmp / "run"
        (run / "checkpoints" / "step_2").mkdir(parents=True)
        (run / "metrics.jsonl").write_text(HISTORY)
        values = {**FIXED, "runs": str(env.runs)}
        overrides = [o for o in fill(TINY_RUN, values) if "=" in o] + [f"out={run}", *settings]
        cfg = load_config(fill(["{tiny}"], values)[0], overrides)
        write_record(str(run / RECORD_FILE), ConfigRecord.start(to_dict(cfg)))
        return {}

    return setup


def read_only(env: Env) -> dict[str, str]:
    """``{tmp}/read_only``: a folder this process may not write into. Root writes through any mode bits, so
    there it is refused the way the kernel refuses it to another user (os.access says no)."""
    folder = env.tmp / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    env.cleanup(lambda: folder.chmod(0o755))
    if os.access(folder, os.W_OK):  # root
        real_access = os.access

        def access(path, mode, *args, **kwargs):
            if os.path.abspath(path) == str(folder) and mode & os.W_OK:
                return False
            return real_access(path, mode, *args, **kwargs)

        env.monkeypatch.setattr(os, "access", access)
    (env.tmp / "labeled.jsonl").write_text("")
    return {}


def dangling_link(env: Env) -> dict[str, str]:
    """``{tmp}/run``: a symlink to a folder that does not exist and cannot be made (a file is in the way)."""
    (env.tmp / "file").write_text("x")
    os.symlink(env.tmp / "file" / "sub", env.tmp / "run")
    return {}


RESUME = ("train", *TINY_RUN, "--out", "{tmp}/run", "--resume", "auto")
IN_USE = "run folder '{tmp}/{out}' is in use by another run: pid {pid} on host "
SFT_JOB = ("sft", "--config", "{sft_preset}", "--ckpt", "{runs}/policy_src", "--out", "{tmp}/out", "train.steps=1",
           "data.num_examples=4", "train.global_batch_size=4", "train.micro_batch_size=4")
RM_JOB = ("train-rm", "--config", "{rm_preset}", "--ckpt", "{runs}/rm_src", "--out", "{tmp}/out", "train.epochs=1",
          "data.train_path={verifybench}")

CASES = [
    Case("train on a run folder another run holds", ("train", *TINY_RUN, "--out", "{tmp}/run"),
         (IN_USE.replace("{out}", "run"), "use another --out (lock file {tmp}/run/run.lock"),
         held("{tmp}/run/run.lock")),
    # SFT's output appears whole at the end: its lock is a file beside it
    Case("sft into an output another run holds", SFT_JOB, (IN_USE.replace("{out}", "out"),), held("{tmp}/out.lock")),
    Case("train-rm into a folder another run holds", RM_JOB, (IN_USE.replace("{out}", "out"),),
         held("{tmp}/out/run.lock")),
    Case("resume with reward.mode changed", (*RESUME, "reward.mode=rule"),
         ("run folder '{tmp}/run' holds a run whose settings (config.yaml, version 1) differ in what it trains: "
          'reward.mode: "cooper" -> "rule". ', "--allow-config-change (checkpoint.allow_config_change=true)"),
         recorded()),
    Case("resume a model.init=random run from a checkpoint", RESUME, ('model.init: "random" -> "checkpoint"',),
         recorded("model.init=random")),
    Case("start a run over in a folder that holds one", ("train", *TINY_RUN, "--out", "{tmp}/run", "--resume", "none"),
         ("run folder '{tmp}/run' already holds a run (metrics.jsonl, checkpoints/)", "use --resume auto to continue "
          "it, another --out, or --overwrite"), recorded()),
    Case("train into a read-only folder", ("train", *TINY_RUN, "--out", "{tmp}/read_only/run"),
         ("permission denied on '{tmp}/read_only'", "--out"), read_only),
    Case("train-rm into a read-only folder", ("train-rm", "--ckpt", "{runs}/rm_src", "--train", "{tmp}/labeled.jsonl",
                                              "--out", "{tmp}/read_only/rm"),
         ("permission denied on '{tmp}/read_only'",), read_only),
    Case("train into a symlink whose target cannot be made", ("train", *TINY_RUN, "--out", "{tmp}/run"),
         ("{tmp}/run is a symlink to {tmp}/file/sub, which does not exist and cannot be created (Not a directory)",),
         dangling_link),
]
