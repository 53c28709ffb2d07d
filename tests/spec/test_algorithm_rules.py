"""The named algorithms, their defaults, and the validate-time rules of the algorithm section.

Specs start from the valid ``cpu_spec`` (conftest.py) with the built-in advantage and loss plugins
instead of the testkit's, and break one rule each: the set of reported paths is that rule's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from relax.spec import validate_spec
from relax.spec.algorithms import ALGORITHMS
from relax.spec.models import AlgorithmSpec


@pytest.fixture
def spec(cpu_spec):
    """``cpu_spec`` with the algorithm's own plugins (no testkit overrides)."""
    cpu_spec["algorithm"] = {"name": "grpo"}
    return cpu_spec


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_named_algorithm_validates_with_what_it_needs(check, spec, name):
    spec["algorithm"]["name"] = name
    if ALGORITHMS[name].needs_critic:
        spec["roles"]["critic"] = {"backend": "test_trainer"}
    assert check(spec) == {}


def test_defaults_follow_the_name_and_a_set_field_wins():
    assert AlgorithmSpec(name="grpo").loss_aggregation == "token-mean"
    assert AlgorithmSpec(name="dr_grpo").loss_aggregation == "seq-mean-token-sum-norm"
    gspo = AlgorithmSpec(name="gspo")
    assert (gspo.clip.low, gspo.clip.high, gspo.loss_aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert AlgorithmSpec(name="gspo", clip={"high": 0.3}).clip.high == 0.3
    assert AlgorithmSpec(name="gspo", loss_aggregation="token-mean").loss_aggregation == "token-mean"
    assert AlgorithmSpec(name="dapo").dynamic_sampling.enabled is True
    assert AlgorithmSpec(name="dapo", dynamic_sampling={"enabled": False}).dynamic_sampling.enabled is False
    assert AlgorithmSpec(name="grpo").dynamic_sampling.enabled is False
    assert (AlgorithmSpec(name="reinforce_pp").kl_in, AlgorithmSpec(name="reinforce_pp").kl_estimator) == ("reward", "k1")
    assert (AlgorithmSpec(name="grpo").kl_in, AlgorithmSpec(name="grpo").kl_estimator) == ("loss", "k3")
    assert AlgorithmSpec(name="ppo").kl_in == "reward"


def test_ppo_without_a_critic(check, spec):
    spec["algorithm"]["name"] = "ppo"
    issues = check(spec)
    assert set(issues) == {"roles.critic"}
    assert "'gae'" in issues["roles.critic"].message and "roles.critic" in issues["roles.critic"].remedy


def test_an_estimator_that_reads_values_needs_a_critic_whatever_the_name(check, spec):
    spec["algorithm"]["advantage"] = "gae"
    assert set(check(spec)) == {"roles.critic"}


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_two_samples_per_prompt(check, spec, advantage):
    spec["algorithm"].update(advantage=advantage, samples_per_prompt=1)
    issues = check(spec)
    assert set(issues) == {"algorithm.samples_per_prompt"}
    assert f"'{advantage}'" in issues["algorithm.samples_per_prompt"].message


def test_reinforce_pp_takes_one_sample_per_prompt(check, spec):
    spec["algorithm"].update(name="reinforce_pp", samples_per_prompt=1)
    assert check(spec) == {}


def test_kl_in_the_reward_needs_a_token_level_estimator(check, spec):
    spec["algorithm"].update(kl_coef=0.05, kl_in="reward")
    spec["roles"]["reference"] = {"backend": "test_trainer"}
    issues = check(spec)
    assert set(issues) == {"algorithm.kl_in"}
    assert "'grpo'" in issues["algorithm.kl_in"].message
    assert "kl_in: loss" in issues["algorithm.kl_in"].remedy and "reinforce_pp" in issues["algorithm.kl_in"].remedy
    spec["algorithm"]["name"] = "reinforce_pp"
    assert check(spec) == {}


def test_kl_in_the_reward_without_a_penalty_is_harmless(check, spec):
    spec["algorithm"]["kl_in"] = "reward"
    assert check(spec) == {}


def test_a_loss_without_a_ratio_bounds_the_staleness(check, spec):
    spec["algorithm"]["loss"] = "pg"
    spec["async_policy"] = {"max_staleness": 2, "correction": "none"}
    issues = check(spec)
    assert set(issues) == {"async_policy.max_staleness"}
    issue = issues["async_policy.max_staleness"]
    assert "'pg'" in issue.message and "(0)" in issue.message and "importance ratio" in issue.message
    assert issue.remedy.startswith("set it to 0") and "ppo_clip" in issue.remedy
    spec["async_policy"]["max_staleness"] = 0
    assert check(spec) == {}


def test_a_loss_that_cannot_honour_the_correction(check, spec):
    spec["algorithm"]["loss"] = "pg"
    spec["async_policy"] = {"max_staleness": 0, "correction": "tis"}
    issues = check(spec)
    assert set(issues) == {"async_policy.correction"}
    assert "set it to none" in issues["async_policy.correction"].remedy


def test_entropy_bonus_needs_a_loss_that_takes_entropy(check, spec):
    spec["algorithm"].update(entropy_coef=0.01, loss="test_loss")
    issues = check(spec)
    assert set(issues) == {"algorithm.entropy_coef"}
    assert "'test_loss'" in issues["algorithm.entropy_coef"].message
    spec["algorithm"]["loss"] = "sapo"
    assert check(spec) == {}


def test_dynamic_sampling_needs_a_group_estimator(check, spec):
    spec["algorithm"].update(name="reinforce_pp", dynamic_sampling={"enabled": True})
    issues = check(spec)
    assert set(issues) == {"algorithm.dynamic_sampling.enabled"}
    assert "'reinforce_pp'" in issues["algorithm.dynamic_sampling.enabled"].message


def test_unknown_aggregation_suggests_the_right_one(check, spec):
    spec["algorithm"]["loss_aggregation"] = "token-means"
    issues = check(spec)
    assert set(issues) == {"algorithm.loss_aggregation"}
    assert "token-mean" in str(issues["algorithm.loss_aggregation"])


def test_dual_clip_must_exceed_one(check, spec):
    spec["algorithm"]["clip"] = {"c": 0.5}
    assert set(check(spec)) == {"algorithm.clip.c"}


def test_the_spec_blocks_of_the_algorithm_reference_validate():
    text = (Path(__file__).parents[2] / "docs" / "algorithms.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    named = set()
    for block in blocks:
        spec = validate_spec({"name": "doc", **yaml.safe_load(block)})
        named.add(spec.algorithm.name)
    assert named == set(ALGORITHMS)  # every named algorithm has an example
