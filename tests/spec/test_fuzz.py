"""Property: whatever a spec file or an override holds, loading and validating ends in a RunSpec or a
``SpecError`` whose issues each have a path and a message; never in any other exception.

Specs are valid ones (the tiny preset and the testkit specs of conftest.py) mutated at random:
keys deleted, keys inserted, values replaced by JSON-like values of other types; then written as
YAML or JSON and loaded with random overrides. Derandomized, so CI sees the same 200 examples.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.config import load_spec_dict
from relax.spec import RunSpec, SpecError, validate_spec

from .conftest import CPU_SPEC, GPU_SPEC

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["", "~", "${name}", "${nope}", "builtin:", "a/b", "x.jsonl", "Qwen/Qwen3-4B",
                              "colocate", "otlp", "decoupled", "0", "-1", "1e400", "[1, 2]"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
TINY, _ = load_spec_dict("tiny-cpu")
keys = st.text(max_size=10) | st.sampled_from(["tp", "gpus", "options", "extends", "name", "ep", "modalities"])


def containers(tree: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every dict and list in the tree (the root included)."""
    found = [path] if isinstance(tree, (dict, list)) else []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for key, child in items:
        found += containers(child, (*path, key))
    return found


def at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


@st.composite
def mutated_specs(draw) -> dict:
    spec = copy.deepcopy(draw(st.sampled_from([TINY, CPU_SPEC, GPU_SPEC])))
    for _ in range(draw(st.integers(1, 4))):
        node = at(spec, draw(st.sampled_from(containers(spec))))
        op = draw(st.sampled_from(["delete", "insert", "replace"]))
        if isinstance(node, dict):
            if op == "insert" or not node:
                node[draw(keys)] = draw(values)
            else:
                key = draw(st.sampled_from(sorted(node)))
                if op == "delete":
                    del node[key]
                else:
                    node[key] = draw(values)
        elif node:
            index = draw(st.integers(0, len(node) - 1))
            if op == "delete":
                del node[index]
            else:
                node[index] = draw(values)
    return spec


override_keys = st.sampled_from(["name", "seed", "model.path", "model.modalities", "rewards.0.weight",
                                 "rewards.0", "rewards.9.name", "roles.actor.parallel.tp",
                                 "roles.actor", "placement.mode", "cluster.gpus_per_node", "a.b.c",
                                 "algorithm.kl_coef", "extends", "data.media_keys.image"]) | st.text(max_size=10)
override_values = st.sampled_from(["1", "-3", "null", "[text,image]", "{tp: 2}", "${name}", "${nope}",
                                   "2020-01-01", "[", "!!python/object:os.system", ".nan", "colocate",
                                   "", "true", "{", "'quoted'"]) | st.text(max_size=10)
overrides = st.lists(st.builds(lambda k, v: f"{k}={v}", override_keys, override_values)
                     | st.text(max_size=15), max_size=3)


def assert_clean(outcome: Any) -> None:
    if isinstance(outcome, SpecError):
        assert outcome.issues
        for issue in outcome.issues:
            assert isinstance(issue.path, str)
            assert isinstance(issue.message, str) and issue.message
    else:
        assert isinstance(outcome, RunSpec)


FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(spec=mutated_specs())
def test_mutated_spec_dicts_validate_or_fail_cleanly(spec, testkit_registry, tmp_path_factory):
    try:
        outcome: Any = validate_spec(spec, base_dir=tmp_path_factory.getbasetemp(), registry=testkit_registry)
    except SpecError as exc:
        outcome = exc
    assert_clean(outcome)


@FUZZ
@given(spec=mutated_specs(), as_json=st.booleans(), extra=overrides)
def test_mutated_spec_files_and_overrides_load_and_validate_or_fail_cleanly(
        spec, as_json, extra, testkit_registry, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz", numbered=True)
    path = folder / ("spec.json" if as_json else "spec.yaml")
    path.write_text(json.dumps(spec) if as_json else yaml.safe_dump(spec, allow_unicode=True))
    try:
        raw, base_dir = load_spec_dict(path, extra)
        outcome: Any = validate_spec(raw, base_dir=base_dir, registry=testkit_registry)
    except SpecError as exc:
        outcome = exc
    assert_clean(outcome)
