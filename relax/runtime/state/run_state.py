"""The run's small control-plane service: policy versions, data-ready signals, per-step reports,
the rollout work ledger and the workers' heartbeats.

One threaded Ray actor per run. It never carries sample data (that goes through the bus) nor weight
bytes (those stay in the object store; it holds only references). Roles block on it instead of
polling: the rollout waits here for the policy version the staleness bound requires, a consumer
waits for a partition's field to be announced before it reads the bus, and the controller waits
for each step's reports. It is the one owner of the run's staleness policy (``relax.algo.staleness``):
it admits rollout units under the current bound, each lease carries the bound it was admitted
under, and with ``max_staleness: auto`` it moves the bound on each trained step's metrics row.

Every step makes about eight calls here, so a call's cost counts: a threaded actor (Ray runs each
call in one of ``max_concurrency`` threads; one ``threading.Condition`` guards the state and wakes
the waiters) took 0.7 ms of this process's CPU per call where an asyncio actor took 1.3-1.4 ms, and
answered in 1.4 ms instead of 2.2 (a trivial call, measured side by side on the 2-core CPU box; on
the tiny preset this actor was the busiest process after the two workers). A blocking call holds
its thread for at most one wait slice (``relax.runtime.worker.role_env.WAIT_SLICE_S``), so
``concurrency(workers)`` threads are enough: a call beyond them waits at most a slice for one.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from relax.algo.staleness import StalenessPolicy
from relax.runtime.state.ledger import RolloutLedger
from relax.runtime.state.records import (
    Beat,
    Lease,
    PolicyVersion,
    RunStatus,
    SampleCounters,
    StepReport,
    StepsReported,
    UnitDone,
    UnitInfo,
)

#: The rollout's report name (``relax.roles.Role.rollout``; this module stays free of the rest).
ROLLOUT = "rollout"

T = TypeVar("T")


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run a public method with the state's lock held: Ray runs calls in several threads at once."""
    @functools.wraps(method)
    def locked(self: RunState, *args: Any, **kwargs: Any) -> T:
        with self._cond:
            return method(self, *args, **kwargs)
    return locked


def concurrency(workers: int) -> int:
    """Threads the actor needs for a run with ``workers`` worker processes: each may hold a few
    blocking calls at once (a lease asked ahead, a wait for data, a heartbeat), and the controller
    holds its own."""
    return 64 + 4 * workers


def partition_of(step: int) -> str:
    """The bus partition that holds a step's rows."""
    return f"step-{step}"


