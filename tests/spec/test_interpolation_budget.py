"""The interpolation budget (``relax.config.interpolation_budget``) refuses nothing omegaconf
resolves within the caps, and its size estimate is never below what omegaconf produces; the
hostile cases (bombs, cycles, decode tricks) are in tests/hostile/test_hostile_input_round2.py."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from omegaconf import OmegaConf

from relax.config import interpolation_budget as budget
from relax.spec import SpecError
from tests.spec.test_plain_specs import documents


def _resolved_size(value):
    if isinstance(value, dict):
        return sum(len(str(k)) + _resolved_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_resolved_size(v) for v in value)
    return len(str(value))


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents)
def test_what_omegaconf_resolves_passes_the_budget(data):
    try:
        cfg = OmegaConf.create(data)
        OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - omegaconf's own refusal; the budget may refuse it too
        return
    budget.check_budget(cfg)


@pytest.mark.parametrize("data", [
    {"name": "x", "out": "runs/${name}", "sub": {"a": "${.b}", "b": "${..name}"}},
    {"l": [1, 2], "a": "${l[0]}", "b": "${l.1}", "c": "${oc.select:l.0,5}", "d": "${oc.select:nope,'dflt'}"},
    {"home": "${oc.env:RELAX_BUDGET_TEST,default}", "n": "${oc.decode:${oc.env:RELAX_BUDGET_N,'3'}}"},
    {"s": {"k": 1, "v": "x"}, "keys": "${oc.dict.keys:s}", "vals": "${oc.dict.values:s}", "copy": "${s}",
     "text": "all: ${s}"},
    {"esc": "\\${name}", "name": "n", "q": "${oc.select:name,'a,b'}"},
    {"made": "${oc.create:{a: 1, b: [1, 2]}}"},
])
def test_ordinary_forms_pass_and_are_not_underestimated(data, monkeypatch):
    monkeypatch.setenv("RELAX_BUDGET_N", "7")
    cfg = OmegaConf.create(data)
    budget.check_budget(cfg)
    tree = OmegaConf.to_container(cfg, resolve=False)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    estimator = budget._Budget(tree)
    for key in data:
        assert estimator.node((key,)).size >= _resolved_size(resolved[key]) - 2, key


def test_the_first_value_past_the_cap_is_named():
    data = {"a0": "x"}
    for level in range(1, 8):
        data[f"a{level}"] = f"${{a{level - 1}}}" * 10
    with pytest.raises(SpecError) as caught:
        budget.check_budget(OmegaConf.create(data))
    issue = caught.value.issues[0]
    assert issue.path == "a4" and "lookups" in issue.message and str(budget.MAX_RESOLUTION_STEPS) in issue.message


def test_a_long_value_is_refused_by_size_not_steps():
    data = {"a": "x" * 300_000, "b": "${a}${a}${a}${a}"}
    with pytest.raises(SpecError) as caught:
        budget.check_budget(OmegaConf.create(data))
    assert caught.value.issues[0].path == "b" and "1200000 characters" in caught.value.issues[0].message


def test_the_environment_counts_at_its_size(monkeypatch):
    monkeypatch.setenv("RELAX_BUDGET_BIG", "y" * (budget.MAX_RESOLVED_CHARS // 2 + 1))
    with pytest.raises(SpecError) as caught:
        budget.check_budget(OmegaConf.create({"e": "${oc.env:RELAX_BUDGET_BIG}${oc.env:RELAX_BUDGET_BIG}"}))
    assert caught.value.issues[0].path == "e"
    assert os.environ["RELAX_BUDGET_BIG"]  # the value itself is never put in the message
    assert "yyyy" not in str(caught.value)
