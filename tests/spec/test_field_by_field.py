"""One round is one round: a rule runs whenever the fields it reads are sound, field by field, so a
spec mixing shape errors, unknown plugin names, cross-field rules and data columns in the same
sections gets every one of its problems in one call (``relax.spec.soundness``)."""

from __future__ import annotations

import copy
import json

import pytest

from relax.spec import SpecError, validate_spec
from relax.spec.soundness import Unsound, UnsoundRead, is_unsound, sound_spec, soundly

from .conftest import CPU_SPEC, GPU_SPEC


def spec_with(base: dict, **changes) -> dict:
    """``base`` with dotted-key changes (``roles__rollout__replicas=-1``)."""
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


@pytest.fixture
def labelled_data(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                              for i in range(3)))
    return {"train": {"source": "p.jsonl"}}


NO_HALVES = {"advantage": None, "loss": None}

MIXED = {
    # a negative replica count beside an unknown algorithm and a KL coefficient without a reference
    # (the issue's own example): rules reading other fields of roles and algorithm still run
    "replicas, algorithm name, kl": (
        dict(roles__rollout__replicas=-1, algorithm={"name": "grop", "kl_coef": 0.1, **NO_HALVES}),
        {"roles.rollout.replicas", "algorithm.name", "algorithm.kl_coef"}),
    # an unknown key in roles beside an unknown backend in roles, and an unknown reward beside a
    # reward's shape error... in another entry of the same list is the list's: see below
    "typo key, unknown backend, unknown reward": (
        dict(roles__actor__paralel={"tp": 2}, roles__rollout__backend="nope", rewards=[{"name": "nope_reward"}]),
        {"roles.actor.paralel", "roles.rollout.backend", "rewards[0].name"}),
    # shape errors in algorithm and data beside a cross-field rule of algorithm, a staleness rule and
    # a data column (the data file is sound)
    "algorithm and data shapes, kl, colocate, column": (
        dict(algorithm__samples_per_prompt="many", algorithm__kl_coef=0.1, data__on_bad_sample="maybe",
             data__prompt_key="promt", placement={"mode": "colocate"}, async_policy={"max_staleness": 2}),
        {"algorithm.samples_per_prompt", "data.on_bad_sample", "algorithm.kl_coef", "data.prompt_key",
         "async_policy.max_staleness"}),
    # a broken trainer and fault-tolerance field beside the fault-tolerance ordering rule and an
    # unknown logger
    "trainer, fault tolerance, logger": (
        dict(trainer__steps=0, fault_tolerance__heartbeat_s=10, fault_tolerance__heartbeat_timeout_s=20,
             fault_tolerance__roles={"actor": {"on_failure": "explode"}}, logging=[{"name": "nope_logger"}]),
        {"trainer.steps", "fault_tolerance.roles.actor.on_failure", "fault_tolerance.heartbeat_timeout_s",
         "logging[0].name"}),
    # a model with a wrong type beside parallel sizes on CPU (check_parallel reads roles, not the
    # model's numbers there) and an unknown plugin option
    "model shape, parallel on cpu, plugin option": (
        dict(model__modalities="text", roles__actor__parallel={"tp": 2}, roles__rollout__options={"bogus": 1}),
        {"model.modalities", "roles.actor.parallel.tp", "roles.rollout.options.bogus"}),
}


@pytest.mark.parametrize("changes, paths", MIXED.values(), ids=MIXED.keys())
def test_every_mistake_of_a_mixed_spec_comes_in_one_call(check, labelled_data, changes, paths):
    raw = spec_with(CPU_SPEC, data=labelled_data, **changes)
    assert set(check(raw)) == paths


