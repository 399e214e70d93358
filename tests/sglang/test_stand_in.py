"""The test-only ``sgl_kernel`` stand-in (``stand_in/sgl_kernel``): it covers every name the
installed SGLang imports from ``sgl_kernel``, refuses loudly the ops it does not implement, and its
one implemented op matches the semantics of the Triton kernel it replaces on hand-made inputs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.sglang


def imported_from_sgl_kernel() -> dict[str, set[str]]:
    """``{module: names}`` of every ``from sgl_kernel[.sub] import name`` in the installed sglang."""
    import sglang

    found: dict[str, set[str]] = {}
    for path in Path(sglang.__file__).parent.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "sgl_kernel":
                found.setdefault(node.module, set()).update(a.name for a in node.names)
    return found


def test_the_stand_in_is_the_sgl_kernel_imported():
    import sgl_kernel

    assert "tests/sglang/stand_in" in Path(sgl_kernel.__file__).as_posix()
    assert sgl_kernel.__version__.endswith("cooper-test-stand-in")


def test_every_name_sglang_imports_is_importable():
    wanted = imported_from_sgl_kernel()
    assert sum(map(len, wanted.values())) > 100  # the scan did find SGLang's imports
    for module, names in sorted(wanted.items()):
        mod = importlib.import_module(module)
        for name in sorted(names - {"*"}):
            assert hasattr(mod, name), f"{module}.{name}"


def test_unimplemented_ops_raise_naming_the_op():
    import sgl_kernel
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.copy_all_layer_kv_cache_cpu is not implemented"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.flash_attn\.flash_attn_with_kvcache"):
        flash_attn_with_kvcache()
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # SGLang then takes its torch paths


def test_assign_req_to_token_pool_cpu():
    """Request i's slots (packed one after another in out_cache_loc) go to row req_pool_indices[i],
    columns start_offset[i]:end_offset[i]; nothing else changes."""
    from sgl_kernel import assign_req_to_token_pool_cpu

    table = torch.full((4, 10), -1, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    start, end = torch.tensor([0, 5, 3]), torch.tensor([3, 6, 3])  # the third request adds nothing
    slots = torch.tensor([100, 101, 102, 200], dtype=torch.int64)
    assign_req_to_token_pool_cpu(rows, table, start, end, slots, 10)
    expected = torch.full((4, 10), -1, dtype=torch.int32)
    expected[2, 0:3] = torch.tensor([100, 101, 102], dtype=torch.int32)
    expected[0, 5] = 200
    assert torch.equal(table, expected)
