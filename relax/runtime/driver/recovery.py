"""Applying the ``Supervisor``'s verdicts to a run's workers: a ``Restart`` kills the worker if it
still lives, sends its leased rollout units back to the ledger (generated again:
``samples/regenerated``) and starts a new one in place, on its planned bundle (on a spare one when
its node is gone), picking up where each of its roles last reported; a ``Resume`` and a ``Stop``
end the attempt (``ResumeRun``, ``RunFailed``); a ``Retire`` drops a drained replica.

Every recovery is charged to the ``Attempt`` (per role, against ``max_restarts``), recorded in the
run's events (``GET /status``) and traced as a ``relax.fault`` span.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from relax.runtime.driver.fleet import Fleet, Slot, StartFailed, alive_nodes
from relax.runtime.driver.supervisor import (
    Attempt,
    Observation,
    Restart,
    Resume,
    ResumeRun,
    Retire,
    RunFailed,
    Stop,
    Supervisor,
    Verdict,
)


class Recovery:
    """Applies verdicts, and charges recoveries to the attempt's budget."""

    def __init__(self, supervisor: Supervisor, telemetry: Any, events: list[dict[str, Any]]) -> None:
        self.supervisor, self.telemetry = supervisor, telemetry
        self.events = events
        """The run's events (failures, recoveries, scaling), as ``GET /status`` shows them."""

    def apply(self, verdicts: Sequence[Verdict], attempt: Attempt, fleet: Fleet) -> None:
        """Apply ``verdicts`` in order; a ``Stop`` raises ``RunFailed``, a ``Resume`` ``ResumeRun``."""
        for verdict in verdicts:
            if isinstance(verdict, Stop):
                raise RunFailed(verdict.reason)
            if isinstance(verdict, Resume):
                raise ResumeRun(list(verdict.roles), verdict.reason)
            if isinstance(verdict, Retire):
                slot = fleet.slot(verdict.holder)
                fleet.remove(slot)
                fleet.ask(fleet.state.release.remote(slot.holder))
            elif isinstance(verdict, Restart):
                self.charge(attempt, list(verdict.roles), verdict.reason, "restart", verdict.holder)
                self._restart(fleet.slot(verdict.holder), verdict.reason, attempt, fleet)

    def charge(self, attempt: Attempt, roles: list[str], reason: str, action: str, holder: str | None = None) -> None:
        """Count a recovery against each role's budget; past it, stop with a report. ``holder``: the
        worker that failed, when one did (its name tells the evaluation worker from the rollout)."""
        from relax.telemetry import FAULT

        over = self.supervisor.overrun(attempt.restarts, roles, reason)
        if over is not None:
            raise RunFailed(over)
        for role in roles:
            attempt.restarts[role] = attempt.restarts.get(role, 0) + 1
        attempt.recoveries += 1  # one failure, one recovery, whatever the number of roles it charged
        event = {"at": time.time(), "roles": roles, "action": action, "reason": reason.splitlines()[0][:500]}
        if holder is not None:
            event["worker"] = holder
        self.events.append(event)
        with self.telemetry.span(FAULT, role="/".join(roles), action=action, reason=event["reason"],
                                 restarts=attempt.recoveries, **({"worker": holder} if holder else {})):
            pass

    def _restart(self, slot: Slot, reason: str, attempt: Attempt, fleet: Fleet) -> None:
        """Start a failed worker again in place (on a spare bundle when its node is gone)."""
        import ray

        from relax.runtime.driver.placement import PlacementError

        if slot.worker is not None:
            ray.kill(slot.worker, no_restart=True)
        regenerated = fleet.ask(fleet.state.release.remote(slot.holder))
        self.events[-1]["regenerated"] = regenerated
        resumed = fleet.ask(fleet.state.progress.remote())
        timeout = self.supervisor.faults.restart_timeout_s
        if slot.node not in alive_nodes() or slot.group is not None:
            fleet.move(slot, timeout)
        fleet.launch_worker(slot)
        try:
            self._started(slot, timeout, attempt, fleet)
        except ray.exceptions.GetTimeoutError:
            ray.kill(slot.worker, no_restart=True)
            try:
                fleet.move(slot, timeout)
            except PlacementError as exc:
                raise RunFailed(f"{slot.holder} cannot be placed again after it failed ({reason.splitlines()[0]}): "
                                f"{exc}") from None
            fleet.launch_worker(slot)
            self._started(slot, timeout, attempt, fleet)
        self.events[-1]["node"] = slot.node
        print(f"relax run: {slot.holder} failed ({reason.splitlines()[0][:200]}); restarted in place on node "
              f"{str(slot.node)[:12]}" + (f", {regenerated} samples to generate again" if regenerated else ""),
              file=sys.stderr, flush=True)
        fleet.begin(slot, resumed)
        if slot.draining:  # it was leaving when it failed: it still is
            fleet.ask(fleet.state.drain.remote(slot.holder))

    def _started(self, slot: Slot, timeout_s: float, attempt: Attempt, fleet: Fleet) -> None:
        """Wait until the restarted worker is ready; one that failed while starting is judged (it
        stops the run: its constructor fails the same way on every try)."""
        try:
            fleet.start(slot, timeout_s)
        except StartFailed as failed:
            self.apply(self.supervisor.check(Observation(start_failures=[failed.failure]), attempt), attempt, fleet)
