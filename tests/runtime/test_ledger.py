"""The rollout work ledger, the hang rule and the ragged-row layout: pure logic, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from relax.runtime.state.health import hung_workers
from relax.runtime.state.ledger import RolloutLedger
from relax.runtime.state.records import Beat
from relax.runtime.worker.role_env import accepted_rows
from relax.runtime.worker.rows import relayout, restack
from relax.runtime.driver.supervisor import waits_text


def test_units_are_leased_in_order_within_the_staleness_admission() -> None:
    ledger = RolloutLedger(steps=3, prompts_per_step=16, samples_per_prompt=4, unit_prompts=8)
    assert ledger.units_per_step == 2
    first = ledger.lease("a", max_step=0)
    second = ledger.lease("b", max_step=0)
    assert (first["step"], first["unit"], first["start"], first["stop"]) == (0, 0, 0, 8)
    assert (second["step"], second["unit"], second["start"]) == (0, 1, 8)
    assert ledger.lease("c", max_step=0) is None  # step 1 is not admitted yet
    assert ledger.lease("c", max_step=1)["step"] == 1


def test_a_failed_replica_s_units_are_regenerated_and_its_late_acknowledgement_refused() -> None:
    ledger = RolloutLedger(steps=1, prompts_per_step=4, samples_per_prompt=2, unit_prompts=2)
    lost = ledger.lease("dead", max_step=0)
    kept = ledger.lease("alive", max_step=0)
    assert ledger.complete("alive", 0, kept["unit"], kept["attempt"], {"n": 1})
    assert ledger.release("dead") == 4 and ledger.counters.regenerated == 4
    again = ledger.lease("alive", max_step=0)
    assert (again["unit"], again["attempt"]) == (lost["unit"], 2)
    assert not ledger.complete("dead", 0, lost["unit"], lost["attempt"], {})  # its rows are orphans
    assert not ledger.step_done(0)
    assert ledger.complete("alive", 0, again["unit"], again["attempt"], {})
    assert ledger.step_done(0) and ledger.retried(0)
    assert ledger.accepted(0) == {0: 2, 1: 1}
    assert ledger.counters.produced == 8 and ledger.counters.by_holder == {"alive": 8}


def test_a_step_s_rows_are_what_its_acknowledged_attempts_put() -> None:
    """A sample may be several rows (a trajectory of several segments): readers take the rows the
    acknowledged attempts reported (``rollout_samples``), not prompts x samples; a revoked
    attempt's report does not count, the samples produced stay samples."""
    ledger = RolloutLedger(steps=1, prompts_per_step=4, samples_per_prompt=2, unit_prompts=2)
    first, second = ledger.lease("a", max_step=0), ledger.lease("b", max_step=0)
    assert ledger.complete("a", 0, first["unit"], first["attempt"], {"rollout_samples": 6})  # two branched
    assert ledger.rows(0) == 6
    ledger.release("b")
    assert not ledger.complete("b", 0, second["unit"], second["attempt"], {"rollout_samples": 9})
    again = ledger.lease("a", max_step=0)
    assert ledger.complete("a", 0, again["unit"], again["attempt"], {"rollout_samples": 4})
    assert ledger.rows(0) == 10 and ledger.counters.produced == 8
    plain = RolloutLedger(steps=1, prompts_per_step=2, samples_per_prompt=3, unit_prompts=2)
    unit = plain.lease("a", max_step=0)
    plain.complete("a", 0, unit["unit"], unit["attempt"], {})  # no report: one row per sample
    assert plain.rows(0) == 6


def test_orphan_rows_are_skipped_and_counted_once_per_attempt() -> None:
    meta = [SimpleNamespace(extra={"unit": u, "attempt": a}) for u, a in [(0, 1), (0, 2), (1, 1), (0, 1)]]
    keep, orphans = accepted_rows(meta, {0: 2, 1: 1})
    assert keep == [1, 2] and orphans == {(0, 1): 2}
    ledger = RolloutLedger(steps=1, prompts_per_step=2, samples_per_prompt=1, unit_prompts=1)
    ledger.drop(0, 0, 1, 2)
    ledger.drop(0, 0, 1, 2)  # another reader skipping the same rows
    assert ledger.counters.dropped == 2


