"""The staleness rule, once (``relax.algo.staleness``): a table over fixed bounds (0 = on-policy,
k, fully asynchronous), ``auto``, partial rollouts and a resumed run, and ``auto``'s control rule
on hand-made step rows."""

from __future__ import annotations

import pytest

from relax.algo.staleness import RETRY_STEPS, AutoStaleness, StalenessPolicy, staleness_policy
from relax.spec.models import AutoStalenessSpec

#: A bound no run of this table reaches: "fully asynchronous" (the rollout never waits).
FULLY_ASYNC = 10_000

def policies() -> dict[str, StalenessPolicy]:
    return {
        "on-policy": StalenessPolicy(0),
        "k=2": StalenessPolicy(2),
        "fully async": StalenessPolicy(FULLY_ASYNC),
        "auto at start 1 (cap 3)": AutoStaleness(AutoStalenessSpec(start=1, max=3)),
    }


TABLE = [
    # name, step, version, admits, min_version, newest_step(version)
    ("on-policy", 0, -1, False, 0, -1),  # step 0 waits for the starting weights (version 0)
    ("on-policy", 3, 3, True, 3, 3),
    ("on-policy", 3, 2, False, 3, 2),
    ("on-policy", 3, 4, True, 3, 4),  # a rollout behind the trainer generates with a newer policy
    ("k=2", 0, -1, True, -2, 1),  # steps 0 and 1 need no published version at all
    ("k=2", 1, -1, True, -1, 1),
    ("k=2", 2, -1, False, 0, 1),
    ("k=2", 5, 3, True, 3, 5),
    ("k=2", 5, 2, False, 3, 4),
    ("fully async", 9_000, -1, True, 9_000 - FULLY_ASYNC, FULLY_ASYNC - 1),
    ("auto at start 1 (cap 3)", 2, 1, True, 1, 2),
    ("auto at start 1 (cap 3)", 2, 0, False, 1, 1),
]


@pytest.mark.parametrize(("name", "step", "version", "admits", "min_version", "newest"), TABLE,
                         ids=[f"{row[0]}: s={row[1]} v={row[2]}" for row in TABLE])
def test_admission(name, step, version, admits, min_version, newest):
    policy = policies()[name]
    assert policy.admits(step, version) is admits
    assert policy.min_version(step) == min_version
    assert policy.newest_step(version) == newest
    # the three say the same rule: a version admits a step iff it is at least its min_version,
    # iff the step is at most the version's newest
    assert admits == (version >= policy.min_version(step)) == (step <= policy.newest_step(version))


ACCEPTS = [
    # name, step, versions, accepted: what the trainer trains
    ("on-policy", 3, [3, 3], True),
    ("on-policy", 3, [3, 2], False),
    ("on-policy", 3, [4], False),  # a sample of a policy newer than the step: never
    ("k=2", 3, [1, 2, 3], True),
    ("k=2", 3, [0, 3], False),
    ("fully async", 9_000, [-1, 0, 8_999], True),
    # auto admits under its current bound, the trainer accepts anything up to its cap: a step keeps
    # the bound it was admitted under, which auto may have narrowed since
    ("auto at start 1 (cap 3)", 5, [2, 4], True),
    ("auto at start 1 (cap 3)", 5, [1], False),
]


@pytest.mark.parametrize(("name", "step", "versions", "accepted"), ACCEPTS,
                         ids=[f"{row[0]}: s={row[1]} v={row[2]}" for row in ACCEPTS])
def test_acceptance(name, step, versions, accepted):
    assert policies()[name].accepts(step, versions) is accepted


PARTIAL = [
    # name, step the drafts are for, oldest token's version, may they be finished for it
    ("on-policy", 4, 4, True),
    ("on-policy", 4, 3, False),
    ("k=2", 4, 2, True),
    ("k=2", 4, 1, False),
    ("auto at start 1 (cap 3)", 4, 3, True),
    ("auto at start 1 (cap 3)", 4, 2, False),  # the cap would take it; the current bound does not
]


@pytest.mark.parametrize(("name", "step", "oldest", "continues"), PARTIAL,
                         ids=[f"{row[0]}: s={row[1]} oldest={row[2]}" for row in PARTIAL])
def test_partial_rollout_drafts(name, step, oldest, continues):
    policy = policies()[name]
    assert policy.may_continue(step, oldest) is continues
    # a draft of the next step is started with the held version only once it admits that step
    assert policy.admits(step, oldest) is continues


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_resumed_run_admits_its_first_steps_with_the_checkpoints_version(k):
    """A run resumed at step t publishes the checkpoint's weights as version t first (its actor
    starts at the step's version): the rule depends on step and version only, so steps t..t+k are
    admitted at once under it, as they would have been in the uninterrupted run once version t was
    out, and step t+k+1 waits for the first update."""
    policy, start = StalenessPolicy(k), 10
    assert [policy.admits(step, start) for step in range(start, start + k + 2)] == [True] * (k + 1) + [False]
    assert policy.newest_step(start) == start + k and policy.min_version(start + k + 1) == start + 1
    assert policy.accepts(start, [start]) and not policy.accepts(start, [start + 1])


def test_a_narrowed_auto_bound_stops_drafts_of_the_wider_one():
    policy = AutoStaleness(AutoStalenessSpec(start=2, max=3, kl_budget=0.02, hold_steps=1))
    assert policy.may_continue(5, 3)
    policy.update({"staleness/bound": 2, "offpolicy/kl": 1.0, "time/step_s": 1.0})
    assert policy.bound == 1 and not policy.may_continue(5, 3) and policy.accepts(5, [3])


