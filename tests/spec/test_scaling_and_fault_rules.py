"""Rules of elastic rollout, units of rollout work and fault tolerance (``check_rollout_scaling``,
``check_fault_tolerance``), ``RunSpec.rollout_units``, and that the defaults and presets pass them.

Specs start from the valid ``cpu_spec`` or ``gpu_spec`` (conftest.py) and break one rule each: the
set of reported paths is exactly that rule's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import load_spec_dict
from relax.spec import RunSpec, validate_spec
from relax.config.loader import PRESETS_DIR

PRESETS = sorted(PRESETS_DIR.glob("*.yaml"))


# --- the defaults and the presets ---------------------------------------------------------------------


def test_the_default_spec_validates():
    spec = validate_spec({"name": "default"})
    assert spec.roles.rollout.max_replicas is None and spec.roles.rollout.unit_prompts is None
    assert {n: getattr(spec.fault_tolerance.roles, n).on_failure for n in ("actor", "critic", "controller")} == \
        {"actor": "resume", "critic": "resume", "controller": "resume"}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_validates(preset: Path):
    raw, base = load_spec_dict(str(preset), [])
    validate_spec(raw, base_dir=base)


# --- rollout_units -------------------------------------------------------------------------------------


def spec_of(prompts: int, replicas: int = 1, max_replicas: int | None = None,
            unit_prompts: int | None = None) -> RunSpec:
    return RunSpec.model_validate({
        "name": "units", "algorithm": {"prompts_per_step": prompts},
        "roles": {"rollout": {"replicas": replicas, "max_replicas": max_replicas, "unit_prompts": unit_prompts}},
    })


@pytest.mark.parametrize(("prompts", "replicas", "max_replicas", "unit_prompts", "expected"), [
    (16, 1, None, None, (16, 1)),   # one replica, not elastic: the whole step is one unit
    (16, 1, 1, None, (16, 1)),      # max_replicas equal to replicas is not elastic
    (16, 4, None, None, (4, 4)),    # one unit per replica
    (16, 3, None, None, (6, 3)),    # rounded up: 6 + 6 + 4
    (16, 1, 4, None, (4, 4)),       # elastic: cut for the most replicas the run may have
    (16, 2, 5, None, (4, 4)),
    (1, 4, None, None, (1, 1)),     # never more units than prompts
    (16, 4, None, 5, (5, 4)),       # set explicitly: 5 + 5 + 5 + 1
    (16, 1, None, 16, (16, 1)),
    (16, 4, 8, 16, (16, 1)),        # whole-step units however many replicas
    (16, 1, None, 1, (1, 16)),
])
def test_rollout_units(prompts, replicas, max_replicas, unit_prompts, expected):
    assert spec_of(prompts, replicas, max_replicas, unit_prompts).rollout_units() == expected


def test_rollout_units_of_the_default_spec_is_one_whole_step():
    assert RunSpec(name="default").rollout_units() == (16, 1)


# --- elastic rollout and units of rollout work ---------------------------------------------------------


def test_elastic_rollout_in_separate_mode_is_valid(check, cpu_spec):
    cpu_spec["roles"]["rollout"]["max_replicas"] = 4
    assert check(cpu_spec) == {}


def test_elastic_rollout_on_gpus_in_separate_mode_is_valid(check, gpu_spec):
    gpu_spec["roles"]["rollout"]["max_replicas"] = 2
    gpu_spec["roles"]["rollout"]["unit_prompts"] = 4
    assert check(gpu_spec) == {}


def test_max_replicas_below_replicas(check, cpu_spec):
    cpu_spec["roles"]["rollout"].update(replicas=3, max_replicas=2)
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.max_replicas"}
    issue = issues["roles.rollout.max_replicas"]
    assert "below roles.rollout.replicas (3)" in issue.message
    assert "set it to 3 or more" in issue.remedy and "remove it" in issue.remedy


def test_max_replicas_equal_to_replicas_is_not_elastic_and_valid_in_any_mode(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "colocate"}
    cpu_spec["async_policy"] = {"max_staleness": 0}
    cpu_spec["roles"]["rollout"]["max_replicas"] = 1
    assert check(cpu_spec) == {}


def test_elastic_rollout_in_colocate_mode(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "colocate"}
    cpu_spec["async_policy"] = {"max_staleness": 0}
    cpu_spec["roles"]["rollout"]["max_replicas"] = 2
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.max_replicas"}
    issue = issues["roles.rollout.max_replicas"]
    assert "colocate" in issue.message and "actor's GPUs" in issue.message
    assert "placement.mode: separate" in issue.remedy and "remove max_replicas" in issue.remedy


def test_elastic_rollout_in_hybrid_mode(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "hybrid"}
    cpu_spec["roles"]["rollout"]["max_replicas"] = 2
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.max_replicas"}
    issue = issues["roles.rollout.max_replicas"]
    assert "only for separate mode" in issue.message
    assert "placement.mode: separate" in issue.remedy


def test_several_colocated_replicas_are_covered_by_the_gpu_rule(check, gpu_spec):
    # Several rollout engines in colocate mode mean something when together they span the actor's
    # GPUs (the planner lays them out); check_gpus reports them when they do not. Today's runtime
    # runs one (a runtime rule: tests/spec/test_one_round.py).
    gpu_spec["placement"] = {"mode": "colocate"}
    gpu_spec["async_policy"] = {"max_staleness": 0}
    gpu_spec["roles"]["rollout"]["replicas"] = 2
    assert check(gpu_spec) == {}
    gpu_spec["roles"]["rollout"]["replicas"] = 3
    issues = check(gpu_spec)
    assert set(issues) == {"roles.rollout.replicas"}
    assert "roles.actor.gpus" in issues["roles.rollout.replicas"].remedy


def test_unit_prompts_above_prompts_per_step(check, cpu_spec):
    cpu_spec["algorithm"]["prompts_per_step"] = 8
    cpu_spec["roles"]["rollout"]["unit_prompts"] = 9
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.unit_prompts"}
    issue = issues["roles.rollout.unit_prompts"]
    assert "prompts_per_step (8)" in issue.message
    assert "set it to 8 or less" in issue.remedy


def test_unit_prompts_equal_to_prompts_per_step_is_valid(check, cpu_spec):
    cpu_spec["algorithm"]["prompts_per_step"] = 8
    cpu_spec["roles"]["rollout"]["unit_prompts"] = 8
    assert check(cpu_spec) == {}


@pytest.fixture
def dapo(cpu_spec):
    """``cpu_spec`` running dapo (dynamic sampling on) with its own plugins."""
    cpu_spec["algorithm"] = {"name": "dapo", "prompts_per_step": 8}
    return cpu_spec


def test_dynamic_sampling_with_one_replica_and_whole_step_units_is_valid(check, dapo):
    assert check(dapo) == {}


@pytest.mark.parametrize("rollout", [
    {"replicas": 2},                     # one unit per replica
    {"max_replicas": 2},                 # elastic: units cut for the most replicas
    {"unit_prompts": 4},                 # one replica, but units smaller than a step
])
def test_dynamic_sampling_needs_whole_step_units(check, dapo, rollout):
    dapo["roles"]["rollout"].update(rollout)
    issues = check(dapo)
    assert set(issues) == {"algorithm.dynamic_sampling.enabled"}
    issue = issues["algorithm.dynamic_sampling.enabled"]
    assert "whole step inside one rollout replica" in issue.message
    assert "set it to false" in issue.remedy and "roles.rollout.unit_prompts: 8" in issue.remedy


def test_dynamic_sampling_with_several_replicas_and_whole_step_units_is_valid(check, dapo):
    dapo["roles"]["rollout"].update(replicas=2, max_replicas=4, unit_prompts=8)
    assert check(dapo) == {}


def test_several_replicas_without_dynamic_sampling_are_valid(check, dapo):
    dapo["algorithm"]["dynamic_sampling"] = {"enabled": False}
    dapo["roles"]["rollout"].update(replicas=2, max_replicas=4, unit_prompts=3)
    assert check(dapo) == {}


# --- fault tolerance ----------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["actor", "critic", "controller"])
def test_a_stateful_role_is_never_restarted_in_place(check, cpu_spec, role):
    cpu_spec["fault_tolerance"] = {"roles": {role: {"on_failure": "restart"}}}
    issues = check(cpu_spec)
    path = f"fault_tolerance.roles.{role}.on_failure"
    assert set(issues) == {path}
    assert "losing" in issues[path].message
    assert "resume" in issues[path].remedy and "stop" in issues[path].remedy


@pytest.mark.parametrize("policy", ["resume", "stop"])
def test_stateful_roles_may_resume_or_stop(check, cpu_spec, policy):
    cpu_spec["fault_tolerance"] = {"roles": {r: {"on_failure": policy} for r in ("actor", "critic", "controller")}}
    assert check(cpu_spec) == {}


def test_stateless_roles_may_restart_resume_or_stop(check, cpu_spec):
    roles = {"rollout": "restart", "reward": "resume", "advantage": "stop", "reference": "restart",
             "actor_fwd": "restart"}
    cpu_spec["fault_tolerance"] = {"roles": {r: {"on_failure": p, "max_restarts": 0} for r, p in roles.items()}}
    assert check(cpu_spec) == {}


def test_heartbeat_timeout_must_span_three_heartbeats(check, cpu_spec):
    cpu_spec["fault_tolerance"] = {"heartbeat_s": 5, "heartbeat_timeout_s": 10}
    issues = check(cpu_spec)
    assert set(issues) == {"fault_tolerance.heartbeat_timeout_s"}
    issue = issues["fault_tolerance.heartbeat_timeout_s"]
    assert "3 heartbeats" in issue.message and "busy machine" in issue.message
    assert "set it to 15 or more" in issue.remedy and "heartbeat_s" in issue.remedy


def test_heartbeat_timeout_of_exactly_three_heartbeats_is_valid(check, cpu_spec):
    cpu_spec["fault_tolerance"] = {"heartbeat_s": 5, "heartbeat_timeout_s": 15}
    assert check(cpu_spec) == {}


def test_progress_timeout_must_not_be_shorter_than_heartbeat_timeout(check, cpu_spec):
    cpu_spec["fault_tolerance"] = {"heartbeat_timeout_s": 60, "progress_timeout_s": 45}
    issues = check(cpu_spec)
    assert set(issues) == {"fault_tolerance.progress_timeout_s"}
    issue = issues["fault_tolerance.progress_timeout_s"]
    assert "heartbeat_timeout_s (60s)" in issue.message
    assert "set it to 60 or more" in issue.remedy


def test_fault_tolerance_problems_are_reported_together(check, cpu_spec):
    cpu_spec["fault_tolerance"] = {"heartbeat_s": 10, "heartbeat_timeout_s": 20, "progress_timeout_s": 5,
                                   "roles": {"actor": {"on_failure": "restart"}}}
    assert set(check(cpu_spec)) == {"fault_tolerance.heartbeat_timeout_s", "fault_tolerance.progress_timeout_s",
                                    "fault_tolerance.roles.actor.on_failure"}
