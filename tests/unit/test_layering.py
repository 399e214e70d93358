"""The import layering of cooper_mcore (docs/architecture.md), checked on the source with ``ast``.

* The training layer does not import the HF converter (:mod:`cooper_mcore.convert`): models are
  saved and loaded through :mod:`cooper_mcore.checkpoint`; only the clients that convert (the
  ``cooper`` commands, the demo, policy evaluation, which exports to HF) import it.
* No import cycle between cooper_mcore's top-level packages and modules (``rl``, ``train``,
  ``checkpoint``, ``files``, ...), counting the imports a module makes when it is imported (those
  inside functions run later and are left out).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cooper_mcore"

#: the modules that convert models (or export them to HF) and so may import cooper_mcore.convert
CONVERTER_CLIENTS = ("cooper_mcore.convert", "cooper_mcore.commands", "cooper_mcore.demo",
                     "cooper_mcore.jobs.evaluate")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The absolute names an import statement imports (``from a import b`` gives ``a.b``)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolved against this module's package
            package = module.split(".")
            package = package if is_package else package[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        yield from (f"{base}.{alias.name}" for alias in node.names)


def _imports(tree: ast.AST, module: str, is_package: bool, in_functions: bool) -> Iterator[str]:
    """Every name ``tree`` imports; with ``in_functions=False`` only those run at import time."""
    for node in ast.iter_child_nodes(tree):
        if not in_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield from _imported(node, module, is_package)
        yield from _imports(node, module, is_package, in_functions)


def _unit(name: str) -> Optional[str]:
    """The top-level package or module of cooper_mcore that ``name`` belongs to (None outside)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "cooper_mcore" and len(parts) > 1 else None


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()


def unit_graph(modules: dict[str, ast.Module]) -> dict[str, dict[str, str]]:
    """``{unit: {imported unit: the first module of unit that imports it}}`` at import time."""
    graph: dict[str, dict[str, str]] = {}
    for module, tree in modules.items():
        src = _unit(module)
        if src is None:
            continue
        edges = graph.setdefault(src, {})
        for name in _imports(tree, module, _is_package(module), in_functions=False):
            dst = _unit(name)
            if dst is None or dst == src:
                continue
            if (PACKAGE / dst / "__init__.py").is_file() or (PACKAGE / f"{dst}.py").is_file():
                edges.setdefault(dst, module)
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> Optional[list[str]]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])) is not None:
            return found
    return None


def test_the_training_layer_does_not_import_the_converter():
    modules = _modules()
    training = [m for m in modules if not m.startswith(CONVERTER_CLIENTS) and m != "cooper_mcore"]
    for expected in ("cooper_mcore.rl.setup", "cooper_mcore.train.model_state", "cooper_mcore.checkpoint.training",
                     "cooper_mcore.jobs.sft", "cooper_mcore.jobs.verify_rm", "cooper_mcore.rollout.weight_sync",
                     "cooper_mcore.config.checks", "cooper_mcore.planner.report"):
        assert expected in training, expected  # the scan sees the modules it is about
    offenders = sorted(
        f"{m} imports {name}" for m in training
        for name in _imports(modules[m], m, _is_package(m), in_functions=True)
        if name == "cooper_mcore.convert" or name.startswith("cooper_mcore.convert."))
    assert offenders == [], "the training layer imports the converter:\n" + "\n".join(offenders)


def test_no_import_cycle_between_top_level_packages_and_modules():
    graph = unit_graph(_modules())
    assert "train" in graph["rl"] and "checkpoint" in graph["convert"]  # the scan sees real edges
    cycle = find_cycle(graph)
    if cycle is not None:
        steps = [f"{a} -> {b} (in {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between cooper_mcore's top-level packages/modules:\n  " + "\n  ".join(steps))


def test_the_cycle_finder_finds_and_names_a_cycle():
    assert find_cycle({"a": {"b": "x"}, "b": {"c": "y"}, "c": {}}) is None
    assert find_cycle({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}}) == ["a", "b", "c", "a"]
    tree = ast.parse("import os\nfrom cooper_mcore.train import step\n"
                     "def f():\n    from cooper_mcore.rl import loop\n")
    assert list(_imports(tree, "cooper_mcore.x", False, in_functions=False)) == ["os", "cooper_mcore.train.step"]
    assert "cooper_mcore.rl.loop" in list(_imports(tree, "cooper_mcore.x", False, in_functions=True))
