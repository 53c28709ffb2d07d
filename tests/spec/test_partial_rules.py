"""``roles.rollout.partial``: accepted for one hf replica in separate mode, refused (with the field
and what to do) where a pause cannot happen or the next step's drafts cannot be kept; the plan sends
each token's policy version to the actor only when it is on."""

from __future__ import annotations


import pytest

from relax.config import load_spec_dict
from relax.roles import Column
from relax.spec import SpecError, validate_spec
from relax.plan import make_plan
from relax.config.loader import PRESETS_DIR as PRESETS



def _issues(*overrides: str, registry=None) -> dict[str, str]:
    raw, _ = load_spec_dict(str(PRESETS / "tiny-longtail-cpu.yaml"), list(overrides))
    try:
        validate_spec(raw, registry=registry)
    except SpecError as exc:
        return {i.path: f"{i.message} | {i.remedy}" for i in exc.issues}
    return {}


def test_the_long_tail_preset_validates_with_partial_rollouts():
    assert _issues() == {}


@pytest.mark.parametrize("overrides, path, words", [
    (["placement.mode=colocate", "async_policy.max_staleness=0"], "roles.rollout.partial", "colocate"),
    (["roles.rollout.replicas=2"], "roles.rollout.partial", "one rollout replica"),
    (["roles.rollout.unit_prompts=4"], "roles.rollout.partial", "whole steps"),
    (["algorithm.dynamic_sampling.enabled=true"], "roles.rollout.partial", "dynamic sampling"),
])
def test_partial_rollouts_are_refused_where_they_cannot_work(overrides, path, words):
    issues = _issues(*overrides)
    assert path in issues, issues
    assert words in issues[path] and "roles.rollout.partial: false" in issues[path]


def test_a_backend_that_cannot_pause_is_refused_and_hf_and_vllm_can(testkit_registry):
    issues = _issues("roles.rollout.backend=test_rollout", registry=testkit_registry)
    assert "cannot pause" in issues.get("roles.rollout.backend", ""), issues
    assert "roles.rollout.backend" not in _issues("roles.rollout.backend=vllm")


def test_the_plan_sends_token_versions_to_the_actor_only_with_partial_rollouts():
    for partial, expected in ((True, True), (False, False)):
        raw, base = load_spec_dict(str(PRESETS / "tiny-longtail-cpu.yaml"), [f"roles.rollout.partial={partial}"])
        plan = make_plan(validate_spec(raw), base_dir=base)
        actor = next(w for worker in plan.workers for w in worker.roles if w.role == "actor")
        assert (Column.token_versions in actor.reads) is expected


def _tiny_issues(*overrides: str) -> dict[str, str]:
    raw, _ = load_spec_dict(str(PRESETS / "tiny-cpu.yaml"), list(overrides))
    try:
        validate_spec(raw)
    except SpecError as exc:
        return {i.path: f"{i.message} | {i.remedy}" for i in exc.issues}
    return {}


def test_auto_staleness_validates_in_separate_mode_and_the_plan_shows_its_cap():
    assert _tiny_issues("async_policy.max_staleness=auto", "async_policy.auto.max=3") == {}
    raw, base = load_spec_dict(str(PRESETS / "tiny-cpu.yaml"), ["async_policy.max_staleness=auto",
                                                                "async_policy.auto.max=3"])
    plan = make_plan(validate_spec(raw), base_dir=base)
    assert plan.settings.max_staleness == 3 and plan.settings.auto_staleness.max == 3
    assert plan.staleness.max_staleness == 3 and plan.staleness.rule.startswith("auto: ")


@pytest.mark.parametrize("overrides, path, words", [
    (["placement.mode=colocate", "async_policy.max_staleness=auto"], "async_policy.max_staleness", "colocate"),
    (["async_policy.max_staleness=auto", "async_policy.auto.start=5"], "async_policy.auto", "must not exceed max"),
    (["async_policy.max_staleness=sometimes"], "async_policy.max_staleness", "auto"),
    (["async_policy.max_staleness=auto", "algorithm.loss=pg"], "async_policy.auto.max", "tolerates"),
])
def test_auto_staleness_is_refused_where_it_cannot_work(overrides, path, words):
    issues = _tiny_issues(*overrides)
    assert any(p.startswith(path) and words in m for p, m in issues.items()), issues
