"""The metric schema (cooper_mcore.metric_names): every key named once with a one-line description,
and docs/metrics.md equal to its rendering."""

from __future__ import annotations

import pytest

from cooper_mcore import metric_names as N
from tests.conftest import ROOT


def test_the_checked_in_page_is_the_rendering():
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert page == N.render_page(), "docs/metrics.md is stale: python -m cooper_mcore.metric_names > docs/metrics.md"


def test_every_key_is_in_the_schema_once_with_a_one_line_description():
    constants = [v for k, v in vars(N.MetricKey).items() if k.isupper()]
    assert len(constants) == len(set(constants)) and set(constants) <= set(N.SCHEMA)
    phases = [v for k, v in vars(N.Phase).items() if k.isupper()]
    for phase in phases:
        assert N.time_key(phase) in N.SCHEMA and N.memory_key(phase) in N.SCHEMA, phase
    assert set(N.SCHEMA) == set(constants) | {f(p) for p in phases for f in (N.time_key, N.memory_key)}
    for m in N.SCHEMA.values():
        assert m.description.strip() and "\n" not in m.description and m.written.strip(), m.key
        assert m.section in N.SECTIONS, m.key
    assert N.MetricKey.TIME_STEP == N.time_key("step")  # the timer's total is a time/ key like the phases'


def test_a_key_is_defined_once():
    with pytest.raises(ValueError, match="defined twice"):
        N._define(N.MetricKey.REWARD_MEAN, "rollouts", "every step", "again")
    with pytest.raises(ValueError, match="unknown section"):
        N._define("new/key", "nowhere", "every step", "a key in no section")
    assert "new/key" not in N.SCHEMA
