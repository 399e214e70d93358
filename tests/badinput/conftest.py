"""The bad-input tier's fixture: each case's folder and environment."""

from __future__ import annotations

import pytest

from tests.badinput.case import Env


@pytest.fixture
def env(tmp_path, checkpoint_runs, monkeypatch, request) -> Env:
    """A case's own folder (``{tmp}``), the shared checkpoints (``{runs}``) and what the setup may change."""
    folder = tmp_path / "case"
    folder.mkdir()
    return Env(folder, checkpoint_runs, monkeypatch, request.addfinalizer)
