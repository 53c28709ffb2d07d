"""The rollout-trainer mismatch figures of ``relax run`` on a real local Ray, and their alarm."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ON_POLICY = ("placement.mode=colocate", "async_policy.max_staleness=0")


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def test_every_step_reports_a_near_zero_mismatch_on_cpu(local_ray, tmp_path: Path) -> None:
    # The hf rollout and the torch trainer compute the same float32 model: they agree to round-off.
    code, rows, printed = testing.tiny_run(tmp_path, "mismatch", *ON_POLICY, "trainer.steps=2",
                                           "tracing.exporter=jsonl")
    assert code == 0 and [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["mismatch/tokens"] > 0  # on-policy: every row is of the trainer's version
        assert 0.0 <= row["mismatch/kl"] < 1e-8
        assert 0.0 <= row["mismatch/max_abs"] < 1e-4
        assert row["mismatch/frac_over"] == 0.0
        assert "train/mismatch/kl" not in row
    assert "MISMATCH ALARM" not in printed
    from relax.telemetry import read_spans

    trains = [s for s in read_spans(tmp_path / "mismatch" / "traces.jsonl") if s["name"] == "relax.actor.train_step"]
    assert len(trains) == 2
    assert all(s["attributes"]["relax.mismatch_tokens"] > 0 for s in trains)
    assert not any("relax.mismatch_alarm" in s["attributes"] for s in trains)


def test_a_mismatch_above_the_alarm_with_stop_ends_the_run(local_ray, tmp_path: Path, capsys) -> None:
    # Round-off alone (~1e-13 in k3) is above this alarm: the first step stops the run.
    code, rows, printed = testing.tiny_run(tmp_path, "alarm", *ON_POLICY, "trainer.steps=3",
                                           "async_policy.mismatch.kl_alarm=1e-20",
                                           "async_policy.mismatch.action=stop")
    assert code == 1
    assert [r["step"] for r in rows] == [1]  # the step that raised the alarm is written first
    assert "[relax] step 1: MISMATCH ALARM: mismatch/kl" in printed
    err = capsys.readouterr().err
    assert "the run failed: step 1: mismatch/kl" in err
    assert "async_policy.mismatch.kl_alarm=1e-20" in err and "action is stop" in err


def test_a_menu_correction_trains_with_the_proximal_log_probs_of_actor_fwd(local_ray, tmp_path: Path) -> None:
    # hybrid: actor_fwd beside the actor recomputes old_logprobs; icepop weighs each token by
    # proximal / behaviour. On-policy, the two agree to round-off: no token is dropped, weights ~1.
    code, rows, printed = testing.tiny_run(tmp_path, "icepop", "async_policy.correction=icepop", "roles.actor_fwd={}",
                                           "placement.mode=hybrid", "async_policy.max_staleness=0", "trainer.steps=2")
    assert code == 0, printed
    assert all(r["train/correction_kept_frac"] == 1.0 for r in rows)
    assert all(r["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3) for r in rows)
