"""Elastic rollout: ``POST /scale`` adds rollout replicas (each joins once its model is built and
syncs weights on its first unit) or drains and removes them.

The ``Scaler`` lives as long as the run: the control endpoint's thread queues requests
(``request``), and the controller's supervision pass applies them to the attempt's ``Fleet``
(``apply``) without waiting for new replicas to be built (``join`` starts each once it is ready).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from relax.plan.model import Plan
from relax.roles import Role
from relax.runtime.driver.fleet import Fleet, Slot, worker_failure


@dataclass
class ScaleRequest:
    """``POST /scale`` on its way: the HTTP thread waits on ``done`` for ``result``."""

    replicas: int
    before: int = 0
    joining: list[tuple[Slot, Any]] = field(default_factory=list)
    """New replicas and their ``ready`` calls, until each serves."""
    deadline: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] = field(default_factory=dict)


class Scaler:
    """Scales the rollout replicas of a running run."""

    def __init__(self, plan: Plan, restart_timeout_s: float, telemetry: Any, events: list[dict[str, Any]]) -> None:
        self.plan, self.restart_timeout_s, self.telemetry, self.events = plan, restart_timeout_s, telemetry, events
        self.requests: queue.Queue[ScaleRequest] = queue.Queue()
        """Requests the endpoint queued, for the next supervision pass."""
        self.joins: list[ScaleRequest] = []
        """Requests applied whose new replicas are not all serving yet."""

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /scale``: queue the change for the watch loop and wait for it to be applied."""
        from relax.runtime.driver.control import SCALE_TIMEOUT_S, ControlError

        replicas = request.get("rollout")
        if self.plan.rollout_replica is None:
            raise ControlError("this run's rollout is not elastic; set roles.rollout.max_replicas (separate mode) "
                               "to scale it mid-run")
        limit = self.plan.rollout_work.replica_limit
        if not isinstance(replicas, int) or not 1 <= replicas <= limit:
            raise ControlError(f"rollout={replicas!r}: this run allows 1 to {limit} rollout replicas "
                               "(roles.rollout.max_replicas)")
        item = ScaleRequest(replicas)
        self.requests.put(item)
        if not item.done.wait(SCALE_TIMEOUT_S):
            raise ControlError(f"the change was not applied within {SCALE_TIMEOUT_S:.0f} s")
        if "error" in item.result:
            raise ControlError(item.result["error"])
        return item.result

    def apply(self, fleet: Fleet) -> None:
        """Apply the queued requests, then start the new replicas that are ready."""
        while not self.requests.empty():
            self._scale(fleet, self.requests.get())
        self.join(fleet)

    def _scale(self, fleet: Fleet, item: ScaleRequest) -> None:
        """Start applying a scale request. Removed replicas are asked to drain at once; new ones
        are launched here and join (``join``) once built, without holding up supervision."""
        rollouts = [s for s in fleet.slots if s.generates and not s.draining]
        item.before = len(rollouts)
        # Replicas that host only a rollout can leave, newest first; the one hosting the step loops stays.
        removable = sorted((s for s in rollouts if s.replica > 0), key=lambda s: -s.replica)
        try:
            if item.before - item.replicas > len(removable):
                raise ValueError(f"{item.before} replicas run and {len(removable)} of them can be removed (the "
                                 "first replica hosts the run's step loops); ask for at least "
                                 f"{item.before - len(removable)}")
            for _ in range(item.replicas - item.before):  # grow: each new replica syncs weights first
                slot = fleet.add_replica()
                fleet.move(slot, self.restart_timeout_s)
                fleet.launch_worker(slot)
                item.joining.append((slot, slot.worker.ready.remote()))
            for slot in removable[:max(0, item.before - item.replicas)]:  # shrink: drain, then drop
                slot.draining = True
                fleet.ask(fleet.state.drain.remote(slot.holder))
        except Exception as exc:
            answer(item, {"error": f"{type(exc).__name__}: {exc}"})
            return
        item.deadline = time.monotonic() + self.restart_timeout_s
        self.joins.append(item)

    def join(self, fleet: Fleet) -> None:
        """New replicas whose model is built start serving; a request is answered once all of its
        replicas serve (or one could not start: then it is dropped and the answer says why)."""
        import ray

        from relax.telemetry import SCALE

        for item in list(self.joins):
            for slot, ready in list(item.joining):
                done, _ = ray.wait([ready], timeout=0)
                failure = None
                if done:
                    try:
                        slot.started(ray.get(ready))
                        fleet.begin(slot, None)
                        item.joining.remove((slot, ready))
                        continue
                    except Exception as exc:
                        failure = worker_failure(exc)
                elif time.monotonic() > item.deadline:
                    failure = f"not ready after {self.restart_timeout_s:.0f} s (fault_tolerance.restart_timeout_s)"
                if failure is not None:
                    for other, _ in item.joining:
                        fleet.remove(other)
                    self.joins.remove(item)
                    answer(item, {"error": f"a new rollout replica could not start: {failure}"})
                    break
            if item in self.joins and not item.joining:
                self.joins.remove(item)
                with self.telemetry.span(SCALE, role=Role.rollout, before=item.before, after=item.replicas):
                    pass
                self.events.append({"at": time.time(), "roles": [Role.rollout], "action": "scale",
                                    "reason": f"rollout replicas {item.before} -> {item.replicas}"})
                answer(item, {"rollout": {"before": item.before, "after": item.replicas},
                              "replicas": fleet.replicas()})

    def close(self) -> None:
        """The run ended: every request not yet answered is told so, instead of hanging up."""
        late = list(self.joins)
        while not self.requests.empty():
            late.append(self.requests.get())
        for item in late:
            answer(item, {"error": "the run ended before the change could be applied"})


def answer(item: ScaleRequest, result: dict[str, Any]) -> None:
    item.result = result
    item.done.set()