def test_a_fixed_bound_never_moves_and_a_bound_is_never_negative():
    policy = StalenessPolicy(2)
    assert policy.update({"offpolicy/kl": 9.0, "time/step_s": 1.0, "time/data_wait_s": 0.9}) == 2
    with pytest.raises(ValueError, match="0 or more"):
        StalenessPolicy(-1)


def test_the_policy_of_a_run_and_its_words():
    assert type(staleness_policy(2)) is StalenessPolicy and staleness_policy(2).cap == 2
    auto = staleness_policy(4, AutoStalenessSpec(start=1, max=4))
    assert isinstance(auto, AutoStaleness) and (auto.bound, auto.cap) == (1, 4)
    assert StalenessPolicy(0).describe() == "strictly on-policy: the batch for step t is generated by version t"
    assert StalenessPolicy(2).describe() == ("the rollout starts the batch for step s only once policy version "
                                             ">= s - 2; step t trains only samples of versions t-2..t")
    assert auto.describe().startswith("auto: the bound starts at 1 and moves between 0 and 4 ")
    assert auto.describe().endswith(StalenessPolicy(4).describe())


# --- auto's control rule --------------------------------------------------------------------------


def row(kl: float | None, wait_s: float, step_s: float = 1.0, bound: int | None = None) -> dict:
    out = {"time/step_s": step_s, "time/data_wait_s": wait_s}
    if bound is not None:
        out["staleness/bound"] = bound
    if kl is not None:
        out["offpolicy/kl"] = kl
    return out

def test_it_widens_while_the_rollout_is_the_bottleneck_the_drift_is_small_and_it_pays_up_to_max():
    control = AutoStaleness(AutoStalenessSpec(start=1, max=3, kl_budget=0.02, hold_steps=2))
    bounds = []
    for _ in range(10):  # each wider bound makes the steps faster: 1 s at bound 1, 0.5 s at 2, 0.33 s at 3
        step_s = 1.0 / control.bound
        bounds.append(control.update(row(0.001, wait_s=0.5 * step_s, step_s=step_s, bound=control.bound)))
    assert bounds == [1, 2, 2, 3, 3, 3, 3, 3, 3, 3]  # one notch per hold of two steps, capped at max


def test_a_wider_bound_that_buys_no_speed_is_undone_and_tried_again_later():
    control = AutoStaleness(AutoStalenessSpec(start=1, max=4, kl_budget=0.02, hold_steps=2))
    bounds = [control.update(row(0.001, wait_s=0.5, step_s=1.0, bound=control.bound)) for _ in range(6)]
    assert bounds == [1, 2, 2, 1, 1, 1]  # 2 was no faster: back to 1, now the ceiling
    later = [control.update(row(0.001, wait_s=0.5, step_s=1.0, bound=control.bound)) for _ in range(RETRY_STEPS)]
    assert later[:RETRY_STEPS - 3] == [1] * (RETRY_STEPS - 3) and 2 in later  # tried again once the ceiling lapsed


def test_it_keeps_the_bound_when_the_trainer_is_the_bottleneck_or_the_drift_is_near_the_budget():
    spec = AutoStalenessSpec(start=1, max=4, kl_budget=0.02, hold_steps=1)
    control = AutoStaleness(spec)
    assert [control.update(row(0.001, wait_s=0.05)) for _ in range(3)] == [1, 1, 1]  # actor barely waits
    control = AutoStaleness(spec)
    assert [control.update(row(0.015, wait_s=0.5)) for _ in range(3)] == [1, 1, 1]  # above half the budget
    control = AutoStaleness(spec)
    assert control.update(row(None, wait_s=0.5)) == 1  # no drift measured: no reason to widen


def test_it_narrows_at_once_when_the_drift_exceeds_the_budget_never_below_zero():
    control = AutoStaleness(AutoStalenessSpec(start=2, max=4, kl_budget=0.02, hold_steps=3))
    # each narrowing is judged afresh by the steps admitted under the new bound
    assert [control.update(row(0.05, wait_s=0.5, bound=b)) for b in (2, 1, 0, 0)] == [1, 0, 0, 0]
    # ...and widens again once three steps of its own stay under half the budget
    assert [control.update(row(0.005, wait_s=0.5, bound=0)) for _ in range(4)] == [0, 0, 1, 1]


def test_steps_admitted_under_an_earlier_bound_do_not_judge_the_new_one():
    control = AutoStaleness(AutoStalenessSpec(start=3, max=4, kl_budget=0.02, hold_steps=1))
    assert control.update(row(0.05, wait_s=0.5, bound=3)) == 2
    # three more steps of bound 3 were in flight: their drift is high, but 2 is not narrowed for it
    assert [control.update(row(0.06, wait_s=0.5, bound=3)) for _ in range(3)] == [2, 2, 2]
    assert control.update(row(0.004, wait_s=0.0, bound=2)) == 2


def test_one_noisy_step_does_not_narrow_a_bound_whose_drift_is_small_on_average():
    control = AutoStaleness(AutoStalenessSpec(start=2, max=4, kl_budget=0.02, hold_steps=2))
    for _ in range(3):
        control.update(row(0.004, wait_s=0.0))
    assert control.update(row(0.03, wait_s=0.0)) == 2  # smoothed: 0.017, within the budget
