"""The fault policy of a run, as a pure function of what the controller saw of its workers.

``Supervisor.check`` reads one ``Observation`` (the workers' ended tasks, a worker that failed while
starting, how long the run stood still, the heartbeats) and the ``Attempt`` (the restart budget
spent so far) and returns ``Verdict``\\ s: ``Restart`` a worker in place, ``Resume`` the run from its
last checkpoint, ``Stop`` it with a report, or ``Retire`` a drained rollout replica. It imports no
Ray, so the policy is a table of unit tests (``tests/runtime/test_supervisor.py``);
``relax.runtime.driver.recovery.Recovery`` applies the verdicts.

The policy (``fault_tolerance.roles``): a failed worker gets the strictest ``on_failure`` of the
roles it holds (stop, then resume, then restart). A restart or a resume is charged to each role it
holds, against the role's ``max_restarts``; past it the run stops. A worker that fails while it
starts, or whose failure says it would repeat on any retry, stops the run at once: restarting it
would only spend the budget and hide the cause.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.runtime.state.health import hung_workers
from relax.runtime.state.records import Beat

#: How often the controller looks at its workers (ended tasks, heartbeats, scale requests).
SUPERVISE_S = 0.5
#: The order in which several roles' policies in one worker win: the strictest first.
POLICY_ORDER = ("stop", "resume", "restart")


class RunFailed(RuntimeError):
    """The run stops: a failure its policy does not recover, or a restart budget is spent."""


class ResumeRun(Exception):
    """A failure that restarts the whole run from its last checkpoint."""

    def __init__(self, roles: list[str], reason: str) -> None:
        super().__init__(reason)
        self.roles, self.reason = roles, reason


@dataclass
class Attempt:
    """One attempt of a run, from ``start_step`` to the end or to the failure that resumes it.

    Passed to whatever launches, supervises or recovers its workers, instead of being read off the
    controller. The restart budget spent (``restarts``, ``recoveries``) carries over to the next
    attempt (``resumed``): a resume does not refill it."""

    number: int = 1
    """1 for the run's first attempt, one more for each resume."""
    start_step: int = 0
    """The step it starts from: 0, or the step of the checkpoint it resumes."""
    resume_from: Path | None = None
    """The checkpoint it resumes from (None: it starts afresh)."""
    cause: str | None = None
    """Why it began: the failure that resumed the run (None for the first attempt)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Recoveries charged to each role so far (a worker holding three roles charges each of them)."""
    recoveries: int = 0
    """Recoveries of the run so far (``faults/restarts``): one per failed worker restarted or
    resumed, however many roles that worker held."""

    def resumed(self, start_step: int, resume_from: Path | None, cause: str) -> Attempt:
        """The next attempt, after ``cause`` resumed the run; it keeps the budget spent."""
        return Attempt(self.number + 1, start_step, resume_from, cause, dict(self.restarts), self.recoveries)


@dataclass(frozen=True)
class Ended:
    """A worker whose task ended, as the fleet read it from Ray."""

    holder: str
    roles: tuple[str, ...]
    error: str | None = None
    """Why its task failed, in one readable text (None: it returned)."""
    repeats: bool = False
    """Its failure would repeat on any retry (``RoleFailure.stops_run``: bad data, a full disk)."""
    stopped: bool = False
    """It returned saying it was stopped before the run ended."""
    draining: bool = False
    """A rollout replica that was asked to leave (``relax scale``)."""


@dataclass(frozen=True)
class StartFailure:
    """A worker that failed while starting: ``reason`` names it and why (``start_failure``)."""

    holder: str
    reason: str


@dataclass(frozen=True)
class Observation:
    """What one supervision pass saw. A pass may carry only some of it: the controller checks the
    ended tasks first, applies their verdicts, then reads the run's health (a restart takes a while,
    and a restarted worker is watched from its new start)."""

    ended: Sequence[Ended] = ()
    start_failures: Sequence[StartFailure] = ()
    stalled_s: float | None = None
    """How long nothing moved in the run (``RunStatus.stalled_s``); None: not read this pass."""
    beats: Mapping[str, Beat] = field(default_factory=dict)
    """Each worker's last heartbeat."""
    watched: Mapping[str, float] = field(default_factory=dict)
    """The workers whose task runs: holder -> when it became ready."""
    roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The roles each watched worker holds."""
    now: float = 0.0


@dataclass(frozen=True)
class Restart:
    """Start the worker again in place; its roles' budgets are charged one each."""

    holder: str
    roles: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Resume:
    """Stop every worker and start the run again from its last checkpoint."""

    roles: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Stop:
    """End the run with a report."""

    reason: str


