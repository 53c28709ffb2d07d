"""Learning-rate schedules (``relax.algo.schedules``) against hand-computed rates, step by step."""

from __future__ import annotations

import math

import pytest

from relax.algo.schedules import learning_rate, warmup_length


def rates(schedule: str, total: int, warmup: int = 0, floor: float = 0.0, lr: float = 1.0) -> list[float]:
    return [learning_rate(s, lr=lr, total_steps=total, schedule=schedule, warmup_steps=warmup, min_lr_ratio=floor)
            for s in range(total)]


def test_constant_is_lr_at_every_step() -> None:
    assert rates("constant", 4, lr=3e-4) == [3e-4] * 4


def test_constant_with_warmup_ramps_to_lr_at_the_warmup_step() -> None:
    # W = 3: steps 0..2 at 1/4, 2/4, 3/4 of lr, step 3 on at lr.
    assert rates("constant", 6, warmup=3, lr=2.0) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])


def test_linear_decays_to_zero_at_the_last_step() -> None:
    # T = 5, no warmup: p = s / 4.
    assert rates("linear", 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_linear_with_warmup_and_floor() -> None:
    # T = 6, W = 1, m = 0.2: step 0 at 1/2; then p = (s - 1) / 4 and lr * (0.2 + 0.8 * (1 - p)).
    assert rates("linear", 6, warmup=1, floor=0.2) == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_cosine_follows_half_a_cosine_to_the_floor() -> None:
    # T = 5: p = s / 4, (1 + cos(pi p)) / 2 = 1, (1 + r)/2, 1/2, (1 - r)/2, 0 with r = sqrt(2)/2.
    r = math.sqrt(2) / 2
    assert rates("cosine", 5) == pytest.approx([1.0, (1 + r) / 2, 0.5, (1 - r) / 2, 0.0])
    assert rates("cosine", 5, floor=0.1) == pytest.approx([1.0, 0.1 + 0.9 * (1 + r) / 2, 0.55,
                                                           0.1 + 0.9 * (1 - r) / 2, 0.1])


def test_cosine_with_warmup() -> None:
    # T = 7, W = 2: 1/3, 2/3, then p = (s - 2) / 4 from step 2 (at lr) to step 6 (the floor).
    r = math.sqrt(2) / 2
    assert rates("cosine", 7, warmup=2, lr=3.0) == pytest.approx(
        [1.0, 2.0, 3.0, 3.0 * (1 + r) / 2, 1.5, 3.0 * (1 - r) / 2, 0.0])


def test_warmup_ratio_is_a_share_of_the_run_rounded_up() -> None:
    assert warmup_length(60, warmup_ratio=0.1) == 6
    assert warmup_length(10, warmup_ratio=0.25) == 3  # 2.5 -> 3
    assert warmup_length(10, warmup_ratio=0.3) == 3  # not 4 from 0.30000000000000004 * 10
    assert warmup_length(10, warmup_steps=4) == 4
    assert warmup_length(10, warmup_ratio=0.0) == 0
    total = 10
    assert rates("linear", total, warmup=warmup_length(total, warmup_ratio=0.2)) == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7, 0.0])


def test_steps_past_the_run_stay_at_the_floor() -> None:
    for schedule in ("linear", "cosine"):
        assert learning_rate(9, lr=1.0, total_steps=5, schedule=schedule, min_lr_ratio=0.3) == pytest.approx(0.3)
        # A run whose last step ends the warmup: that step at lr, later ones at the floor.
        assert learning_rate(2, lr=1.0, total_steps=3, schedule=schedule, warmup_steps=2) == 1.0
        assert learning_rate(3, lr=1.0, total_steps=3, schedule=schedule, warmup_steps=2) == 0.0
    assert learning_rate(0, lr=1.0, total_steps=1, schedule="cosine") == 1.0


def test_bad_arguments_are_refused_with_the_choice() -> None:
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        learning_rate(0, lr=1.0, total_steps=3, schedule="step")
    with pytest.raises(ValueError, match="negative"):
        learning_rate(-1, lr=1.0, total_steps=3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        warmup_length(10, warmup_ratio=1.5)
