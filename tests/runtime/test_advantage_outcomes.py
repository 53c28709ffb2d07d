"""Infrastructure failures stay out of the advantage: a step whose batch also holds trajectories
ended by an environment failure gives its healthy samples exactly the advantages of a step without
those rows (group mean and std over the healthy samples only), and the failed rows get 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax.agents.outcomes import healthy
from relax.algo.advantages import TokenAdvantageInputs, put_rows, take_rows
from relax.runtime.worker.roles.advantage import AdvantageLoop, kept_rows
from relax.telemetry.tracing import Telemetry
from relax_plugins.advantages.group import DrGRPOAdvantage, GRPOAdvantage, RLOOAdvantage
from relax_plugins.advantages.token_level import ReinforcePPBaselineAdvantage

HEALTHY_REWARDS = [1.0, 0.0, 0.5, 1.0, 0.2, 0.9, 0.9, 0.0]
HEALTHY_GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
# The same step with three more trajectories: two of group 0 and one of group 1 ended by infrastructure
# failures (their reward plugins scored whatever text they had: 0 here, as an empty answer scores).
MIXED_REWARDS = [1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.2, 0.9, 0.0, 0.9, 0.0]
MIXED_GROUPS = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
OUTCOMES = ["ok", "tool_error", "env_timeout", "truncated", "ok", "infra", "ok", "ok", "env_error", "ok", "ok"]


def loop(estimator) -> AdvantageLoop:
    """The advantage role's loop around ``estimator`` (outcome level, no critic)."""
    advantage = AdvantageLoop.__new__(AdvantageLoop)
    advantage.env = SimpleNamespace(telemetry=Telemetry("advantage", None))
    advantage.estimator, advantage.token_level, advantage.writes_returns, advantage._stats = estimator, False, False, {}
    return advantage


def meta() -> list[SimpleNamespace]:
    return [SimpleNamespace(extra={"group": g, "agent": {"outcome": o}}) for g, o in zip(MIXED_GROUPS, OUTCOMES)]


@pytest.mark.parametrize("estimator", [GRPOAdvantage(GRPOAdvantage.Config(), None), DrGRPOAdvantage(None, None),
                                       RLOOAdvantage(None, None)], ids=["grpo", "dr_grpo", "rloo"])
def test_healthy_samples_get_the_advantages_of_a_batch_without_the_failures(estimator):
    keep, linked = kept_rows(meta())
    assert not linked and keep == [o not in ("env_timeout", "infra", "env_error") for o in OUTCOMES]
    clean = loop(estimator).estimate(0, torch.tensor(HEALTHY_REWARDS), torch.tensor(HEALTHY_GROUPS))["advantages"]
    mixed = loop(estimator).estimate(0, torch.tensor(MIXED_REWARDS), torch.tensor(MIXED_GROUPS),
                                     keep=keep)["advantages"]
    kept = torch.tensor(keep)
    assert torch.equal(mixed[kept], clean)
    assert torch.equal(mixed[~kept], torch.zeros(3))
    # without the outcomes the failures' zero rewards pull their groups' means down: the old behaviour
    unaware = loop(estimator).estimate(0, torch.tensor(MIXED_REWARDS), torch.tensor(MIXED_GROUPS))["advantages"]
    assert not torch.allclose(unaware[kept], clean)


def test_token_level_estimates_whiten_over_the_healthy_rows_only():
    context = SimpleNamespace(kl_in="loss", kl_coef=0.0, kl_estimator="k1")
    estimator = ReinforcePPBaselineAdvantage(ReinforcePPBaselineAdvantage.Config(), context)
    torch.manual_seed(0)
    lengths = torch.randint(1, 6, (len(MIXED_REWARDS),))
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    inputs = TokenAdvantageInputs(rewards=torch.tensor(MIXED_REWARDS), group_ids=torch.tensor(MIXED_GROUPS),
                                  response_mask=mask, logprobs=torch.zeros_like(mask))
    keep = torch.tensor(healthy([{"agent": {"outcome": o}} for o in OUTCOMES]))
    index = torch.nonzero(keep).flatten()
    mixed = put_rows(estimator.compute_tokens(take_rows(inputs, index)).advantages, index, len(OUTCOMES))
    clean_inputs = TokenAdvantageInputs(rewards=torch.tensor(HEALTHY_REWARDS), group_ids=torch.tensor(HEALTHY_GROUPS),
                                        response_mask=mask[keep], logprobs=torch.zeros_like(mask[keep]))
    clean = estimator.compute_tokens(clean_inputs).advantages
    assert torch.equal(mixed[keep], clean)
    assert torch.equal(mixed[~keep], torch.zeros_like(mixed[~keep]))


def test_a_batch_without_trajectories_keeps_every_row():
    assert kept_rows([SimpleNamespace(extra={"group": 0}), SimpleNamespace(extra={})]) == ([True, True], {})


@pytest.mark.parametrize("estimator", [GRPOAdvantage(GRPOAdvantage.Config(), None), DrGRPOAdvantage(None, None),
                                       RLOOAdvantage(None, None)], ids=["grpo", "dr_grpo", "rloo"])
def test_a_trajectory_of_two_segments_counts_once_and_both_rows_get_its_advantage(estimator):
    """The step of ``HEALTHY_REWARDS`` where trajectory 1 (group 0) and trajectory 5 (group 1) each
    branched into two segments: their earlier segments are rows of their own, linked to the last
    segment's row (same group and sample), with the same reward. The group statistics count each
    trajectory once: every row gets exactly the advantage of the one-segment batch."""
    rows, rewards, groups, source = [], [], [], []
    for i, (reward, group) in enumerate(zip(HEALTHY_REWARDS, HEALTHY_GROUPS)):
        if i in (1, 5):  # the earlier segment first, as the rollout puts it
            rows.append(SimpleNamespace(extra={"group": group, "sample": i % 4, "segment": 0,
                                               "agent": {"outcome": "ok", "linked": True}}))
            rewards.append(reward), groups.append(group), source.append(i)
        rows.append(SimpleNamespace(extra={"group": group, "sample": i % 4, "agent": {"outcome": "ok"}}))
        rewards.append(reward), groups.append(group), source.append(i)
    keep, linked = kept_rows(rows)
    assert linked == {1: 2, 6: 7} and keep == [i not in (1, 6) for i in range(10)]
    clean = loop(estimator).estimate(0, torch.tensor(HEALTHY_REWARDS), torch.tensor(HEALTHY_GROUPS))["advantages"]
    segmented = loop(estimator).estimate(0, torch.tensor(rewards), torch.tensor(groups), keep=keep,
                                         linked=linked)["advantages"]
    assert torch.equal(segmented, clean[torch.tensor(source)])
    assert clean[1] != 0 and clean[5] != 0  # the branched trajectories carry a signal, in both their rows
    # counted once per segment instead, the groups' statistics would differ
    naive = loop(estimator).estimate(0, torch.tensor(rewards), torch.tensor(groups))["advantages"]
    assert not torch.equal(naive, segmented)


def test_an_earlier_segment_without_its_last_segment_is_an_error():
    from relax.agents.outcomes import linked_rows

    with pytest.raises(ValueError, match=r"rows \[0\] are earlier segments"):
        linked_rows([{"group": 0, "sample": 1, "agent": {"linked": True}}, {"group": 0, "sample": 0}])
