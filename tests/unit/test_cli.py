"""The `cooper` command: verify end to end, the parser (its refusals of bad input are cases of the
bad-input tier, ``tests/badinput/``)."""

import argparse
import importlib.metadata
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cooper_mcore.cli import HANDLERS, build_parser, handler, main


def test_cooper_verify(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    rows = [{"gold": "1/2", "pred": "thus \\boxed{0.5}"}, {"gold": "72", "pred": "so #### 71"},
            {"gold": "\\{1,2\\}", "pred": "$\\{2,1\\}$"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["verify", "--in", str(src), "--out", str(tmp_path / "out.jsonl"), "--timeout", "5"]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["correct"] for o in out] == [True, False, True]
    assert all(o["seconds"] >= 0 for o in out) and out[0]["gold"] == "1/2"
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["total"], summary["correct"], summary["wrong"]) == (3, 2, 1)


# -- the parser: help, version, overrides anywhere, a light import --------------------------------

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE_COMMANDS = {  # subcommand -> its required options
    "train": [], "config": [], "demo": [], "rehearse": ["--config", "p.yaml"],
    "plan": ["--gpus-per-node", "8", "--gpu-memory-gib", "80"], "sft": [], "train-rm": [],
}


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subparsers(sub))


@pytest.mark.parametrize("command", sorted(OVERRIDE_COMMANDS))
def test_overrides_on_both_sides_of_the_options(command):
    option = {"config": ["--show"], "plan": ["--json"]}.get(command, ["--out", "d"])
    args = build_parser().parse_args([command, "a.b=1", *OVERRIDE_COMMANDS[command], *option, "c.d=2"])
    assert args.overrides == ["a.b=1", "c.d=2"]
    assert args.command == command and getattr(args, "out", "d") == "d"


def test_config_takes_overrides_after_its_options(capsys):
    """The README's form: settings before and after an option, all applied."""
    rc = main(["config", "reward.mode=static_rm", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
               "train.steps=2"])
    assert rc == 0
    shown = {line.split("#")[0].strip() for line in capsys.readouterr().out.splitlines()}
    assert {'reward.mode="static_rm"', "train.steps=2"} <= shown


def test_a_mistyped_option_is_refused():
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["train", "--outt", "d"])
    assert info.value.code == 2


def test_every_option_has_help_and_every_command_a_handler():
    parser = build_parser()
    commands = set()
    for name, sub in [("cooper", parser), *_subparsers(parser)]:
        commands.add(name.split()[0])
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{name}: {action.option_strings or action.dest} has no help text"
    assert commands - {"cooper"} == set(HANDLERS)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["verify", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hard per-item timeout (s) (default: 5.0)" in out
    assert "(default: None)" not in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cooper {importlib.metadata.version('cooper_mcore')}"


def test_the_cli_imports_no_library_until_a_command_runs():
    """`cooper --help` and a mistyped flag must not pay megatron's, torch's and transformers' import
    (seconds): cli.py imports a handler only when its command runs (cli.HANDLERS)."""
    code = ("import sys\n"
            "from cooper_mcore.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['train', '--bad-flag']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('megatron', 'torch', 'transformers', 'omegaconf') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_every_handler_imports():
    for command in HANDLERS:
        assert callable(handler(command)), command


def test_rehearse_timeouts_default_to_the_rehearsals_limits():
    from cooper_mcore.rehearsal.run import Limits

    args = build_parser().parse_args(["rehearse", "--config", "p.yaml"])
    assert (args.startup_timeout, args.step_timeout) == (Limits().startup_s, Limits().step_s)


def test_the_planner_pages_plan_commands_run(monkeypatch, capsys):
    """The planner page's `cooper plan` lines, as written (no placeholder arguments)."""
    readme = (ROOT / "docs" / "planner.md").read_text()
    block = readme.split("## Memory planner")[1].split("```bash\n")[1].split("```")[0]
    commands = [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert len(commands) == 2
    monkeypatch.chdir(ROOT)
    for argv in commands:
        assert argv[:2] == ["cooper", "plan"] and "..." not in argv, argv
        assert main(argv[1:]) == 0, argv