class RunState:
    """Versions, signals and reports of one run (use as ``ray.remote(RunState)``)."""

    def __init__(self, ledger: RolloutLedger | None = None, policy: StalenessPolicy | None = None,
                 evaluated: list[int] | None = None) -> None:
        self._ledger = ledger
        self._policy = policy if policy is not None else StalenessPolicy(0)
        """The run's staleness policy (strictly on-policy unless given): the current bound."""
        self._draining: set[str] = set()
        self._beats: dict[str, Beat] = {}
        self._done_steps: dict[str, int] = {}
        self._moved_at = time.time()
        self._cond = threading.Condition()
        self._version = -1
        self._weights: list[Any] = []
        self._weight_sender: Any = None
        self._ready: set[tuple[str, str]] = set()
        self._reports: dict[int, dict[str, dict[str, Any]]] = {}
        self._evals: list[dict[str, float]] = []
        """Evaluations posted (``relax.runtime.worker.evaluation``) the controller has not taken."""
        self._evaluated: set[int] = set(evaluated or ())
        """Every policy version evaluated in the run: before this attempt (eval.jsonl, after a resume)
        and in it. An evaluator that starts or restarts skips them."""
        self._stopped = False
        self._failure: str | None = None

    def _notify(self) -> None:
        """Something moved: wake every waiter (call with ``self._cond`` held)."""
        self._moved_at = time.time()
        self._cond.notify_all()

    def _wait(self, predicate, timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds (True), or the run stops or ``timeout_s`` passes (False).
        Call with ``self._cond`` held."""
        return self._cond.wait_for(lambda: predicate() or self._stopped, timeout_s) and predicate()

    # -- weights ------------------------------------------------------------------------------

    @_locked
    def publish(self, version: int, weights: list[Any], reports: list[StepReport] | None = None) -> None:
        """The actor's new policy: ``weights`` is ``[ObjectRef]`` (a list, so it is not resolved).
        ``reports``: the worker's step reports riding on the call (``report``)."""
        if reports:
            self.report(reports)
        self._version, self._weights = version, weights
        self._notify()

    @_locked
    def wait_version(self, min_version: int, timeout_s: float) -> PolicyVersion | None:
        """The newest published version once it is at least ``min_version``; None on timeout or stop."""
        ok = self._wait(lambda: self._version >= min_version, timeout_s)
        return PolicyVersion(self._version, self._weights) if ok else None

    @_locked
    def register_weight_sender(self, worker: Any) -> None:
        """The actor's worker, which sends weights to rollout replicas over weight groups
        (``roles.rollout.weight_sync: collective``); a restarted actor registers its new worker."""
        self._weight_sender = worker

    @_locked
    def weight_sender(self) -> Any:
        """The registered weight sender (a ``RoleWorker`` handle), or None."""
        return self._weight_sender

    # -- data-ready signals ---------------------------------------------------------------------

    @_locked
    def announce(self, partition: str, field: str) -> None:
        """Every row of ``partition`` now holds ``field``."""
        self._ready.add((partition, field))
        self._notify()

    @_locked
    def wait_ready(self, step: int, fields: list[str], timeout_s: float) -> UnitInfo | None:
        """Once every field of ``fields`` is announced for ``step``'s partition: what a reader of
        the step needs (``unit_info``); None on timeout or stop."""
        partition = partition_of(step)
        ok = self._wait(lambda: all((partition, f) in self._ready for f in fields), timeout_s)
        return self._unit_info(step) if ok else None

    @_locked
    def forget(self, partition: str, step: int | None = None) -> None:
        """Drop a finished partition's signals (and its step's rollout units)."""
        self._forget(partition, step)

    def _forget(self, partition: str, step: int | None) -> None:
        self._ready = {key for key in self._ready if key[0] != partition}
        if step is not None and self._ledger is not None:
            self._ledger.forget(step)

    # -- the rollout work ledger (see relax.runtime.state.ledger) ---------------------------------------

    def lease(self, holder: str, only_step: int | None, timeout_s: float,
              reports: list[StepReport] | None = None, admit: bool = False) -> Lease | None:
        """The next unit of rollout work for ``holder``: ``Lease(unit=...)``; ``Lease(done=True)``
        once ``only_step`` is complete (or, without it, every step is); ``Lease(drain=True)`` when the
        replica is being removed; None on timeout or stop. Without ``only_step`` (or with ``admit``)
        a unit of step s is leased only once the staleness policy admits the published version
        (admission control; the lease carries the bound), so the policy the lease carries is one the rollout may
        generate with:
        it needs no ``wait_version`` call of its own. Holds the lock itself: it waits in a loop of
        its own. ``reports``: the caller's step reports, taken first (``report``; a worker's reports
        ride on its next lease asked ahead)."""
        if reports:
            self.report(reports)
        ledger = self._ledger
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._stopped:
                if holder in self._draining:
                    return Lease(drain=True)
                if only_step is not None and ledger.step_done(only_step):
                    return Lease(done=True)
                policy = self._policy
                admitted = not admit or only_step is None or policy.admits(only_step, self._version)
                unit = ledger.lease(holder, policy.newest_step(self._version), only_step) if admitted else None
                if unit is not None:
                    return Lease(unit=unit, policy=PolicyVersion(self._version, self._weights), bound=policy.bound)
                if only_step is None and all(ledger.step_done(s) for s in range(ledger.start_step, ledger.steps)):
                    return Lease(done=True)
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return None
        return None

    @_locked
    def judge_step(self, row: dict[str, Any]) -> int:
        """A trained step's metrics ``row`` for the staleness policy (``max_staleness: auto`` moves
        its bound on it, for the units leased from now on): the bound after it."""
        before = self._policy.bound
        if self._policy.update(row) != before:
            self._notify()
        return self._policy.bound

    @_locked
    def complete(self, holder: str, step: int, unit: int, attempt: int, stats: dict[str, Any],
                 columns: list[str]) -> UnitDone:
        """Acknowledge a unit; when it completes its step, ``columns`` are announced for the step's
        partition and the answer carries the step's unit stats (the caller needs no further call
        to learn the step is done). ``accepted`` is False when the lease was revoked (the rows just
        put are orphans)."""
        accepted = self._ledger.complete(holder, step, unit, attempt, stats)
        done = self._ledger.step_done(step)
        if accepted and done:
            self._ready.update((partition_of(step), column) for column in columns)
        self._notify()
        return UnitDone(accepted=accepted, step_stats=self._ledger.step_stats(step) if done else None)

    def complete_and_lease(self, holder: str, acks: list[tuple[Any, ...]], steps: list[int],
                           timeout_s: float, reports: list[StepReport] | None = None,
                           admit: bool = False) -> list[Lease] | None:
        """``complete`` each of ``acks`` (``(step, unit, attempt, stats, columns)``), then ``lease``
        the next unit of each of ``steps`` for ``holder``: one call instead of several for a sole
        producer that asks for its next steps' units as soon as it acknowledges its last ones
        (colocate mode, where acknowledgements are not awaited, asks for the steps of about
        ``LEASE_WINDOW_S`` at once). Every call between processes costs CPU on both sides: with
        the worker's step reports riding on it, a colocated worker makes one call every few steps.

        The first lease may wait (``timeout_s``; None when it ran out or the run stopped); the
        answer lists the leases in step order and ends at the first that is not a unit. ``admit``:
        each step's lease also waits for its admission (``lease``), so it carries a policy new
        enough to generate with: a separate rollout, which loads that policy, then makes no
        ``wait_version`` call (colocate, whose rollout trains each version itself, asks without)."""
        for step, unit, attempt, stats, columns in acks:
            self.complete(holder, step, unit, attempt, stats, columns)
        if not steps:
            return []
        first = self.lease(holder, steps[0], timeout_s, reports, admit)
        if first is None:
            return None
        granted = [first]
        for step in steps[1:] if first.unit is not None else ():
            got = self.lease(holder, step, 0.0, admit=admit)
            if got is None or got.unit is None:
                break
            granted.append(got)
        return granted

    @_locked
    def release(self, holder: str) -> int:
        """A replica failed or left: its leased units go back to pending. Returns their samples."""
        samples = self._ledger.release(holder) if self._ledger is not None else 0
        self._draining.discard(holder)
        self._beats.pop(holder, None)
        self._notify()
        return samples

    @_locked
    def drain(self, holder: str) -> None:
        """Ask a replica to finish its current unit and lease no more."""
        self._draining.add(holder)
        self._notify()

    def _unit_info(self, step: int) -> UnitInfo:
        """What a reader of a step needs: how many units, which attempt of each counts, and
        whether any unit was retried (then orphan rows may be on the bus)."""
        ledger = self._ledger
        return UnitInfo(units=ledger.units_per_step, accepted=ledger.accepted(step), retried=ledger.retried(step),
                        rows=ledger.rows(step))

    @_locked
    def drop(self, step: int, unit: int, attempt: int, rows: int) -> None:
        self._ledger.drop(step, unit, attempt, rows)

    @_locked
    def step_stats(self, step: int) -> list[dict[str, Any]]:
        return self._ledger.step_stats(step)

    @_locked
    def counters(self) -> SampleCounters:
        return self._counters()

    def _counters(self) -> SampleCounters:
        c = self._ledger.counters
        return SampleCounters(produced=c.produced, regenerated=c.regenerated, dropped=c.dropped,
                              by_holder=dict(c.by_holder))

    # -- health ------------------------------------------------------------------------------------

    @_locked
    def beat(self, holder: str, activity: str, busy_since: float | None) -> None:
        """A worker is alive; ``busy_since`` is when its current piece of work began (None while it
        waits on others). A worker at work keeps the run moving: only a run where every worker
        waits is stalled (a long generation or evaluation is judged by ``progress_timeout_s``)."""
        now = time.time()
        self._beats[holder] = Beat(at=now, activity=activity, busy_since=busy_since)
        if busy_since is not None:
            self._moved_at = now

    @_locked
    def health(self) -> dict[str, Beat]:
        return dict(self._beats)

    @_locked
    def status(self) -> RunStatus:
        """Whether the run is stopped, and for how long nothing moved in it (no publish, signal,
        report or unit): a waiting role gives up only on a run that stands still."""
        return RunStatus(stopped=self._stopped, stalled_s=time.time() - self._moved_at)

    @_locked
    def progress(self) -> dict[str, int]:
        """Per report name, the last step it reported (where a restarted role picks up). The
        rollout's is capped by the ledger: a rollout that puts and acknowledges in the background
        reports a step before its acknowledgement lands, and one that died in between must make
        that step again."""
        done = dict(self._done_steps)
        if self._ledger is not None and ROLLOUT in done:
            done[ROLLOUT] = min(done[ROLLOUT], self._ledger.done_through())
        return done

    # -- per-step reports -----------------------------------------------------------------------

    @_locked
    def report(self, reports: list[StepReport]) -> None:
        """Role loops finished a step (one call per worker step: the stats of its loops, joined by the
        controller's ``wait_reports``)."""
        for report in reports:
            self._reports.setdefault(report.step, {})[report.name] = report.stats
            self._done_steps[report.name] = max(report.step, self._done_steps.get(report.name, -1))
        self._notify()

    @_locked
    def wait_reports(self, step: int, roles: list[str], timeout_s: float) -> StepsReported | None:
        """Once every role of ``roles`` reported ``step``: its reports and those of the steps after
        it that every role reported too (a controller that asks less often than steps end takes
        several in one call), with the sample counters and the evaluations posted since the last
        call; None on timeout or stop. Once every role reported a step, its signals and rollout
        units are forgotten (a role restarted in place re-reads a step only while it is unreported)."""
        def complete(s: int) -> bool:
            return all(r in self._reports.get(s, {}) for r in roles)

        if not self._wait(lambda: complete(step), timeout_s):
            return None
        taken = []
        while complete(step + len(taken)):
            s = step + len(taken)
            self._forget(partition_of(s), s)
            taken.append(self._reports.pop(s))
        evals, self._evals = self._evals, []
        return StepsReported(first=step, reports=taken, counters=self._counters(), evals=evals)

    # -- evaluation --------------------------------------------------------------------------------

    @_locked
    def post_eval(self, figures: dict[str, float]) -> None:
        """A policy version was evaluated (``eval/*`` figures, ``eval/version`` among them)."""
        self._evals.append(figures)
        self._evaluated.add(int(figures["eval/version"]))
        self._notify()

    @_locked
    def evaluated(self) -> list[int]:
        """The policy versions evaluated so far in the run, in order."""
        return sorted(self._evaluated)

    @_locked
    def wait_eval(self, min_version: int, timeout_s: float) -> list[dict[str, float]]:
        """Once an evaluation of a version at least ``min_version`` is posted: every evaluation not
        yet taken (taken now); [] on timeout or stop."""
        self._wait(lambda: any(e["eval/version"] >= min_version for e in self._evals), timeout_s)
        evals, self._evals = self._evals, []
        return evals

    # -- stopping --------------------------------------------------------------------------------

    @_locked
    def stop(self, failure: str | None = None) -> None:
        """Ask every role to stop at its next wait; ``failure`` says why, if it is one."""
        self._stopped = True
        self._failure = self._failure or failure
        self._notify()
