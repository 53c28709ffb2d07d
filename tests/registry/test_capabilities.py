"""Rollout and trainer capabilities (relax.contracts.CAPABILITIES): declared as protocols, checked by
the registry when a plugin is loaded (a claimed capability with a wrong signature is refused,
naming it), and asked through ``supports`` by the validator instead of probing objects by name."""

from __future__ import annotations

import pytest

from relax.contracts import CAPABILITIES, PluginKind, protocol_hooks
from relax.registry import PluginError, get_registry, supports
from tests.registry.test_registry import install_fake

ROLLOUT = """
from pydantic import BaseModel

class Rollout:
    {extra}

    class Config(BaseModel):
        pass

    def __init__(self, config, context):
        pass

    def generate(self, prompts, n, sampling, seed):
        return []

    def load_weights(self, weights, version):
        pass

    {methods}
"""


def _load(tmp_path, monkeypatch, methods: str, extra: str = "") -> type:
    module = f"fake_cap_{abs(hash((methods, extra))) % 10_000_000}"
    registry = install_fake(tmp_path / module, monkeypatch, {"relax.rollout": {"engine": f"{module}:Rollout"}},
                            {module: ROLLOUT.format(methods=methods, extra=extra)})
    return registry.load("rollout", "engine")


def test_the_builtin_backends_have_the_capabilities_the_runtime_uses():
    registry = get_registry()
    hf, vllm = registry.load("rollout", "hf"), registry.load("rollout", "vllm")
    for capability in ("token_generation", "pausing", "collective_receive", "model_sharing"):
        assert supports(hf, "rollout", capability), capability
    assert supports(vllm, "rollout", "collective_receive") and supports(vllm, "rollout", "pausing")
    assert not supports(vllm, "rollout", "model_sharing")  # the engine owns its weights
    assert supports(registry.load("trainer", "torch"), "trainer", "model_offer")
    assert not supports(None, "rollout", "pausing")  # a plugin that failed to load has none


def test_a_backend_without_a_capability_does_not_support_it(tmp_path, monkeypatch):
    cls = _load(tmp_path, monkeypatch, "")
    assert not any(supports(cls, "rollout", name) for name in CAPABILITIES[PluginKind.rollout])


def test_a_claimed_capability_with_a_wrong_signature_is_refused(tmp_path, monkeypatch):
    with pytest.raises(PluginError, match=r"collective_receive capability .*CollectiveReceive.*"
                                          r"expected `receive_weights\(self\)`"):
        _load(tmp_path, monkeypatch, "def join_weight_group(self, address):\n        pass")
    with pytest.raises(PluginError, match=r"token_generation capability.*expected "
                                          r"`generate_tokens\(self, prompts, sampling, seed\)`"):
        _load(tmp_path, monkeypatch, "def generate_tokens(self, prompts):\n        return []")


def test_pausing_is_claimed_by_the_trait_and_needs_the_pause_parameter(tmp_path, monkeypatch):
    plain = ("def generate_tokens(self, prompts, sampling, seed):\n        return []\n"
             "    def encode_prompt(self, prompt):\n        return []")
    cls = _load(tmp_path, monkeypatch, plain)
    assert supports(cls, "rollout", "token_generation") and not supports(cls, "rollout", "pausing")
    with pytest.raises(PluginError, match=r"pausing capability.*generate_tokens\(self, prompts, sampling, seed, "
                                          r"pause\)"):
        _load(tmp_path, monkeypatch, plain, extra="pausable = True")


def test_the_capability_hooks_come_from_the_protocols():
    hooks = {name: [h.signature() for h in protocol_hooks(p)] for name, p in CAPABILITIES[PluginKind.rollout].items()}
    assert hooks["collective_receive"] == ["join_weight_group(self, address)", "receive_weights(self)"]
    assert hooks["model_sharing"] == ["adopt_model(self, model)"]
    with pytest.raises(KeyError, match="no capability 'teleport'"):
        supports(object, "rollout", "teleport")
