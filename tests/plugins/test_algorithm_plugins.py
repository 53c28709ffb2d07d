"""The advantage and loss plugins read their settings from the spec and call relax.algo."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.advantages import grpo_advantages, rloo_advantages
from relax.algo.batch import collate
from relax.contracts import Generation
from relax.spec import validate_spec
from relax.spec.models import RunSpec
from relax.registry import get_registry


def _build(kind, name, spec, **options):
    registry = get_registry()
    return registry.load(kind, name)(registry.build_config(kind, name, options), spec)


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


def test_decoupled_correction_is_not_implemented_yet():
    spec = RunSpec.model_validate({"name": "t", "async_policy": {"correction": "decoupled"}})
    with pytest.raises(NotImplementedError, match="decoupled"):
        _build("losses", "ppo_clip", spec)
