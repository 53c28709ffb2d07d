"""``relax run`` with partial rollouts (``roles.rollout.partial``) and with ``max_staleness: auto`` on
a real local Ray and the real TransferQueue bus: the staleness bound (counted from each sample's
oldest token; chosen step by step with auto) holds every step, and every sample is trained exactly
once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def test_a_partial_rollout_run_holds_the_bound_and_trains_every_sample_once(local_ray, tmp_path: Path) -> None:
    # Samples are started beside a step's tail, and swapped to new weights, only while the rollout
    # is what the run waits for: with most responses rambling on to 56 tokens, generating a step
    # takes longer than training one (measured 0.3-0.55 s against 0.2-0.27 s here). With short
    # responses the rollout waits for every version and nothing is ever interrupted.
    code, rows, printed = testing.tiny_run(
        tmp_path, "partial", "trainer.steps=10", "model.options.long_tail_probability=0.7",
        "model.options.long_tail_tokens=56", "async_policy.max_staleness=1", preset="tiny-longtail-cpu")
    assert code == 0, printed[-3000:]
    assert [r["step"] for r in rows] == list(range(1, 11))
    for row in rows:
        assert 0 <= row["staleness/max"] <= 1, row
        assert row["samples/consumed"] == 128 * row["step"] and row["samples/regenerated"] == 0
        assert row["partial/versions_per_sample_mean"] >= 1.0 and 0 <= row["partial/interrupted_frac"] <= 1
    # the next step's samples were started during a step, and continued in their own
    assert any(r["partial/interrupted_frac"] > 0 for r in rows[1:]), [r["partial/interrupted_frac"] for r in rows]


def test_auto_staleness_moves_the_bound_and_every_step_keeps_the_bound_it_was_admitted_under(
        local_ray, tmp_path: Path) -> None:
    # A wide budget and a low wait threshold: the bound widens whenever the actor waits at all.
    code, rows, printed = testing.tiny_run(
        tmp_path, "auto", "trainer.steps=14", "async_policy.max_staleness=auto", "async_policy.auto.start=0",
        "async_policy.auto.max=3", "async_policy.auto.hold_steps=1", "async_policy.auto.wait_frac=0.01",
        "async_policy.auto.kl_budget=10", "tracing.exporter=jsonl")
    assert code == 0, printed[-3000:]
    bounds = [r["staleness/bound"] for r in rows]
    assert bounds[0] == 0 and max(bounds) > 0 and all(0 <= b <= 3 for b in bounds), bounds
    for r in rows:
        assert r["staleness/max"] <= r["staleness/bound"], r
        assert r["samples/consumed"] == 128 * r["step"] and "offpolicy/kl" in r
    spans = [json.loads(line) for line in (tmp_path / "auto" / "traces.jsonl").read_text().splitlines()]
    steps = [s for s in spans if s["name"] == "relax.step"]
    assert steps and all("relax.staleness_bound" in s["attributes"] for s in steps)
