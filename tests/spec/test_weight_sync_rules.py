"""``roles.rollout.weight_sync``: the rule that refuses ``collective`` where it cannot work, and
how ``auto`` resolves (``relax.spec.rules.weight_sync``). Specs start from the valid ``cpu_spec`` or
``gpu_spec`` (conftest.py); the testkit's ``test_rollout`` has no weight-group receiver."""

from __future__ import annotations

import pytest

from relax.registry import get_registry
from relax.spec import RunSpec
from relax.plan.wiring import weight_sync
from relax.spec.rules import receives_collectively


def test_collective_with_a_backend_that_cannot_receive(check, cpu_spec):
    cpu_spec["roles"]["rollout"]["weight_sync"] = "collective"
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.weight_sync"}
    issue = issues["roles.rollout.weight_sync"]
    assert "'test_rollout' cannot receive" in issue.message
    assert "object_store" in issue.remedy


def test_collective_in_colocate_mode(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "colocate"}
    cpu_spec["async_policy"] = {"max_staleness": 0}
    cpu_spec["roles"]["rollout"]["weight_sync"] = "collective"
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.weight_sync"}
    assert "colocate" in issues["roles.rollout.weight_sync"].message
    assert "placement.mode: separate" in issues["roles.rollout.weight_sync"].remedy


@pytest.mark.parametrize("choice", ["auto", "object_store"])
def test_other_choices_pass_with_any_backend(check, gpu_spec, choice):
    gpu_spec["roles"]["rollout"]["weight_sync"] = choice
    assert check(gpu_spec) == {}


def test_the_builtin_rollouts_declare_a_receiver():
    registry = get_registry()
    assert receives_collectively(registry.load("rollout", "hf"))
    assert receives_collectively(registry.load("rollout", "vllm"))
    assert not receives_collectively(None)


def spec_of(mode: str = "separate", rollout_gpus: int = 1, actor_gpus: int = 1, choice: str = "auto") -> RunSpec:
    return RunSpec.model_validate({"name": "sync", "placement": {"mode": mode}, "roles": {
        "rollout": {"weight_sync": choice, "gpus_per_replica": rollout_gpus}, "actor": {"gpus": actor_gpus}}})


class Receiver:
    def join_weight_group(self, address): ...

    def receive_weights(self): ...


@pytest.mark.parametrize(("spec", "backend", "expected"), [
    (spec_of(), Receiver, "collective"),                               # GPUs on both sides, a receiver
    (spec_of(), object, "object_store"),                               # a backend without a receiver
    (spec_of(rollout_gpus=0), Receiver, "object_store"),               # CPU rollout
    (spec_of(actor_gpus=0), Receiver, "object_store"),                 # CPU actor
    (spec_of(mode="colocate"), Receiver, "object_store"),
    (spec_of(rollout_gpus=0, actor_gpus=0, choice="collective"), Receiver, "collective"),  # asked for
    (spec_of(choice="object_store"), Receiver, "object_store"),
])
def test_auto_is_collective_on_gpus_with_a_receiver(spec, backend, expected):
    assert weight_sync(spec, backend) == expected


def test_collective_from_gpus_to_a_cpu_rollout(check, gpu_spec):
    gpu_spec["roles"]["rollout"].update(weight_sync="collective", gpus_per_replica=0, parallel={"tp": 1})
    issues = check(gpu_spec)
    assert "roles.rollout.weight_sync" in issues
    assert "NCCL" in issues["roles.rollout.weight_sync"].message
