"""``max_staleness: auto``'s control rule (``relax.runtime.staleness``) on hand-made step rows."""

from __future__ import annotations

from relax.runtime.staleness import RETRY_STEPS, StalenessController
from relax.spec.models import AutoStalenessSpec


def row(kl: float | None, wait_s: float, step_s: float = 1.0, bound: int | None = None) -> dict:
    out = {"time/step_s": step_s, "time/data_wait_s": wait_s}
    if bound is not None:
        out["staleness/bound"] = bound
    if kl is not None:
        out["offpolicy/kl"] = kl
    return out


def test_it_widens_while_the_rollout_is_the_bottleneck_the_drift_is_small_and_it_pays_up_to_max():
    control = StalenessController(AutoStalenessSpec(start=1, max=3, kl_budget=0.02, hold_steps=2))
    bounds = []
    for _ in range(10):  # each wider bound makes the steps faster: 1 s at bound 1, 0.5 s at 2, 0.33 s at 3
        step_s = 1.0 / control.bound
        bounds.append(control.update(row(0.001, wait_s=0.5 * step_s, step_s=step_s, bound=control.bound)))
    assert bounds == [1, 2, 2, 3, 3, 3, 3, 3, 3, 3]  # one notch per hold of two steps, capped at max


def test_a_wider_bound_that_buys_no_speed_is_undone_and_tried_again_later():
    control = StalenessController(AutoStalenessSpec(start=1, max=4, kl_budget=0.02, hold_steps=2))
    bounds = [control.update(row(0.001, wait_s=0.5, step_s=1.0, bound=control.bound)) for _ in range(6)]
    assert bounds == [1, 2, 2, 1, 1, 1]  # 2 was no faster: back to 1, now the ceiling
    later = [control.update(row(0.001, wait_s=0.5, step_s=1.0, bound=control.bound)) for _ in range(RETRY_STEPS)]
    assert later[:RETRY_STEPS - 3] == [1] * (RETRY_STEPS - 3) and 2 in later  # tried again once the ceiling lapsed


def test_it_keeps_the_bound_when_the_trainer_is_the_bottleneck_or_the_drift_is_near_the_budget():
    spec = AutoStalenessSpec(start=1, max=4, kl_budget=0.02, hold_steps=1)
    control = StalenessController(spec)
    assert [control.update(row(0.001, wait_s=0.05)) for _ in range(3)] == [1, 1, 1]  # actor barely waits
    control = StalenessController(spec)
    assert [control.update(row(0.015, wait_s=0.5)) for _ in range(3)] == [1, 1, 1]  # above half the budget
    control = StalenessController(spec)
    assert control.update(row(None, wait_s=0.5)) == 1  # no drift measured: no reason to widen


def test_it_narrows_at_once_when_the_drift_exceeds_the_budget_never_below_zero():
    control = StalenessController(AutoStalenessSpec(start=2, max=4, kl_budget=0.02, hold_steps=3))
    # each narrowing is judged afresh by the steps admitted under the new bound
    assert [control.update(row(0.05, wait_s=0.5, bound=b)) for b in (2, 1, 0, 0)] == [1, 0, 0, 0]
    # ...and widens again once three steps of its own stay under half the budget
    assert [control.update(row(0.005, wait_s=0.5, bound=0)) for _ in range(4)] == [0, 0, 1, 1]


def test_steps_admitted_under_an_earlier_bound_do_not_judge_the_new_one():
    control = StalenessController(AutoStalenessSpec(start=3, max=4, kl_budget=0.02, hold_steps=1))
    assert control.update(row(0.05, wait_s=0.5, bound=3)) == 2
    # three more steps of bound 3 were in flight: their drift is high, but 2 is not narrowed for it
    assert [control.update(row(0.06, wait_s=0.5, bound=3)) for _ in range(3)] == [2, 2, 2]
    assert control.update(row(0.004, wait_s=0.0, bound=2)) == 2


def test_one_noisy_step_does_not_narrow_a_bound_whose_drift_is_small_on_average():
    control = StalenessController(AutoStalenessSpec(start=2, max=4, kl_budget=0.02, hold_steps=2))
    for _ in range(3):
        control.update(row(0.004, wait_s=0.0))
    assert control.update(row(0.03, wait_s=0.0)) == 2  # smoothed: 0.017, within the budget
