"""The advantage and loss plugins read their settings from their AlgorithmContext (built from the
spec by relax.plan.contexts) and call relax.algo."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.advantages import grpo_advantages, rloo_advantages
from relax.algo.batch import collate
from relax.contracts import Generation
from relax.plan.contexts import algorithm_context
from relax.spec import validate_spec
from relax.spec.models import RunSpec
from relax.registry import get_registry


def _build(kind, name, spec, **options):
    registry = get_registry()
    return registry.load(kind, name)(registry.build_config(kind, name, options), algorithm_context(spec))


def test_advantage_plugins():
    spec = validate_spec({"name": "t"})
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 0, 1, 1]
    expected = grpo_advantages(torch.tensor(rewards), torch.tensor(groups))
    assert _build("advantages", "grpo", spec).compute(rewards, groups).tolist() == expected.tolist()
    assert _build("advantages", "dr_grpo", spec).compute(rewards, groups).tolist() == \
        pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])
    assert _build("advantages", "rloo", spec).compute(torch.tensor(rewards), torch.tensor(groups)).tolist() == \
        rloo_advantages(torch.tensor(rewards), torch.tensor(groups)).tolist()
    unscaled = _build("advantages", "grpo", spec, normalize_std=False).compute(rewards, groups)
    assert unscaled.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])


def _batch(advantage: float, behaviour: float):
    gens = [Generation(0, [1, 2], [3], [behaviour], "x")]
    return collate(gens, [advantage], 0)


def test_ppo_clip_takes_clip_from_the_spec():
    spec = validate_spec({"name": "t", "algorithm": {"clip": {"low": 0.1, "high": 0.5}},
                          "async_policy": {"correction": "none"}})
    loss = _build("losses", "ppo_clip", spec)
    batch = _batch(1.0, behaviour=-1.0)
    logprobs = torch.zeros_like(batch.rollout_logprobs)
    logprobs[0, 2] = -1.0 + math.log(2.0)  # ratio 2 -> clipped at 1 + high = 1.5
    value, metrics = loss.compute(batch, logprobs)
    assert value.item() == pytest.approx(-1.5)
    assert metrics["clip_fraction"] == 1.0


def test_tis_uses_recomputed_old_logprobs_and_the_cap():
    spec = validate_spec({"name": "t", "async_policy": {"correction": "tis", "tis_cap": 1.5}})
    loss = _build("losses", "ppo_clip", spec)
    batch = _batch(1.0, behaviour=-2.0)
    logprobs = torch.zeros_like(batch.rollout_logprobs)
    logprobs[0, 2] = -2.0
    value, metrics = loss.compute(batch, logprobs)  # old = behaviour: weight 1
    assert value.item() == pytest.approx(-1.0) and metrics["tis_weight_mean"] == 1.0
    old = torch.zeros_like(batch.rollout_logprobs)
    old[0, 2] = -2.0 + math.log(3.0)  # a proximal policy 3x likelier than the behaviour one
    logprobs[0, 2] = old[0, 2]
    value, metrics = loss.compute(batch.with_fields(old_logprobs=old), logprobs)
    assert metrics["tis_weight_mean"] == pytest.approx(1.5)
    assert value.item() == pytest.approx(-1.5)


def test_decoupled_correction_uses_the_proximal_policy_and_the_behaviour_weight():
    spec = RunSpec.model_validate({"name": "t", "async_policy": {"correction": "decoupled", "tis_cap": 2.0}})
    loss = _build("losses", "ppo_clip", spec)
    batch = _batch(1.0, behaviour=-2.0)
    with pytest.raises(ValueError, match="actor_fwd"):
        loss.compute(batch, torch.zeros_like(batch.rollout_logprobs))
    old = torch.zeros_like(batch.rollout_logprobs)
    old[0, 2] = -2.0 + math.log(1.5)  # proximal / behaviour = 1.5, under the cap
    old.requires_grad_(True)
    logprobs = old.detach().clone()
    logprobs[0, 2] += math.log(1.2)  # ratio 1.2 against the proximal policy, inside the clip
    logprobs.requires_grad_(True)
    value, metrics = loss.compute(batch.with_fields(old_logprobs=old), logprobs)
    value.backward()
    assert value.item() == pytest.approx(-1.5 * 1.2, rel=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1.5) and metrics["ratio_mean"] == pytest.approx(1.2)
    assert logprobs.grad[0, 2].item() == pytest.approx(-1.5 * 1.2, rel=1e-6)
    assert old.grad is None or old.grad.abs().sum().item() == 0.0  # neither the ratio's base nor the weight


def test_a_menu_correction_reads_its_bounds_from_the_spec_and_drops_tokens():
    # icepop with band [0.5, 2]: a proximal policy 3x likelier than the behaviour one is dropped,
    # one 1.5x likelier is kept with weight 1.5; without proximal log-probs the loss refuses.
    spec = RunSpec.model_validate({"name": "t", "async_policy": {"correction": "icepop", "icepop_low": 0.5,
                                                                 "icepop_high": 2.0}})
    loss = _build("losses", "gspo", spec)
    batch = _batch(1.0, behaviour=-2.0)
    with pytest.raises(ValueError, match="icepop but the batch has no old_logprobs"):
        loss.compute(batch, torch.zeros_like(batch.rollout_logprobs))
    for rho, kept in ((3.0, 0.0), (1.5, 1.0)):
        old = torch.zeros_like(batch.rollout_logprobs)
        old[0, 2] = -2.0 + math.log(rho)
        value, metrics = _build("losses", "ppo_clip", spec).compute(batch.with_fields(old_logprobs=old), old.clone())
        assert metrics["correction_kept_frac"] == kept
        assert value.item() == pytest.approx(-1.0 * rho * kept)


def test_every_policy_loss_honours_the_menu_but_pg():
    from relax.contracts import CORRECTIONS

    registry = get_registry()
    for name in ("ppo_clip", "gspo", "cispo", "sapo"):
        assert registry.load("losses", name).corrections == CORRECTIONS
    assert registry.load("losses", "pg").corrections == frozenset({"none"})


def _token_inputs(**fields):
    from relax.algo.advantages import TokenAdvantageInputs

    base = dict(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
                response_mask=torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
                logprobs=torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, 0.0]]))
    return TokenAdvantageInputs(**{**base, **fields})


def test_reinforce_pp_plugin_puts_the_kl_in_the_reward():
    from relax.algo.advantages import reinforce_pp_advantages
    from relax.algo.kl import kl_divergence

    spec = validate_spec({"name": "t", "algorithm": {"name": "reinforce_pp", "kl_coef": 0.1},
                          "roles": {"reference": {"backend": "torch"}}})
    assert spec.algorithm.kl_in == "reward" and spec.algorithm.kl_estimator == "k1"
    plugin = _build("advantages", "reinforce_pp", spec)
    assert plugin.token_level and plugin.needs == frozenset({"ref_logprobs"})
    ref = torch.tensor([[0.0, -1.5, -0.5], [0.0, -2.0, 0.0]])
    inputs = _token_inputs(ref_logprobs=ref)
    out = plugin.compute_tokens(inputs)
    kl = kl_divergence(inputs.logprobs, ref, "k1", inputs.response_mask)
    assert out.returns is None
    torch.testing.assert_close(out.advantages, reinforce_pp_advantages(inputs.rewards, inputs.response_mask, kl, 0.1))
    assert not torch.equal(out.advantages, reinforce_pp_advantages(inputs.rewards, inputs.response_mask))
    with pytest.raises(ValueError, match="ref_logprobs"):
        plugin.compute_tokens(_token_inputs())
    with pytest.raises(TypeError, match="compute_tokens"):
        plugin.compute([1.0, 0.0], [0, 0])


def test_kl_in_the_loss_leaves_the_reward_alone():
    spec = validate_spec({"name": "t", "algorithm": {"name": "reinforce_pp", "kl_coef": 0.1, "kl_in": "loss"},
                          "roles": {"reference": {"backend": "torch"}}})
    plugin = _build("advantages", "reinforce_pp", spec)
    assert plugin.kl_coef == 0.0
    plugin.compute_tokens(_token_inputs())  # no reference log-probs needed


def test_gae_plugin_returns_advantages_and_returns():
    from relax.algo.advantages import gae_advantages

    spec = validate_spec({"name": "t", "algorithm": {"name": "ppo"}, "roles": {"critic": {"backend": "torch"}}})
    plugin = _build("advantages", "gae", spec, lam=0.5, whiten=False)
    assert plugin.needs == frozenset({"values", "ref_logprobs"})
    values = torch.tensor([[0.0, 0.5, 0.8], [0.0, 0.3, 0.0]])
    out = plugin.compute_tokens(_token_inputs(values=values))
    adv, returns = gae_advantages(torch.tensor([1.0, 0.0]), values, _token_inputs().response_mask,
                                  lam=0.5, whiten_advantages=False)
    torch.testing.assert_close(out.advantages, adv)
    torch.testing.assert_close(out.returns, returns)
    with pytest.raises(ValueError, match="roles.critic"):
        plugin.compute_tokens(_token_inputs())


def test_reinforce_pp_baseline_plugin_uses_groups():
    from relax.algo.advantages import reinforce_pp_baseline_advantages

    spec = validate_spec({"name": "t", "algorithm": {"name": "reinforce_pp_baseline"}})
    plugin = _build("advantages", "reinforce_pp_baseline", spec, gamma=0.9)
    assert plugin.group_based and plugin.token_level
    inputs = _token_inputs()
    expected = reinforce_pp_baseline_advantages(inputs.rewards, inputs.group_ids, inputs.response_mask, gamma=0.9)
    torch.testing.assert_close(plugin.compute_tokens(inputs).advantages, expected)


@pytest.mark.parametrize("name, loss, aggregation", [
    ("grpo", "ppo_clip", "token-mean"),
    ("dr_grpo", "ppo_clip", "seq-mean-token-sum-norm"),
    ("gspo", "gspo", "seq-mean-token-mean"),
    ("cispo", "cispo", "token-mean"),
    ("sapo", "sapo", "token-mean"),
    ("dapo", "ppo_clip", "token-mean"),
])
def test_loss_plugins_expose_the_aggregation_of_the_algorithm(name, loss, aggregation):
    spec = validate_spec({"name": "t", "algorithm": {"name": name}})
    plugin = _build("losses", loss, spec)
    assert plugin.aggregation == aggregation
    batch = _batch(1.0, behaviour=-1.0)
    value, _ = plugin.compute(batch, batch.rollout_logprobs.clone())
    assert math.isfinite(value.item())


def test_dr_grpo_divides_by_the_generation_budget():
    spec = validate_spec({"name": "t", "algorithm": {"name": "dr_grpo"},
                          "roles": {"rollout": {"sampling": {"max_new_tokens": 4}}}})
    batch = _batch(2.0, behaviour=-1.0)  # one row, one response token, ratio 1
    value, _ = _build("losses", "ppo_clip", spec).compute(batch, batch.rollout_logprobs.clone())
    assert value.item() == pytest.approx(-2.0 / 4)


def test_gspo_takes_its_narrow_clip_from_the_name():
    spec = validate_spec({"name": "t", "algorithm": {"name": "gspo"}})
    plugin = _build("losses", "gspo", spec)
    assert (plugin.clip_low, plugin.clip_high) == (3e-4, 4e-4)
    spec = validate_spec({"name": "t", "algorithm": {"name": "gspo", "clip": {"low": 0.1, "high": 0.1}}})
    assert _build("losses", "gspo", spec).clip_high == 0.1


def test_kl_term_and_entropy_bonus_in_the_loss():
    from relax.algo.kl import kl_divergence

    spec = validate_spec({"name": "t", "algorithm": {"kl_coef": 0.5, "entropy_coef": 0.1},
                          "roles": {"reference": {"backend": "torch"}}, "async_policy": {"correction": "none"}})
    plugin = _build("losses", "ppo_clip", spec)
    assert plugin.needs_entropy and spec.algorithm.kl_estimator == "k3"
    batch = _batch(1.0, behaviour=-1.0)
    ref = torch.zeros_like(batch.rollout_logprobs)
    ref[0, 2] = -2.0
    entropy = torch.zeros_like(batch.rollout_logprobs)
    entropy[0, 2] = 0.7
    logprobs = batch.rollout_logprobs.clone()
    with pytest.raises(ValueError, match="ref_logprobs"):
        plugin.compute(batch, logprobs, entropy=entropy)
    batch = batch.with_fields(ref_logprobs=ref)
    with pytest.raises(ValueError, match="entropy"):
        plugin.compute(batch, logprobs)
    value, metrics = plugin.compute(batch, logprobs, entropy=entropy)
    k3 = kl_divergence(logprobs, ref, "k3")[0, 2].item()  # e^-1 - 1 + 1
    assert k3 == pytest.approx(math.exp(-1.0))
    assert value.item() == pytest.approx(-1.0 + 0.5 * k3 - 0.1 * 0.7, rel=1e-6)
    assert metrics["kl"] == pytest.approx(k3) and metrics["entropy"] == pytest.approx(0.7)


def test_pg_loss_refuses_a_correction_it_cannot_honour():
    spec = RunSpec.model_validate({"name": "t", "algorithm": {"loss": "pg"}})  # correction tis by default
    with pytest.raises(ValueError, match="correction 'tis'"):
        _build("losses", "pg", spec)
    spec = RunSpec.model_validate({"name": "t", "async_policy": {"correction": "none", "max_staleness": 0}})
    batch = _batch(2.0, behaviour=-1.0)
    value, _ = _build("losses", "pg", spec).compute(batch, batch.rollout_logprobs.clone())
    assert value.item() == pytest.approx(2.0)
