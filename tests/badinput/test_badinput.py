"""Every bad-input case (the tier's module doc lists them, and those covered elsewhere), run by the one
checker: exit code, one clear line naming the culprit, no traceback, nothing lost, the fix then works."""

from __future__ import annotations

import pytest

from tests.badinput import checkpoints, files, run_folders, settings, training
from tests.badinput.case import Case, check_case

CASES: list[Case] = [*checkpoints.CASES, *run_folders.CASES, *settings.CASES, *training.CASES, *files.CASES]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, env, caplog, capsys):
    check_case(case, env, caplog, capsys)


def test_each_case_once():
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
