"""A learning-rate schedule through the real runtime: every metrics row's ``train/lr`` is the
schedule's rate of its step, and a run resumed from a mid-run checkpoint trains its remaining
steps at the same rates (and to the same losses) as the run that never stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LR = 5e-4
#: linear over 4 steps, 1 warmup step, floor 0.2: lr/2, lr, then p = (s - 1) / 2 gives 0.6 lr, 0.2 lr.
EXPECTED = [LR / 2, LR, 0.6 * LR, 0.2 * LR]
OVERRIDES = ("placement.mode=colocate", "async_policy.max_staleness=0", "trainer.steps=4",
             "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2", "roles.actor.optimizer.lr_schedule=linear",
             "roles.actor.optimizer.warmup_steps=1", "roles.actor.optimizer.min_lr_ratio=0.2")


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def test_train_lr_follows_the_schedule_across_a_resume(local_ray, tmp_path: Path) -> None:
    code, rows, _ = testing.tiny_run(tmp_path, "whole", *OVERRIDES)
    assert code == 0
    assert [r["train/lr"] for r in rows] == pytest.approx(EXPECTED, rel=1e-9)
    # The run as if it had stopped after its step-2 checkpoint: resumed, it trains steps 3 and 4.
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step-4")
    code, resumed, _ = testing.tiny_run(tmp_path, "split", *OVERRIDES, resume=True)
    assert code == 0
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/lr"] for r in resumed] == pytest.approx(EXPECTED, rel=1e-9)
    for a, b in zip(resumed[2:], rows[2:]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("schedule", [(), ("roles.actor.optimizer.lr_schedule=cosine",
                                               "roles.actor.optimizer.warmup_steps=5")], ids=["constant", "cosine"])
def test_the_tiny_preset_learns_with_a_cosine_schedule_as_with_a_constant_rate(local_ray, tmp_path: Path,
                                                                               schedule: tuple[str, ...]) -> None:
    # The preset's whole run (60 steps, separate mode): 5 warmup steps and a cosine decay to 0 at
    # the last step learn the task as the constant rate does.
    code, rows, _ = testing.tiny_run(tmp_path, "learns", "trainer.steps=60", *schedule)
    assert code == 0
    rewards = [r["reward/mean"] for r in rows]
    if schedule:
        assert rows[0]["train/lr"] == pytest.approx(5e-4 / 6) and rows[-1]["train/lr"] == 0.0
    assert sum(rewards[:3]) / 3 <= 0.4, rewards[:3]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards[-5:]
