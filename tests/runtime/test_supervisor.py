"""The fault policy without Ray: ``Supervisor.check`` judged on tables of what a pass saw.

Each case gives the ``fault_tolerance`` of the run (its roles' ``on_failure`` and
``max_restarts``), the budget the attempt spent, one ``Observation``, and the verdicts expected in
order. ``Recovery`` applies them on a real run (``tests/runtime/test_faults.py``, the faults lane).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from relax.runtime.driver.supervisor import (Attempt, Ended, Observation, Restart, Resume, Retire, StartFailure,
                                             Stop, Supervisor, Verdict, waits_text)
from relax.runtime.state.records import Beat
from relax.spec.models import FaultToleranceSpec

NOW = 1000.0
HEARTBEAT_S, PROGRESS_S, WAIT_S = 30.0, 600.0, 300.0
ROLLOUT = ("rollout",)
TRAINER = ("actor", "reference", "actor_fwd")


def faults(**roles: dict) -> FaultToleranceSpec:
    """The run's fault tolerance: the defaults, with ``roles`` overriding some roles' policies."""
    return FaultToleranceSpec.model_validate({"heartbeat_timeout_s": HEARTBEAT_S, "progress_timeout_s": PROGRESS_S,
                                              "wait_timeout_s": WAIT_S, "roles": roles})


def died(holder: str, roles: tuple[str, ...] = ROLLOUT) -> Ended:
    return Ended(holder, roles, error="its process died (ActorDiedError) while busy with reward 'judge'")


def healthy(*holders: str, beat_at: float = NOW - 1, busy_since: float | None = None) -> dict:
    """A health pass in which ``holders`` beat at ``beat_at``."""
    return {"beats": {h: Beat(beat_at, "generating" if busy_since else "", busy_since) for h in holders},
            "watched": {h: NOW - 100 for h in holders}, "stalled_s": 0.0, "now": NOW}


@dataclass
class Case:
    name: str
    seen: Observation
    expected: list[Verdict]
    faults: FaultToleranceSpec = field(default_factory=faults)
    spent: dict[str, int] = field(default_factory=dict)


TABLE = [
    Case("a dead worker is restarted in place", Observation(ended=[died("rollout")]),
         [Restart("rollout", ROLLOUT, died("rollout").error)]),
    Case("a dead worker whose role resumes resumes the run",
         Observation(ended=[died("trainer", TRAINER)]),
         [Resume(TRAINER, "trainer failed: its process died (ActorDiedError) while busy with reward 'judge'")],
         faults(actor={"on_failure": "resume"})),
    Case("the strictest policy of a worker's roles wins",
         Observation(ended=[died("trainer", TRAINER)]),
         [Stop("trainer failed and its policy is stop (fault_tolerance.roles): " + died("x").error)],
         faults(actor={"on_failure": "resume"}, reference={"on_failure": "stop"})),
    Case("a restart past the budget stops the run",
         Observation(ended=[died("rollout")]),
         [Stop("rollout failed 3 times, past fault_tolerance.roles.rollout.max_restarts=2; last failure: "
               + died("x").error)],
         faults(rollout={"max_restarts": 2}), {"rollout": 2}),
    Case("a resume past the budget stops the run",
         Observation(ended=[died("trainer", TRAINER)]),
         [Stop("actor failed 2 times, past fault_tolerance.roles.actor.max_restarts=1; last failure: trainer "
               "failed: " + died("x").error)],
         faults(actor={"on_failure": "resume", "max_restarts": 1}), {"actor": 1}),
    Case("two replicas failing in one pass spend two restarts, the second past the budget",
         Observation(ended=[died("rollout#1"), died("rollout#2")]),
         [Restart("rollout#1", ROLLOUT, died("x").error),
          Stop("rollout failed 2 times, past fault_tolerance.roles.rollout.max_restarts=1; last failure: "
               + died("x").error)],
         faults(rollout={"max_restarts": 1})),
    Case("a failure that repeats on any retry stops the run however much budget is left",
         Observation(ended=[Ended("rollout", ROLLOUT, error="data.train: bad.jsonl:26 invalid JSON", repeats=True)]),
         [Stop("data.train: bad.jsonl:26 invalid JSON (not retried: it would fail the same way again)")]),
    Case("a worker that failed while starting stops the run with a restart policy and budget left",
         Observation(start_failures=[StartFailure("rollout", "worker rollout failed while starting: RuntimeError: "
                                                  "judge.bin is missing")]),
         [Stop("worker rollout failed while starting: RuntimeError: judge.bin is missing")]),
    Case("a drained replica that finished is retired, not restarted",
         Observation(ended=[Ended("rollout#2", ROLLOUT, draining=True)]), [Retire("rollout#2")]),
    Case("a worker stopped before the run ended stops the run",
         Observation(ended=[Ended("trainer", TRAINER, stopped=True)]),
         [Stop("trainer was stopped before the run ended")]),
    Case("a worker that finished its part is no verdict", Observation(ended=[Ended("evaluator", ROLLOUT)]), []),
    Case("a hung worker (no heartbeat) is restarted",
         Observation(**{**healthy("rollout", beat_at=NOW - 45), "roles": {"rollout": ROLLOUT}}),
         [Restart("rollout", ROLLOUT, "no heartbeat for 45 s (fault_tolerance.heartbeat_timeout_s=30): the process "
                                      "is frozen or its node is lost")]),
    Case("a stuck worker (busy past the progress timeout) is restarted",
         Observation(**{**healthy("rollout", busy_since=NOW - 700), "roles": {"rollout": ROLLOUT}}),
         [Restart("rollout", ROLLOUT, "busy with generating for 700 s (fault_tolerance.progress_timeout_s=600): it "
                                      "stopped making progress")]),
    Case("a hung trainer whose policy is resume resumes the run",
         Observation(**{**healthy("trainer", beat_at=NOW - 45), "roles": {"trainer": TRAINER}}),
         [Resume(TRAINER, "trainer failed: no heartbeat for 45 s (fault_tolerance.heartbeat_timeout_s=30): the "
                          "process is frozen or its node is lost")],
         faults(actor={"on_failure": "resume"})),
    Case("a run that stands still past the wait timeout stops, naming what each worker waits on",
         Observation(**{**healthy("rollout"), "stalled_s": 301.0, "roles": {"rollout": ROLLOUT}}),
         [Stop("nothing moved in the run for 301 s (fault_tolerance.wait_timeout_s) while every worker looked "
               "alive; a role waits on something no one will provide. Last seen: rollout: idle")]),
    Case("healthy workers get no verdict",
         Observation(**{**healthy("rollout", "trainer"), "roles": {"rollout": ROLLOUT, "trainer": TRAINER}}), []),
    Case("a worker judged for its ended task is not judged hung in the same pass",
         Observation(ended=[died("rollout")], **{**healthy("rollout", beat_at=NOW - 45),
                                                  "roles": {"rollout": ROLLOUT}}),
         [Restart("rollout", ROLLOUT, died("x").error)]),
    Case("nothing after a stop is judged",
         Observation(ended=[Ended("trainer", TRAINER, stopped=True), died("rollout")]),
         [Stop("trainer was stopped before the run ended")]),
]


@pytest.mark.parametrize("case", TABLE, ids=lambda c: c.name)
def test_supervisor_check(case: Case) -> None:
    attempt = Attempt(restarts=dict(case.spent))
    assert Supervisor(case.faults).check(case.seen, attempt) == case.expected
    assert attempt.restarts == case.spent  # judging spends nothing: Recovery charges what it applies


def test_a_resumed_attempt_keeps_the_budget_spent_and_says_why_it_began() -> None:
    first = Attempt(start_step=0, restarts={"rollout": 1}, recoveries=1)
    second = first.resumed(6, None, "trainer failed: its process died")
    assert (second.number, second.start_step, second.cause) == (2, 6, "trainer failed: its process died")
    assert second.restarts == {"rollout": 1} and second.recoveries == 1
    second.restarts["rollout"] += 1
    assert first.restarts == {"rollout": 1}  # each attempt's record stands as it ended


def test_waits_text_names_each_worker_s_last_activity() -> None:
    beats = {"rollout": Beat(1.0, "wait_version(10,)", None), "actor": Beat(1.0, "", None)}
    assert waits_text(beats) == "actor: idle; rollout: wait_version(10,)"
    assert waits_text({}) == "no heartbeats"
