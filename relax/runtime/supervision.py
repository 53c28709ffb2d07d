"""Supervising a run's workers: ended tasks, Ray's death signals, heartbeats and progress, and
the fault policy (``fault_tolerance.roles``) that decides what a failure costs: ``restart`` the
worker in place, ``resume`` the run from its last checkpoint, or ``stop`` it. Restarts are counted
per role against ``max_restarts``; past it the run stops with a report.

``Supervision`` is a part of ``relax.runtime.controller.Controller`` (a mixin): it reads the
controller's ``faults``, ``state``, ``telemetry``, ``_slots``, ``restarts`` and ``events``, and uses
its deployment (``_launch``, ``_ready``, ``_begin``, ``_move``, ``_drop_worker``) and its elastic
part (``_scale``, ``_join``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from relax.runtime.deploy import Slot, alive_nodes
from relax.runtime.records import Beat, RoleFailure, RunStatus

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


def start_failure(holder: str, exc: BaseException) -> str:
    """Why worker ``holder`` could not start, in one line, from what ``ray.get`` of its ``ready``
    raised: the worker's own exception (``RoleWorker`` keeps a failure of its constructor and
    raises it from ``ready``), or what Ray kept of one that killed the process while it started."""
    import ray

    cause = getattr(exc, "cause", None)
    if isinstance(cause, RoleFailure):
        return cause.headline
    if isinstance(exc, ray.exceptions.RayActorError):
        if exc.actor_init_failed:  # Ray's text of the creation task's error: its last line is the exception
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            return f"worker {holder} failed while starting: {lines[-1] if lines else type(exc).__name__}"
        return f"worker {holder} died while starting ({type(exc).__name__}); see its log under the Ray session folder"
    text = str(cause or exc).strip()
    return f"worker {holder} failed while starting: {type(cause or exc).__name__}: {text.splitlines()[0] if text else ''}"


class Supervision:
    """Watching the controller's workers and recovering their failures."""

    def _control(self, ref: Any) -> Any:
        """A call to ``RunState``; its loss is the controller role's failure (resume the run)."""
        import ray

        try:
            return ray.get(ref, timeout=self.faults.wait_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise ResumeRun(["controller"], f"the run's control plane failed: {type(exc).__name__}") from None

    def _supervise(self) -> None:
        """One pass over the workers: ended tasks, Ray's death signals, heartbeats; then any scale
        request."""
        import ray

        from relax.runtime.health import hung_workers

        live = [slot for slot in self._slots if slot.task is not None]
        if live:
            ended, _ = ray.wait([slot.task for slot in live], num_returns=len(live), timeout=0)
            for slot in [s for s in live if s.task in ended]:
                try:
                    result = ray.get(slot.task)
                except Exception as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, RoleFailure) and cause.stops_run:
                        raise RunFailed(f"{cause.headline} (not retried: it would fail the same way again)") from None
                    self._failed(slot, _cause(exc))
                    continue
                slot.task = None
                if slot.draining:  # a removed replica finished its last unit
                    self._drop_worker(slot)
                    self._slots.remove(slot)
                    self._control(self.state.release.remote(slot.holder))
                elif result.get("stopped"):
                    raise RunFailed(f"{slot.holder} was stopped before the run ended")
        status: RunStatus = self._control(self.state.status.remote())
        beats = self._control(self.state.health.remote())
        if status.stalled_s > self.faults.wait_timeout_s:
            raise RunFailed(f"nothing moved in the run for {status.stalled_s:.0f} s (fault_tolerance.wait_timeout_s) "
                            "while every worker looked alive; a role waits on something no one will provide. "
                            f"Last seen: {waits_text(beats)}")
        watched = {slot.holder: slot.ready_at for slot in self._slots if slot.task is not None}
        for verdict in hung_workers(beats, watched, time.time(), self.faults.heartbeat_timeout_s,
                                    self.faults.progress_timeout_s):
            slot = next(s for s in self._slots if s.holder == verdict.holder)
            self._failed(slot, verdict.reason)
        while not self.scale_requests.empty():
            self._scale(self.scale_requests.get())
        self._join()

    def _finish(self) -> None:
        """Every step is reported: wait for the workers' tasks to end (replicas see no more work)."""
        import ray

        tasks = [slot.task for slot in self._slots if slot.task is not None]
        done, _ = ray.wait(tasks, num_returns=len(tasks), timeout=self.faults.wait_timeout_s)
        for ref in done:
            ray.get(ref)

    def _started(self, slot: Slot, timeout_s: float) -> None:
        """Wait until a (re)started worker is ready. One that fails while starting stops the run at
        once: its constructor fails the same way on every try (bad data, a plugin that cannot be
        built, a broken checkpoint), so restarting it would only spend the budget and hide the
        cause. Only a timeout (``ray.exceptions.GetTimeoutError``) is left to the caller."""
        import ray

        try:
            self._ready(slot, timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise
        except Exception as exc:
            raise RunFailed(start_failure(slot.holder, exc)) from None

    # -- failures -------------------------------------------------------------------------------

    def _policy(self, roles: list[str]) -> str:
        policies = [getattr(self.faults.roles, role).on_failure for role in roles]
        return next(p for p in POLICY_ORDER if p in policies)

    def _charge(self, roles: list[str], reason: str, action: str, holder: str | None = None) -> None:
        """Count a recovery against each role's budget; past it, stop with a report. ``holder``: the
        worker that failed, when one did (its name tells the evaluation worker from the rollout)."""
        from relax.telemetry import FAULT

        for role in roles:
            self.restarts[role] = self.restarts.get(role, 0) + 1
            budget = getattr(self.faults.roles, role).max_restarts
            if self.restarts[role] > budget:
                raise RunFailed(f"{role} failed {self.restarts[role]} times, past fault_tolerance.roles.{role}."
                                f"max_restarts={budget}; last failure: {reason}")
        event = {"at": time.time(), "roles": roles, "action": action, "reason": reason.splitlines()[0][:500]}
        if holder is not None:
            event["worker"] = holder
        self.events.append(event)
        with self.telemetry.span(FAULT, role="/".join(roles), action=action, reason=event["reason"],
                                 restarts=sum(self.restarts.values()), **({"worker": holder} if holder else {})):
            pass

    def _failed(self, slot: Slot, reason: str) -> None:
        policy = self._policy(slot.roles)
        if policy == "stop":
            raise RunFailed(f"{slot.holder} failed and its policy is stop (fault_tolerance.roles): {reason}")
        if policy == "resume":
            raise ResumeRun(slot.roles, f"{slot.holder} failed: {reason.splitlines()[0]}")
        self._charge(slot.roles, reason, "restart", slot.holder)
        self._restart(slot, reason)

    def _restart(self, slot: Slot, reason: str) -> None:
        """Start a failed worker again in place (on a spare bundle when its node is gone)."""
        import ray

        from relax.runtime.placement import PlacementError

        if slot.worker is not None:
            ray.kill(slot.worker, no_restart=True)
        regenerated = self._control(self.state.release.remote(slot.holder))
        self.events[-1]["regenerated"] = regenerated
        resumed = self._control(self.state.progress.remote())
        timeout = self.faults.restart_timeout_s
        if slot.node not in alive_nodes() or slot.group is not None:
            self._move(slot, timeout)
        self._launch(slot)
        try:
            self._started(slot, timeout)
        except ray.exceptions.GetTimeoutError:
            ray.kill(slot.worker, no_restart=True)
            try:
                self._move(slot, timeout)
            except PlacementError as exc:
                raise RunFailed(f"{slot.holder} cannot be placed again after it failed ({reason.splitlines()[0]}): "
                                f"{exc}") from None
            self._launch(slot)
            self._started(slot, timeout)
        self.events[-1]["node"] = slot.node
        print(f"relax run: {slot.holder} failed ({reason.splitlines()[0][:200]}); restarted in place on node "
              f"{str(slot.node)[:12]}" + (f", {regenerated} samples to generate again" if regenerated else ""),
              file=sys.stderr, flush=True)
        self._begin(slot, resumed)
        if slot.draining:  # it was leaving when it failed: it still is
            self._control(self.state.drain.remote(slot.holder))


def waits_text(beats: dict[str, Beat]) -> str:
    """What each worker's last heartbeat said it was doing, for a stalled run's report."""
    return "; ".join(f"{holder}: {beat.activity or 'idle'}" for holder, beat in sorted(beats.items())) or "no heartbeats"


def _cause(exc: BaseException) -> str:
    """A worker's failure as one readable text (Ray wraps the worker's own exception)."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return f"its process died ({type(exc).__name__})"
    cause = getattr(exc, "cause", None) or exc
    return str(cause).strip() or repr(cause)

