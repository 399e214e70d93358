"""Reliability figures: injected faults, bad inputs, adversarial verifier items.

1. **Faults**: ``python -m tests.harness.fault_trials`` (a tiny CPU Cooper run SIGKILLed at
   seeded points: rollout, policy update, RM update, inside checkpoint writes, ...; each then
   resumed with ``--resume auto`` and compared bitwise with an uninterrupted run).
2. **Bad inputs**, each with the outcome it must have: refused with a ``ValueError`` /
   ``FileNotFoundError`` / ``FileExistsError`` whose message names the culprit (file and line,
   tensor name and both shapes, checkpoint path), skipped and counted with ``skip_malformed``,
   or, for valid but hostile data (huge strings, odd unicode), read back exactly. ``handled``
   counts the inputs whose outcome was that one; anything else (a crash, another exception, a
   vague message, a wrong result) is listed under the table.

   * malformed dataset rows and files through ``cooper_mcore.data.datasets.read_prompts``;
   * corrupt training checkpoints (from the fault trials' reference run) through ``find_resume``;
   * bad converter inputs through ``hf_to_mcore`` / ``mcore_to_hf``.
3. **Verifier**: adversarial LaTeX and junk through ``RuleVerifier`` (its hard per-item timeout,
   the trainer's default 5 s), one item at a time; the worst wall time is reported, and an item
   counts as handled when it returns a verdict (or "unverifiable") within timeout + 1 s.

    python benchmarks/reliability.py [--trials 10] [--seed 0] [--work DIR] [--verifier-timeout 5]

Prints a table and, as its last line,
``faults=<injected> resumed=<n> bitwise_equal=<n> bad_inputs=<tried> handled=<n> verifier_worst_s=<float>``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Outcome:
    """One bad input: its group, name, whether it was handled, and what happened."""

    group: str
    name: str
    handled: bool
    detail: str
    seconds: float = 0.0


def expect_error(group: str, name: str, fn: Callable[[], Any], *must_mention: str | tuple[str, ...]) -> Outcome:
    """``fn`` must raise a user error whose message contains every item of ``must_mention`` (a
    string, or a tuple of alternative spellings)."""
    t = time.perf_counter()
    try:
        result = fn()
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        msg = str(e)
        missing = [m for m in must_mention if not any(alt in msg for alt in ((m,) if isinstance(m, str) else m))]
        detail = f"{type(e).__name__}: {msg[:160]}" + (f" (does not mention {missing})" if missing else "")
        return Outcome(group, name, not missing, detail, time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return Outcome(group, name, False, f"unexpected {type(e).__name__}: {str(e)[:160]}", time.perf_counter() - t)
    return Outcome(group, name, False, f"accepted: {str(result)[:120]}", time.perf_counter() - t)


def expect_ok(group: str, name: str, fn: Callable[[], Any], check: Callable[[Any], bool]) -> Outcome:
    """``fn`` must succeed and ``check(result)`` must hold."""
    t = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001
        return Outcome(group, name, False, f"{type(e).__name__}: {str(e)[:160]}", time.perf_counter() - t)
    ok = bool(check(result))
    return Outcome(group, name, ok, "read correctly" if ok else f"wrong result: {str(result)[:120]}",
                   time.perf_counter() - t)


# --------------------------------------------------------------------------- datasets

GOOD = b'{"id": "good", "question": "1+1=", "answer": "2"}\n'
BAD_ROWS: dict[str, bytes] = {
    "invalid JSON": b'{"question": "1+1=", "answer": ',
    "invalid UTF-8": b'{"question": "\xff\xfe 1+1", "answer": "2"}',
    "not an object": b"[1, 2]",
    "missing question": b'{"answer": "2"}',
    "missing answer": b'{"question": "1+1="}',
    "question is a number": b'{"question": 5, "answer": "2"}',
    "question is null": b'{"question": null, "answer": "2"}',
    "question is a list": b'{"question": ["1+1="], "answer": "2"}',
    "answer is an object": b'{"question": "1+1=", "answer": {"value": 2}}',
    "answer is a boolean": b'{"question": "1+1=", "answer": true}',
    "empty question": b'{"question": "", "answer": "2"}',
    "empty answer": b'{"question": "1+1=", "answer": ""}',
    "NaN answer": b'{"question": "1+1=", "answer": NaN}',
    "Infinity answer": b'{"question": "1+1=", "answer": Infinity}',
    "repeated key": b'{"question": "a", "question": "b", "answer": "2"}',
    "duplicate id": b'{"id": "good", "question": "2+2=", "answer": "4"}',
    "unpaired surrogate": b'{"question": "\\ud800 1+1=", "answer": "2"}',
}


def dataset_cases(tmp: str) -> list[Outcome]:
    """Each malformed row after one good row: strict mode names file:line 2; skip mode keeps 1, skips 1."""
    from cooper_mcore.data.datasets import read_prompts

    out = []
    for i, (name, row) in enumerate(BAD_ROWS.items()):
        path = os.path.join(tmp, f"rows{i}.jsonl")
        with open(path, "wb") as f:
            f.write(GOOD + row + b"\n")
        strict = expect_error("dataset rows", name, lambda p=path: read_prompts(p), f"rows{i}.jsonl", "line 2")
        skip = expect_ok("dataset rows", name, lambda p=path: read_prompts(p, skip_malformed=True),
                         lambda r: len(r[0]) == 1 and r[0][0].id == "good" and r[1] == 1)
        out.append(Outcome("dataset rows", name, strict.handled and skip.handled,
                           f"strict: {strict.detail}; skip_malformed: {skip.detail}", strict.seconds + skip.seconds))

    def write(name: str, data: bytes) -> str:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    huge = "9" * 5_000_000 + "+0="
    uni = "√2·π ≈ 4.44? \u202edlrow\u202c e\u0301 \U0001F600 \u0000 \ufeff 中文"
    rows = [{"question": huge, "answer": "2"}, {"question": uni, "answer": uni}]
    p = write("hostile.jsonl", b"\xef\xbb\xbf" + b"\n\r\n".join(json.dumps(r).encode() for r in rows) + b"\n\n")
    out.append(expect_ok("dataset rows", "5 MB question, odd unicode, BOM, CRLF, blank lines",
                         lambda: read_prompts(p),
                         lambda r: [x.question for x in r[0]] == [huge, uni] and r[0][1].answer == uni))
    out.append(expect_error("dataset files", "missing file", lambda: read_prompts(os.path.join(tmp, "nope.jsonl")),
                            "nope.jsonl"))
    p = write("data.txt", GOOD)
    out.append(expect_error("dataset files", "unknown suffix", lambda: read_prompts(p), "data.txt"))
    p = write("empty.jsonl", b"")
    out.append(expect_error("dataset files", "empty file", lambda: read_prompts(p), "empty.jsonl"))
    p = write("allbad.jsonl", BAD_ROWS["missing answer"] + b"\n")
    out.append(expect_error("dataset files", "only malformed rows, skip mode",
                            lambda: read_prompts(p, skip_malformed=True), "allbad.jsonl"))
    out.extend(_parquet_cases(tmp, write))
    return out


def _parquet_cases(tmp: str, write: Callable[[str, bytes], str]) -> list[Outcome]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cooper_mcore.data.datasets import read_prompts

    out = []
    path = os.path.join(tmp, "typed.parquet")
    pq.write_table(pa.table({"question": ["1+1=", "2+2="], "answer": [[2], [4]]}), path)
    out.append(expect_error("dataset files", "Parquet: answer column of lists", lambda: read_prompts(path),
                            "typed.parquet", "row 0"))
    good = os.path.join(tmp, "good.parquet")
    pq.write_table(pa.table({"question": ["1+1="] * 50, "answer": ["2"] * 50}), good)
    with open(good, "rb") as f:
        data = f.read()
    p = write("truncated.parquet", data[: len(data) // 2])
    out.append(expect_error("dataset files", "Parquet: truncated file", lambda: read_prompts(p), "truncated.parquet"))
    p = write("garbage.parquet", b"PAR1" + os.urandom(300) + b"PAR1")
    out.append(expect_error("dataset files", "Parquet: garbage bytes", lambda: read_prompts(p), "garbage.parquet"))
    return out


# --------------------------------------------------------------------------- checkpoints


def checkpoint_cases(tmp: str, reference_ckpts: str) -> list[Outcome]:
    """Damage the newest of the reference run's checkpoints in every way; ``resume: auto`` must
    warn with its path and fall back to the previous one; an explicit path must be refused."""
    from cooper_mcore.checkpoint.manifest import MANIFEST
    from cooper_mcore.checkpoint.training import find_resume

    steps = sorted(int(n.split("_")[1]) for n in os.listdir(reference_ckpts) if n.startswith("step_"))
    prev, last = steps[-2], steps[-1]

    def truncate(d):
        f = os.path.join(d, "policy", "__0_0.distcp")
        os.truncate(f, os.path.getsize(f) // 2)

    def flip(d):
        f = os.path.join(d, "rm", "__0_1.distcp")
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 3)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x04]))

    damages: dict[str, Callable[[str], None]] = {
        "truncated .distcp": truncate,
        "one flipped bit": flip,
        "manifest deleted": lambda d: os.remove(os.path.join(d, MANIFEST)),
        "RNG file deleted": lambda d: os.remove(os.path.join(d, "rng", "rank0.pt")),
        "trainer.json emptied": lambda d: open(os.path.join(d, "trainer.json"), "w").close(),
        "manifest garbled": lambda d: open(os.path.join(d, MANIFEST), "w").write("{not json"),
        "policy folder deleted": lambda d: shutil.rmtree(os.path.join(d, "policy")),
    }
    out = []
    for i, (name, damage) in enumerate(damages.items()):
        root = os.path.join(tmp, f"ckpts{i}")
        shutil.copytree(reference_ckpts, root)
        bad = os.path.join(root, f"step_{last}")
        damage(bad)
        records: list[str] = []
        handler, ckpt_logger = _ListHandler(records), logging.getLogger("cooper_mcore.checkpoint.training")
        level = ckpt_logger.level
        ckpt_logger.addHandler(handler)
        ckpt_logger.setLevel(logging.WARNING)
        try:
            auto = expect_ok("checkpoints", name, lambda r=root: find_resume(r, "auto"),
                             lambda p, r=root: p == os.path.join(r, f"step_{prev}"))
        finally:
            ckpt_logger.removeHandler(handler)
            ckpt_logger.setLevel(level)
        warned = any(bad in r for r in records)
        explicit = expect_error("checkpoints", name, lambda b=bad: find_resume(os.path.dirname(b), b), bad)
        ok = auto.handled and warned and explicit.handled
        detail = (f"fell back to step_{prev}, warned: {records[0][:100]}" if ok else
                  f"auto: {auto.detail}; warned={warned}; explicit: {explicit.detail}")
        out.append(Outcome("checkpoints", name, ok, detail, auto.seconds + explicit.seconds))
    root = os.path.join(tmp, "ckpts_partial")
    shutil.copytree(reference_ckpts, root)
    os.makedirs(os.path.join(root, f"step_{last + 1}.tmp", "policy"))  # killed mid-write
    os.makedirs(os.path.join(root, f"step_{last + 2}", "rm"))  # a folder without anything
    out.append(expect_ok("checkpoints", "killed mid-write (*.tmp) and an empty step folder",
                         lambda: find_resume(root, "auto"), lambda p: p == os.path.join(root, f"step_{last}")))
    return out


class _ListHandler(logging.Handler):
    def __init__(self, records: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


# --------------------------------------------------------------------------- converter


def converter_cases(tmp: str) -> list[Outcome]:
    """Broken HF folders and Megatron checkpoints through the converter."""
    from safetensors.torch import load_file, save_file

    from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf
    from cooper_mcore.models.tiny import save_tiny_hf_model

    good = os.path.join(tmp, "hf_good")
    save_tiny_hf_model(good, "qwen2", "causal_lm", seed=0, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    weights = os.path.join(good, "model.safetensors")
    tensors = load_file(weights)
    victim = "model.layers.0.mlp.up_proj.weight"
    out = []

    def variant(name: str, edit: Callable[[str], None]) -> str:
        d = os.path.join(tmp, name)
        shutil.copytree(good, d)
        edit(d)
        return d

    def config_edit(**fields):
        def edit(d):
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            cfg.update(fields)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
        return edit

    def tensors_edit(fn):
        def edit(d):
            save_file(fn(dict(tensors)), os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return edit

    def reshaped(t):
        t[victim] = t[victim][:-8].contiguous()
        return t

    def dropped(t):
        del t[victim]
        return t

    def trunc(d):
        f = os.path.join(d, "model.safetensors")
        os.truncate(f, os.path.getsize(f) // 2)

    n = iter(range(100))

    def ckpt_out() -> str:
        return os.path.join(tmp, f"mcore{next(n)}")

    missing = os.path.join(tmp, "nope")
    out.append(expect_error("converter", "HF folder missing", lambda: hf_to_mcore(missing, ckpt_out()), "nope"))
    d = variant("hf_noconfig", lambda d: os.remove(os.path.join(d, "config.json")))
    out.append(expect_error("converter", "config.json missing", lambda: hf_to_mcore(d, ckpt_out()), "config.json"))
    d = variant("hf_arch", config_edit(architectures=["FooForCausalLM"]))
    out.append(expect_error("converter", "unknown architecture", lambda: hf_to_mcore(d, ckpt_out()), "FooForCausalLM"))
    d = variant("hf_shape", tensors_edit(reshaped))
    want, got = tuple(tensors[victim].shape), tuple(tensors[victim][:-8].shape)
    out.append(expect_error("converter", "tensor of the wrong shape", lambda: hf_to_mcore(d, ckpt_out()), victim,
                            (str(want), str(list(want))), (str(got), str(list(got)))))
    d = variant("hf_missing", tensors_edit(dropped))
    out.append(expect_error("converter", "tensor missing", lambda: hf_to_mcore(d, ckpt_out()), victim))
    d = variant("hf_trunc", trunc)
    out.append(expect_error("converter", "truncated safetensors", lambda: hf_to_mcore(d, ckpt_out()),
                            "model.safetensors"))
    d = variant("hf_config_size", config_edit(hidden_size=48))
    out.append(expect_error("converter", "config.json disagrees with the weights", lambda: hf_to_mcore(d, ckpt_out()),
                            "embed_tokens"))
    ckpt = os.path.join(tmp, "mcore_good")
    hf_to_mcore(good, ckpt)
    out.append(expect_error("converter", "output exists", lambda: hf_to_mcore(good, ckpt), ckpt))
    bad = os.path.join(tmp, "mcore_nometa")
    shutil.copytree(ckpt, bad)
    os.remove(os.path.join(bad, "cooper_model.json"))
    out.append(expect_error("converter", "checkpoint without cooper_model.json",
                            lambda: mcore_to_hf(bad, os.path.join(tmp, "hf_out1")), "cooper_model.json"))
    bad = os.path.join(tmp, "mcore_trunc")
    shutil.copytree(ckpt, bad)
    for name in os.listdir(bad):
        if name.endswith(".distcp"):
            os.truncate(os.path.join(bad, name), os.path.getsize(os.path.join(bad, name)) // 2)
    out.append(expect_error("converter", "checkpoint with truncated .distcp files",
                            lambda: mcore_to_hf(bad, os.path.join(tmp, "hf_out2")), "mcore_trunc"))
    return out


# --------------------------------------------------------------------------- verifier

ADVERSARIAL: list[tuple[str, str, str]] = [
    ("power tower", "1", "9^{9^{9^{9}}}"),
    ("boxed power tower", "1", "\\boxed{9^{9^{9^{9^{9}}}}}"),
    ("huge factorial", "\\frac{1}{2}", "\\boxed{1000000!}"),
    ("factorial of a tower", "1", "\\boxed{(10^{10^{10}})!}"),
    ("gold is a tower", "2^{2^{2^{2^{2}}}}", "\\boxed{2^{65536}}"),
    ("200 nested fractions", "2", "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}"),
    ("300 nested roots", "1", "\\boxed{" + "\\sqrt{" * 300 + "1" + "}" * 300 + "}"),
    ("100k-digit number", "10", "\\boxed{" + "1" * 100_000 + "}"),
    ("1 MB of junk", "3", "a" * 1_000_000),
    ("100k backslashes", "1", "\\" * 100_000),
    ("unclosed box", "1", "The answer is \\boxed{"),
    ("unbalanced braces", "1", "}}}}{{{{\\\\\\frac{{{"),
    ("10k boxes", "1", "\\boxed{1}" * 10_000),
    ("2000-term polynomial", "0", "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(2000)) + "}"),
    ("40x40 matrix", "1", "\\boxed{\\begin{pmatrix}" + "\\\\".join(" & ".join(["x"] * 40) for _ in range(40))
     + "\\end{pmatrix}}"),
    ("integral", "\\frac{\\sqrt{\\pi}}{2}", "\\boxed{\\int_0^\\infty e^{-x^2} dx}"),
    ("limit", "e", "\\boxed{\\lim_{n\\to\\infty} (1+1/n)^n}"),
    ("unicode, NUL, RTL", "1", "\u0000\u202e\U0001F600 \\boxed{\u0661} \ufeff"),
    ("deep exponent chain", "1", "\\boxed{" + "^".join(["2"] * 60) + "}"),
    ("sum to 10^12", "1", "\\boxed{\\sum_{k=1}^{10^{12}} k^{k}}"),
]


def verifier_cases(timeout_s: float, workers: int) -> tuple[list[Outcome], float]:
    """Each adversarial item alone through the verifier; handled = a verdict within timeout + 1 s."""
    from cooper_mcore.verify.rule import RuleVerifier

    out, worst = [], 0.0
    with RuleVerifier(timeout_s=timeout_s, num_workers=workers) as verifier:
        verifier.verify("1", "1")  # workers up
        for name, gold, pred in ADVERSARIAL:
            t = time.perf_counter()
            try:
                v = verifier.verify(gold, pred)
                took = time.perf_counter() - t
                ok = took <= timeout_s + 1.0 and v.status in ("ok", "timeout", "error")
                detail = f"{v.status} correct={v.correct} in {took:.2f}s"
            except Exception as e:  # noqa: BLE001
                took, ok, detail = time.perf_counter() - t, False, f"{type(e).__name__}: {e}"
            worst = max(worst, took)
            out.append(Outcome("verifier", name, ok, detail, took))
    return out, worst


# --------------------------------------------------------------------------- main


def fault_trials(work: str, trials: int, seed: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "tests.harness.fault_trials", "--work", work, "--trials",
                        str(trials), "--seed", str(seed), "--steps", "3"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"fault trials failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="", help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--verifier-timeout", type=float, default=5.0)
    p.add_argument("--verifier-workers", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    work = args.work or tempfile.mkdtemp(prefix="cooper_reliability_")
    os.makedirs(work, exist_ok=True)
    try:
        t = time.perf_counter()
        faults = fault_trials(os.path.join(work, "faults"), args.trials, args.seed)
        fault_s = time.perf_counter() - t
        from cooper_mcore.parallel import single_process_world

        bad: list[Outcome] = dataset_cases(_mk(work, "data"))
        bad += checkpoint_cases(_mk(work, "ckpt"), os.path.join(work, "faults", "reference", "checkpoints"))
        with single_process_world():
            bad += converter_cases(_mk(work, "convert"))
        verifier, worst = verifier_cases(args.verifier_timeout, args.verifier_workers)
        bad += verifier
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    print(f"{'part':<28}{'tried':>7}{'ok':>7}   notes")
    for kind, label in (("kill", "SIGKILL, resume auto"), ("sigterm", "SIGTERM, resume auto"),
                        ("corrupt", "corrupt newest checkpoint")):
        rows = [tr for tr in faults["trials"] if tr["trial"]["kind"] == kind]
        where = ", ".join(f"{tr['trial']['point']}@{tr['trial']['step']}" for tr in rows)
        print(f"{label:<28}{len(rows):>7}{sum(tr['bitwise_equal'] for tr in rows):>7}   "
              f"took effect {sum(tr['killed'] for tr in rows)}, resumed {sum(tr['resumed'] for tr in rows)}, "
              f"bitwise equal {sum(tr['bitwise_equal'] for tr in rows)}: {where}")
    print(f"{'':<42}   (fault trials {fault_s:.0f}s in all, reference run {faults['reference_seconds']:.0f}s)")
    groups: dict[str, list[Outcome]] = {}
    for o in bad:
        groups.setdefault(o.group, []).append(o)
    for g, items in groups.items():
        note = f"worst {worst:.2f}s (timeout {args.verifier_timeout:g}s)" if g == "verifier" else ""
        print(f"{g:<28}{len(items):>7}{sum(o.handled for o in items):>7}   {note}")
    failed = [o for o in bad if not o.handled] + [
        Outcome("faults", f"{t['trial']['point']}@{t['trial']['step']}", False, t["error"])
        for t in faults["trials"] if t["error"]]
    for o in failed:
        print(f"  NOT HANDLED [{o.group}] {o.name}: {o.detail}")
    slowest = sorted((o for o in bad if o.group == "verifier"), key=lambda o: -o.seconds)[:3]
    print("  slowest verifier items: " + "; ".join(f"{o.name} {o.detail}" for o in slowest))
    print(f"faults={faults['faults']} resumed={faults['resumed']} bitwise_equal={faults['bitwise_equal']} "
          f"bad_inputs={len(bad)} handled={sum(o.handled for o in bad)} verifier_worst_s={worst:.2f}")


def _mk(work: str, name: str) -> str:
    path = os.path.join(work, name)
    os.makedirs(path, exist_ok=True)
    return path


if __name__ == "__main__":
    main()