def test_the_issues_example_by_the_command_line(tmp_path, capsys):
    from relax.cli import main

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    code = main(["validate", "tiny-cpu", "roles.rollout.replicas=-1", "algorithm.name=grop", "algorithm.kl_coef=0.1",
                 f"data.train.source={tmp_path / 'p.jsonl'}", "data.prompt_key=promt", "rewards.0.name=exact_macth"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("5 problems in the run spec:")
    for path in ("roles.rollout.replicas", "algorithm.name", "algorithm.kl_coef", "data.prompt_key",
                 "rewards[0].name"):
        assert f"  - {path}: " in err, path


# --- a rule that reads a broken field stays silent -------------------------------------------------


def test_a_rule_does_not_judge_the_default_of_a_broken_field(check, labelled_data):
    # the reference is there but broken: "kl_coef needs a reference policy" would be about a default
    raw = spec_with(CPU_SPEC, data=labelled_data, algorithm__kl_coef=0.1,
                    roles__reference={"backend": "test_trainer", "gpus": -1})
    assert set(check(raw)) == {"roles.reference.gpus"}


def test_a_misspelt_key_makes_the_field_it_meant_unsound(check, gpu_spec):
    # replica (for replicas) = 2 in colocate mode: with replicas' default of 1, check_gpus would
    # report a rollout of 1 x 2 GPUs against the actor's 4, about a value the user did not write
    gpu_spec["placement"] = {"mode": "colocate"}
    gpu_spec["async_policy"] = {"max_staleness": 0}
    gpu_spec["roles"]["rollout"]["replica"] = 2
    assert set(check(gpu_spec)) == {"roles.rollout.replica"}


def test_a_missing_required_key_makes_its_mapping_unsound(check, labelled_data):
    # an agent's gateway needs its program: the gateway is there, the agent rules do not judge it
    raw = spec_with(CPU_SPEC, data=labelled_data, roles__rollout__agent={"gateway": {"port": 0}},
                    roles__rollout__backend="nope")
    issues = check(raw)
    assert set(issues) == {"roles.rollout.agent.gateway.program", "roles.rollout.backend"}


def test_a_broken_list_item_leaves_the_other_sections_judged(check, labelled_data):
    raw = spec_with(CPU_SPEC, data=labelled_data, rewards=[{"name": "test_reward", "weight": "heavy"}],
                    roles__rollout__backend="nope")
    assert set(check(raw)) == {"rewards[0].weight", "roles.rollout.backend"}


def test_a_wrong_type_for_a_whole_section(check, labelled_data):
    raw = spec_with(CPU_SPEC, data=labelled_data, roles__rollout="hf", algorithm__kl_coef=0.1)
    assert set(check(raw)) == {"roles.rollout", "algorithm.kl_coef"}


def test_a_missing_name_beside_a_rule(check, labelled_data):
    raw = spec_with(CPU_SPEC, data=labelled_data, algorithm__kl_coef=0.1)
    del raw["name"]
    assert set(check(raw)) == {"name", "algorithm.kl_coef"}


def test_a_spec_that_is_no_mapping_reports_its_shape_alone():
    with pytest.raises(SpecError) as exc:
        validate_spec(["not", "a", "spec"])
    assert len(exc.value.issues) == 1


# --- the marker ----------------------------------------------------------------------------------


def test_sound_spec_marks_each_broken_field_and_keeps_the_rest():
    raw = spec_with(GPU_SPEC, roles__rollout__replicas=-1, algorithm__kl_coef="high", seed="x")
    spec, unsound = sound_spec(raw)
    assert unsound == ["algorithm.kl_coef", "roles.rollout.replicas", "seed"]
    assert is_unsound(spec.roles.rollout.replicas) and spec.roles.rollout.gpus_per_replica == 2
    assert spec.roles.actor.gpus == 4 and spec.algorithm.name == "grpo"
    with pytest.raises(UnsoundRead) as exc:
        spec.roles.rollout.gpus  # replicas x gpus_per_replica
    assert exc.value.path == "roles.rollout.replicas"


@pytest.mark.parametrize("use", [
    lambda v: v > 0, lambda v: v == "x", lambda v: bool(v), lambda v: v + 1, lambda v: f"{v}", lambda v: str(v),
    lambda v: list(v), lambda v: "a" in v, lambda v: v.name, lambda v: v["k"], lambda v: hash(v), lambda v: len(v),
    lambda v: getattr(v, "anything", None), lambda v: {**v},
])
def test_every_use_of_the_marker_is_refused(use):
    with pytest.raises(UnsoundRead):
        use(Unsound("a.b"))


def test_the_marker_is_not_an_exception_a_rule_swallows():
    def rule():
        try:
            Unsound("a.b") > 1
        except Exception:  # a rule's guard around a plugin's Config, say
            yield "judged a default"

    assert list(soundly(rule())) == []