def test_a_forgotten_step_is_never_leased_again() -> None:
    ledger = RolloutLedger(steps=2, prompts_per_step=1, samples_per_prompt=1, unit_prompts=1)
    unit = ledger.lease("a", max_step=1)
    ledger.complete("a", 0, unit["unit"], unit["attempt"], {})
    ledger.forget(0)
    assert ledger.lease("a", max_step=1)["step"] == 1


def test_hung_workers_are_the_silent_and_the_stuck_not_the_waiting() -> None:
    now = 1000.0
    beats = {"silent": Beat(at=now - 20, activity="x", busy_since=None),
             "stuck": Beat(at=now, activity="rollout generates step 3", busy_since=now - 700),
             "waiting": Beat(at=now, activity="wait_ready", busy_since=None),
             "working": Beat(at=now, activity="train", busy_since=now - 5)}
    watched = dict.fromkeys([*beats, "never-beat"], now - 100)
    verdicts = {v.holder: v.reason for v in hung_workers(beats, watched, now, 10, 600)}
    assert set(verdicts) == {"silent", "stuck", "never-beat"}
    assert "no heartbeat" in verdicts["silent"] and "rollout generates step 3" in verdicts["stuck"]


def test_a_stalled_run_names_what_each_worker_last_said_it_did() -> None:
    beats = {"rollout": Beat(at=1.0, activity="wait_version(10,)", busy_since=None),
             "actor": Beat(at=1.0, activity="", busy_since=None)}
    assert waits_text(beats) == "actor: idle; rollout: wait_version(10,)"
    assert waits_text({}) == "no heartbeats"


def test_ragged_rows_of_several_units_are_laid_out_like_one_dense_batch() -> None:
    # Row 0: prompt [1, 2], response [3]; row 1: prompt [4], response [5, 6, 7].
    fields = {"input_ids": [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7])],
              "rollout_logprobs": [torch.tensor([0.0, 0.0, -0.5]), torch.tensor([0.0, -1.0, -2.0, -3.0])],
              "lengths": torch.tensor([[2, 1], [1, 3]]), "rewards": [torch.tensor(1.0), torch.tensor(0.0)]}
    batch = relayout(restack(SimpleNamespace(fields=fields), keep_ragged=True))
    assert batch.fields["input_ids"].tolist() == [[1, 2, 3, 0, 0], [0, 4, 5, 6, 7]]
    assert batch.fields["rollout_logprobs"][1].tolist() == [0.0, 0.0, -1.0, -2.0, -3.0]
    assert batch.fields["rewards"].tolist() == [1.0, 0.0]


def test_a_restarted_rollout_picks_up_at_its_first_unacknowledged_step() -> None:
    """A rollout that acknowledges in the background may report step 3 and die before its ack
    lands: it must make step 3 again, not step 4 (the actor would wait for step 3 forever)."""
    from relax.runtime.state.records import StepReport
    from relax.runtime.state.run_state import RunState

    ledger = RolloutLedger(steps=10, prompts_per_step=4, samples_per_prompt=2, unit_prompts=4)
    state = RunState(ledger)
    for step in range(4):
        unit = ledger.lease("r", max_step=step, only_step=step)
        if step < 3:  # step 3's acknowledgement never arrives
            state.complete("r", step, unit["unit"], unit["attempt"], {}, ["response"])
        state.report([StepReport(step, "rollout", {}), StepReport(step, "reward", {})])
    state.release("r")
    progress = state.progress()
    assert progress == {"rollout": 2, "reward": 3}
    assert ledger.lease("r2", max_step=3, only_step=3) is not None  # step 3 is pending again
