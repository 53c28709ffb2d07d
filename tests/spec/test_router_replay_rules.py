"""``algorithm.router_replay``: refused for dense models and for backends that cannot record or
replay routing (named in the message), accepted for the tiny Qwen3-MoE on hf with torch or megatron; the plan
wires the routed-experts column from the rollout to the actor only when r3 is on."""

from __future__ import annotations


import pytest
import yaml

from relax.roles import Column
from relax.spec import SpecError, validate_spec
from relax.config.loader import PRESETS_DIR

PRESET = PRESETS_DIR / "tiny-cpu.yaml"


def _spec(mode: str, moe: bool = True, **roles: str) -> dict:
    raw = yaml.safe_load(PRESET.read_text())
    raw["algorithm"]["router_replay"] = mode
    if moe:
        raw["model"]["options"] = {"architecture": "qwen3_moe"}
    for role, backend in roles.items():
        raw["roles"][role]["backend"] = backend
    return raw


def _issues(raw: dict, registry=None) -> dict[str, str]:
    try:
        validate_spec(raw, registry=registry)
    except SpecError as exc:
        return {i.path: f"{i.message} | {i.remedy}" for i in exc.issues}
    return {}


@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_the_tiny_moe_on_hf_and_torch_validates(mode):
    assert _issues(_spec(mode)) == {}


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_a_dense_model_is_refused(mode):
    issues = _issues(_spec(mode, moe=False))
    assert set(issues) == {"algorithm.router_replay"}
    assert "dense model" in issues["algorithm.router_replay"] and "router_replay: off" in issues["algorithm.router_replay"]


def test_off_is_fine_for_a_dense_model():
    assert _issues(_spec("off", moe=False)) == {}


def test_backends_that_cannot_record_or_replay_are_named(monkeypatch, testkit_registry):
    from relax.contracts import PluginKind
    from relax.registry import get_registry

    # The testkit's rollout declares no router_replay trait: it cannot record.
    issues = _issues(_spec("r3", rollout="test_rollout", actor="megatron"), testkit_registry)
    assert set(issues) == {"roles.rollout.backend"}
    assert "'test_rollout'" in issues["roles.rollout.backend"] and "record" in issues["roles.rollout.backend"]
    # r2 asks nothing of the rollout.
    assert _issues(_spec("r2", rollout="test_rollout", actor="megatron"), testkit_registry) == {}
    # A trainer that replays only some modes is named with the ones it supports.
    megatron = get_registry().load(PluginKind.trainer, "megatron")
    monkeypatch.setattr(megatron, "router_replay", frozenset({"r2"}))
    issues = _issues(_spec("r3", actor="megatron"))
    assert set(issues) == {"roles.actor.backend"}
    assert "'megatron'" in issues["roles.actor.backend"] and "(r3; it supports r2)" in issues["roles.actor.backend"]
    assert "router_replay: r2 or off" in issues["roles.actor.backend"]


def test_the_vllm_rollout_records_for_r3():
    """vllm declares r3 (vLLM's routed-experts capture); whether this vLLM can capture is checked
    when the backend is built, since validate imports no vllm."""
    assert _issues(_spec("r3", rollout="vllm")) == {}
    assert _issues(_spec("r3", rollout="vllm", actor="megatron")) == {}


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_the_megatron_trainer_replays_routing(mode):
    assert _issues(_spec(mode, actor="megatron")) == {}


def test_agentic_rollouts_are_refused_for_r3():
    raw = yaml.safe_load((PRESET.parent / "tiny-agent-cpu.yaml").read_text())
    raw["algorithm"]["router_replay"] = "r3"
    raw["model"].setdefault("options", {})["architecture"] = "qwen3_moe"
    issues = _issues(raw)
    assert set(issues) == {"algorithm.router_replay"}
    assert "agentic" in issues["algorithm.router_replay"]


def test_the_plan_wires_routed_experts_only_for_r3(tmp_path):
    from relax.plan import make_plan

    for mode, wired in (("off", False), ("r2", False), ("r3", True)):
        spec = validate_spec(_spec(mode))
        plan = make_plan(spec, base_dir=tmp_path)
        fields = {f.name: f for f in plan.bus}
        assert (Column.routed_experts in fields) is wired, mode
        if wired:
            assert fields[Column.routed_experts].writer == "rollout"
            assert fields[Column.routed_experts].readers == ["actor"]
        contexts = {p.name: p.context for w in plan.workers for r in w.roles for p in r.plugins if p.context}
        assert contexts["hf"]["record_routing"] is wired
        assert contexts["torch"]["router_replay"] == mode


def test_a_bare_yaml_off_means_off():
    raw = yaml.safe_load(PRESET.read_text())
    raw["algorithm"].update(yaml.safe_load("router_replay: off"))
    assert raw["algorithm"]["router_replay"] is False  # what YAML 1.1 makes of it
    assert validate_spec(raw).algorithm.router_replay == "off"
