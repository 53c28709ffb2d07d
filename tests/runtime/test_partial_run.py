"""``relax run`` with partial rollouts (``roles.rollout.partial``) on a real local Ray and the real
TransferQueue bus: samples carry tokens of several policy versions, the staleness bound (counted
from each sample's oldest token) holds every step, and every sample is trained exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_a_partial_rollout_run_holds_the_bound_and_trains_every_sample_once(tmp_path: Path) -> None:
    # A short warm-up keeps the build quick; the responses then often run to the budget, which is
    # where the next step's samples are generated beside this one's.
    with testing.local_ray():
        code, rows, printed = testing.tiny_run(
            tmp_path, "partial", "trainer.steps=10", "model.options.warmup_steps=40",
            "roles.rollout.sampling.max_new_tokens=24", "async_policy.max_staleness=1",
            preset="tiny-longtail-cpu")
    assert code == 0, printed[-3000:]
    assert [r["step"] for r in rows] == list(range(1, 11))
    for row in rows:
        assert 0 <= row["staleness/max"] <= 1, row
        assert row["samples/consumed"] == 128 * row["step"] and row["samples/regenerated"] == 0
        assert row["partial/versions_per_sample_mean"] >= 1.0 and 0 <= row["partial/interrupted_frac"] <= 1
    # the next step's samples were started during a step, and continued in their own
    assert any(r["partial/interrupted_frac"] > 0 for r in rows[1:]), [r["partial/interrupted_frac"] for r in rows]
