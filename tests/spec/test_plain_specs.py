"""A plain spec file is resolved without omegaconf (``relax.config.plain``) to exactly what omegaconf
resolves it to; whatever it does not answer for goes through omegaconf as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import relax.config.loader as loader
from relax.config import load_spec_dict
from relax.config.plain import resolve_plain
from relax.spec import SpecError
from relax.config.loader import PRESETS_DIR

ROOT = Path(__file__).resolve().parents[2]


def typed(value: Any) -> Any:
    """``value`` with each scalar's type beside it, so that 1, 1.0 and True differ (and NaN equals
    itself once compared by ``repr``)."""
    if isinstance(value, dict):
        return [(type(k).__name__, k, typed(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, repr(value))


def through_omegaconf(data: dict[str, Any]) -> Any:
    """What the loader made of a file before: omegaconf's container, resolved, keys as strings;
    the exception's type when omegaconf refuses it."""
    try:
        return typed(loader._plain(OmegaConf.to_container(OmegaConf.create(data), resolve=True)))
    except Exception as exc:  # noqa: BLE001 - any refusal counts: the plain path must not answer then
        return type(exc).__name__


KEYS = ["name", "seed", "a", "b", "trainer", "steps", "output_dir", "x-y", "", "a.b", "1", "$", "${a}", "???"]
TEXTS = ["${name}", "runs/${name}", "${a.b}", "${trainer.steps}", "x${a}y${b}z", "${a}${b}", "${trainer}",
         "${nope}", "${oc.env:HOME}", "\\${name}", "a\\${name}", "${.name}", "${ name }", "${a.0}", "${a[0]}",
         "${${a}}", "$name", "{name}", "${", "}", "???", "~", "", "plain", "a/b\\c", "${a.b.c}",
         "${a:b}", "${oc.select:a,1}", "$${name}", "{${name}}", "${name}$"]
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
           | st.sampled_from(TEXTS) | st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4),
                      max_leaves=12)
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents)
def test_plain_path_agrees_with_omegaconf(data):
    plain = resolve_plain(data)
    if plain is not None:
        assert typed(plain) == through_omegaconf(data)


@pytest.mark.parametrize("data, expected", [
    ({"name": "tiny", "trainer": {"output_dir": "runs/${name}", "steps": 60}},
     {"name": "tiny", "trainer": {"output_dir": "runs/tiny", "steps": 60}}),
    ({"a": {"b": 3}, "c": "${a.b}", "d": "n${a.b}", "e": 1.5, "f": "${e}/${a.b}"},
     {"a": {"b": 3}, "c": 3, "d": "n3", "e": 1.5, "f": "1.5/3"}),
    ({"flag": True, "s": "${flag}", "t": "is ${flag}", "extends": None},
     {"flag": True, "s": True, "t": "is True", "extends": None}),
])
def test_plain_interpolations(data, expected):
    assert typed(resolve_plain(data)) == typed(expected) == through_omegaconf(data)


@pytest.mark.parametrize("data", [
    {"extends": "tiny-cpu"},
    {"a": "${oc.env:HOME}"},
    {"a": "\\${b}", "b": 1},
    {"a": {"b": "${.c}", "c": 1}},
    {"a": "${b}", "b": {"c": 1}},
    {"a": "${b}", "b": None},
    {"a": "${b}", "b": "???"},
    {"a": "${b}", "b": "${c}", "c": 1},
    {"a": "${b.0}", "b": [1]},
    {"a": "${b.c}", "b": "c"},
    {"a": "${b.c}", "b": ["c"]},
    {"a": "${b.c}", "b": 1},
    {"a": "${missing}"},
    {1: "one"},
    {"a": {"b": __import__("datetime").date(2024, 1, 1)}},
])
def test_what_only_omegaconf_resolves(data):
    assert resolve_plain(data) is None


@pytest.mark.parametrize("spec", sorted([*PRESETS_DIR.glob("*.yaml"), *ROOT.glob("examples/*.yaml")]),
                         ids=lambda p: p.name)
def test_shipped_specs_load_the_same_either_way(spec, monkeypatch):
    fast = load_spec_dict(spec)
    monkeypatch.setattr(loader, "resolve_plain", lambda data: None)
    assert typed(fast[0]) == typed(load_spec_dict(spec)[0]) and fast[1] == spec.parent


def test_errors_still_worded_by_omegaconf(tmp_path):
    spec = tmp_path / "run.yaml"
    spec.write_text("name: x\ntrainer: {output_dir: 'runs/${nope}'}\n")
    with pytest.raises(SpecError) as caught:
        load_spec_dict(spec)
    assert caught.value.issues[0].message.startswith("cannot resolve interpolation")


def test_the_tiny_preset_loads_without_omegaconf():
    code = ("import sys; from relax.config import load_spec_dict; load_spec_dict('tiny-cpu'); "
            "assert 'omegaconf' not in sys.modules, 'omegaconf imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
