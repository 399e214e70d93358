"""What users install is what works: the sdist and the wheel built from the files of a clean
checkout, the wheel installed (not editable) into a fresh virtual environment, and the ``cooper``
command run from a folder outside the checkout, as a user or the Dockerfile's image runs it.

The fresh environment reuses the dependencies already installed beside the tests (a ``.pth`` file
points at a view of their site-packages that leaves out this checkout's editable install), so no
second torch is installed; ``pip install --no-index`` of the wheel still resolves every requirement
the wheel declares against them and fails if one is missing.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.packaging
PRESET_FILES = ("cooper_mcore/presets/tiny_cpu.yaml", "cooper_mcore/presets/jobs/sft_tiny_cpu.yaml",
                "cooper_mcore/presets/model_configs/qwen2.5-1.5b-instruct.json")


def run(cmd: list[str], cwd: Path, timeout: int = 600, env: dict | None = None) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=env or dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-4000:]}\n" \
                              f"{r.stderr[-4000:]}"
    return r.stdout + r.stderr


def checkout_files() -> list[str]:
    """The files a clean clone of this checkout has (tracked, and new files git does not ignore)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return sorted(f for f in out.split("\0") if f and os.path.isfile(ROOT / f))


def package_modules(files: list[str]) -> set[str]:
    """The checkout's modules of cooper_mcore, as paths inside a wheel."""
    return {f for f in files if f.startswith("cooper_mcore/") and f.endswith(".py")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist built from a copy of the checkout's files, and the wheel built from that sdist."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "checkout"
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    dist = root / "dist"
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), str(src)], cwd=root)
    sdist = next(dist.glob("*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(root / "unpacked", filter="data")
    unpacked = next((root / "unpacked").iterdir())
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(unpacked)], cwd=root)
    return {"root": root, "sdist": sdist, "wheel": next(dist.glob("*.whl"))}


def missing_from_wheel(files: list[str], wheel: Path) -> set[str]:
    """The checkout's modules of cooper_mcore that ``wheel`` lacks."""
    with zipfile.ZipFile(wheel) as whl:
        return package_modules(files) - set(whl.namelist())


def test_the_wheel_holds_every_module_and_the_presets(built):
    missing = missing_from_wheel(checkout_files(), built["wheel"])
    assert not missing, f"modules of the checkout missing from the wheel (a folder without __init__.py?): " \
                        f"{sorted(missing)[:8]}"
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
    assert set(PRESET_FILES) <= names, sorted(set(PRESET_FILES) - names)
    assert not any(n.startswith("tests/") for n in names)


def test_a_folder_of_modules_without_init_fails_the_check(built):
    """The check above catches what it is for: a new folder of modules that the wheel skips."""
    src = built["root"] / "checkout"
    room = src / "cooper_mcore" / "newroom"
    room.mkdir()
    (room / "mod.py").write_text('"""A module in a folder without __init__.py."""\n')
    try:
        out = built["root"] / "dist-newroom"
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
             str(src)], cwd=built["root"])
        files = [str(p.relative_to(src)) for p in src.rglob("*.py")]
        assert missing_from_wheel(files, next(out.glob("*.whl"))) == {"cooper_mcore/newroom/mod.py"}
    finally:
        shutil.rmtree(room)


def _dependency_view(dest: Path) -> Path:
    """A folder of links to the test environment's site-packages, this checkout's own install left out."""
    dest.mkdir()
    source = Path(site.getsitepackages()[0])
    for entry in source.iterdir():
        if "cooper_mcore" in entry.name or entry.name.startswith("__editable__"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def installed(built) -> dict[str, Path]:
    """A fresh virtual environment with the wheel installed from file, and an empty folder to run in."""
    root = built["root"]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip: the tests' own
    py = venv / "bin" / "python"
    own_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    (own_site / "_cooper_test_deps.pth").write_text(str(_dependency_view(root / "deps")) + "\n")
    env = dict(os.environ, PYTHONPATH="", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index", str(built["wheel"])],
        cwd=root, env=env)
    work = root / "elsewhere"
    work.mkdir()
    return {"venv": venv, "py": py, "cooper": venv / "bin" / "cooper", "work": work}


def test_the_installed_package_is_the_wheel(installed):
    out = run([str(installed["py"]), "-c", "import cooper_mcore, cooper_mcore.config.schema as s; "
               "print(cooper_mcore.__file__); print(s.__file__)"], cwd=installed["work"])
    assert all(line.startswith(str(installed["venv"])) for line in out.split()), out


def test_the_cli_runs_from_the_wheel(installed):
    """Every command a new user meets first, outside the checkout: version, a shipped preset, tiny
    assets, one Cooper step with a checkpoint, its export to HF and a memory plan."""
    cooper, work = str(installed["cooper"]), installed["work"]
    assert "0.1.0" in run([cooper, "--version"], cwd=work)
    shown = run([cooper, "config", "--config", "tiny_cpu"], cwd=work)
    assert 'reward.mode="cooper"' in shown and "tiny_cpu.yaml" in shown
    run([cooper, "tiny-assets", "--out", "runs/tiny_assets"], cwd=work)
    run([cooper, "train", "--config", "tiny_cpu", "--out", "runs/one", "train.steps=1", "checkpoint.every=1",
         "eval.every=1", "data.eval_limit=4", "logging.wandb=false"], cwd=work)
    ckpt = work / "runs" / "one" / "checkpoints" / "step_1" / "policy"
    assert ckpt.is_dir(), sorted(p.name for p in (work / "runs" / "one").rglob("*"))[:20]
    run([cooper, "convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", "runs/hf"], cwd=work)
    assert (work / "runs" / "hf" / "config.json").is_file()
    plan = run([cooper, "plan", "--config", "qwen2.5-1.5b_8xh100", "--gpus-per-node", "8", "--gpu-memory-gib",
                "80"], cwd=work)
    assert "policy_update" in plan
