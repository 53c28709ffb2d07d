"""A shape error in one field does not hide plugin problems in the others, in its section or another."""

from __future__ import annotations

import pytest

from relax.config import load_spec_dict
from relax.spec import SpecError, validate_spec


def paths_of(*overrides: str) -> set[str]:
    raw, base = load_spec_dict("tiny-cpu", list(overrides))
    with pytest.raises(SpecError) as exc:
        validate_spec(raw, base_dir=base)
    return {issue.path for issue in exc.value.issues}


def test_a_typo_and_a_wrong_plugin_option_are_reported_together() -> None:
    assert paths_of("roles.actor.paralel.tp=2", "rewards.0.options.nope=1") == {
        "roles.actor.paralel", "rewards[0].options.nope"}


def test_plugins_of_a_section_with_a_broken_field_are_still_checked() -> None:
    # roles.actor has an unknown key; the rollout's backend, a sound field of the same section, is judged
    assert paths_of("roles.actor.paralel.tp=2", "roles.rollout.backend=nope") == {"roles.actor.paralel",
                                                                                "roles.rollout.backend"}


def test_a_broken_plugin_name_is_its_shape_error_alone() -> None:
    assert paths_of("roles.rollout.backend=[hf]", "rewards.0.name=exact_macth") == {"roles.rollout.backend",
                                                                                  "rewards[0].name"}


def test_a_missing_data_file_is_reported_beside_a_shape_error() -> None:
    assert paths_of("seed=-1", "data.train={source: missing.jsonl}") == {"seed", "data.train.source"}
