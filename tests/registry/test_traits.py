"""Declared plugin traits (relax.contracts.TRAITS): the registry rejects a class whose trait has the
wrong type or value, naming the plugin, the trait and what is expected; ``trait`` reads a trait
with its declared default; and every built-in plugin's traits pass the check."""

from __future__ import annotations

import pytest

from relax.contracts import HOOKS, TRAITS
from relax.registry import PluginError, get_registry, trait
from tests.registry.test_registry import install_fake

ESTIMATOR = """
from pydantic import BaseModel

class Estimator:
    {traits}

    class Config(BaseModel):
        pass

    def __init__(self, config, context):
        pass

    def compute(self, rewards, group_ids):
        return rewards
"""

TRAINER = """
from pydantic import BaseModel

class Trainer:
    {traits}

    class Config(BaseModel):
        pass

    def __init__(self, config, context):
        pass

    def compute_logprobs(self, batch):
        pass

    def train_step(self, batch):
        pass

    def weights(self):
        return {{}}

    def save(self, path):
        pass

    def load(self, path):
        pass
"""


@pytest.mark.parametrize(("kind", "source", "traits", "expected"), [
    ("advantages", ESTIMATOR, 'token_level = "yes"', r"token_level = 'yes'.*token_level must be a bool"),
    ("advantages", ESTIMATOR, 'needs = frozenset({"values", "logits"})',
     r"needs = frozenset\(.*needs must be a frozenset of ref_logprobs, values"),
    ("advantages", ESTIMATOR, "tolerated_staleness = -1", r"tolerated_staleness must be an int >= 0, or None"),
    ("trainer", TRAINER, 'memory_sharding = "some"', r"memory_sharding must be one of none, optimizer, full"),
    ("trainer", TRAINER, 'parallelism = frozenset({"dp", "zz"})', r"parallelism must be a frozenset of cp, dp"),
    ("trainer", TRAINER, 'pipeline_schedule = "gpipe"', r"pipeline_schedule must be one of 1f1b, fill-drain"),
], ids=["token_level", "needs", "tolerated_staleness", "memory_sharding", "parallelism", "pipeline_schedule"])
def test_a_trait_of_the_wrong_type_or_value_is_rejected(tmp_path, monkeypatch, kind, source, traits, expected):
    module = f"fake_tr_{kind}_{abs(hash(traits)) % 10_000_000}"
    registry = install_fake(tmp_path, monkeypatch,
                            {f"relax.{kind}": {"bad": f"{module}:{'Trainer' if kind == 'trainer' else 'Estimator'}"}},
                            {module: source.format(traits=traits)})
    with pytest.raises(PluginError, match=expected) as info:
        registry.load(kind, "bad")
    assert f"{kind} plugin 'bad'" in str(info.value)  # names the plugin


def test_valid_traits_load_and_undeclared_ones_read_as_their_default(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.advantages": {"good": "fake_tr_good:Estimator"}},
                            {"fake_tr_good": ESTIMATOR.format(
                                traits='token_level = True\n    needs = frozenset({"values"})')})
    cls = registry.load("advantages", "good")
    assert trait(cls, "advantages", "token_level") is True
    assert trait(cls, "advantages", "needs") == frozenset({"values"})
    assert trait(cls, "advantages", "group_based") is False  # not declared: the default
    assert trait(None, "advantages", "tolerated_staleness") is None
    with pytest.raises(KeyError, match="advantages plugins declare no trait 'memory_sharding'"):
        trait(cls, "advantages", "memory_sharding")


def test_a_per_instance_trait_may_be_a_property(tmp_path, monkeypatch):
    """weight_group_ranks of an engine depends on its parallel sizes (vllm): a property is fine."""
    registry = install_fake(tmp_path, monkeypatch, {"relax.rollout": {"engine": "fake_tr_engine:Rollout"}}, {
        "fake_tr_engine": """
            from pydantic import BaseModel

            class Rollout:
                class Config(BaseModel):
                    pass

                def __init__(self, config, context):
                    self.context = context

                @property
                def weight_group_ranks(self):
                    return 2

                def generate(self, prompts, n, sampling, seed):
                    return []

                def load_weights(self, weights, version):
                    pass
            """})
    assert registry.load("rollout", "engine").__name__ == "Rollout"


def test_a_reward_may_take_a_context_keyword_or_not(tmp_path, monkeypatch):
    """The published reward contract stays ``__init__(self, config)``; a keyword-only ``context``
    with a default is accepted too (model-based rewards), a required one is not."""
    reward = """
        from pydantic import BaseModel

        class Reward:
            class Config(BaseModel):
                pass

            def __init__(self, config{extra}):
                pass

            def score(self, samples):
                return []
        """
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {
        "plain": "fake_tr_plain:Reward", "judged": "fake_tr_judged:Reward", "strict": "fake_tr_strict:Reward"}}, {
        "fake_tr_plain": reward.format(extra=""),
        "fake_tr_judged": reward.format(extra=", *, context=None"),
        "fake_tr_strict": reward.format(extra=", *, context"),
    })
    registry.load("rewards", "plain")
    registry.load("rewards", "judged")
    with pytest.raises(PluginError, match=r"expected `__init__\(self, config\)`"):
        registry.load("rewards", "strict")


def test_every_builtin_plugin_passes_the_trait_check():
    registry = get_registry()
    loaded = 0
    for kind in TRAITS:
        for name in registry.entries(kind):
            registry.load(kind, name)  # vllm and megatron too: their modules import without the engines
            loaded += 1
    assert loaded >= 10


def test_every_kind_with_traits_has_hooks():
    assert set(TRAITS) <= set(HOOKS)
    for kind, traits in TRAITS.items():
        for name, declared in traits.items():
            assert declared.name == name and declared.accepts(declared.default), (kind, name)
