"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from cooper_mcore.parallel import single_process_world


@pytest.fixture(scope="module")
def world():
    """A one-process megatron world (gloo) for the test module, torn down after it."""
    with single_process_world():
        yield