@dataclass(frozen=True)
class Retire:
    """A drained rollout replica finished its last unit: drop it and release its leases."""

    holder: str


Verdict = Restart | Resume | Stop | Retire

#: Verdicts after which a pass judges nothing more: the run ends or starts over.
FINAL = (Stop, Resume)


class Supervisor:
    """The fault policy of ``fault_tolerance`` (any object with its ``roles``,
    ``wait_timeout_s``, ``heartbeat_timeout_s`` and ``progress_timeout_s``)."""

    def __init__(self, faults: Any) -> None:
        self.faults = faults

    def check(self, seen: Observation, attempt: Attempt) -> list[Verdict]:
        """The verdicts of one pass, in the order to apply them. A ``Stop`` or ``Resume`` is the
        last: the run ends or starts over, so nothing after it matters. Restarts judged in one pass
        are charged in turn (two rollout replicas failing together spend two of its restarts)."""
        verdicts: list[Verdict] = []
        spent = dict(attempt.restarts)
        judged: set[str] = set()
        for failed in seen.start_failures:  # its constructor fails the same way on every try
            return [Stop(failed.reason)]
        for ended in seen.ended:
            judged.add(ended.holder)
            verdict = self._ended(ended, spent)
            if verdict is not None:
                verdicts.append(verdict)
                if isinstance(verdict, FINAL):
                    return verdicts
        if seen.stalled_s is not None and seen.stalled_s > self.faults.wait_timeout_s:
            return [*verdicts, Stop(f"nothing moved in the run for {seen.stalled_s:.0f} s (fault_tolerance."
                                    "wait_timeout_s) while every worker looked alive; a role waits on something "
                                    f"no one will provide. Last seen: {waits_text(seen.beats)}")]
        watched = {holder: at for holder, at in seen.watched.items() if holder not in judged}
        for hung in hung_workers(seen.beats, watched, seen.now, self.faults.heartbeat_timeout_s,
                                 self.faults.progress_timeout_s):
            verdicts.append(self._failure(hung.holder, seen.roles[hung.holder], hung.reason, spent))
            if isinstance(verdicts[-1], FINAL):
                return verdicts
        return verdicts

    def overrun(self, spent: Mapping[str, int], roles: Sequence[str], reason: str) -> str | None:
        """Why one more recovery of ``roles`` is past a budget (``max_restarts``), or None."""
        for role in roles:
            count, budget = spent.get(role, 0) + 1, getattr(self.faults.roles, role).max_restarts
            if count > budget:
                return (f"{role} failed {count} times, past fault_tolerance.roles.{role}.max_restarts={budget}; "
                        f"last failure: {reason}")
        return None

    def policy(self, roles: Sequence[str]) -> str:
        """The ``on_failure`` of a worker holding ``roles``: the strictest of theirs."""
        policies = [getattr(self.faults.roles, role).on_failure for role in roles]
        return next(p for p in POLICY_ORDER if p in policies)

    def _ended(self, ended: Ended, spent: dict[str, int]) -> Verdict | None:
        if ended.error is not None and ended.repeats:
            return Stop(f"{ended.error} (not retried: it would fail the same way again)")
        if ended.error is not None:
            return self._failure(ended.holder, ended.roles, ended.error, spent)
        if ended.draining:  # a removed replica finished its last unit
            return Retire(ended.holder)
        if ended.stopped:
            return Stop(f"{ended.holder} was stopped before the run ended")
        return None  # it finished its part of the run

    def _failure(self, holder: str, roles: tuple[str, ...], reason: str, spent: dict[str, int]) -> Verdict:
        policy = self.policy(roles)
        if policy == "stop":
            return Stop(f"{holder} failed and its policy is stop (fault_tolerance.roles): {reason}")
        verdict: Verdict
        if policy == "resume":
            verdict = Resume(roles, f"{holder} failed: {reason.splitlines()[0]}")
        else:
            verdict = Restart(holder, roles, reason)
        over = self.overrun(spent, roles, verdict.reason)
        if over is not None:
            return Stop(over)
        for role in roles:
            spent[role] = spent.get(role, 0) + 1
        return verdict


def waits_text(beats: Mapping[str, Beat]) -> str:
    """What each worker's last heartbeat said it was doing, for a stalled run's report."""
    said = "; ".join(f"{holder}: {beat.activity or 'idle'}" for holder, beat in sorted(beats.items()))
    return said or "no heartbeats"
