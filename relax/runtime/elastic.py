"""Elastic rollout: ``POST /scale`` adds rollout replicas (each joins once its model is built and
syncs weights on its first unit) or drains and removes them; ``GET /status`` describes the workers.

``Elastic`` is a part of ``relax.runtime.controller.Controller`` (a mixin): it reads the
controller's ``spec``, ``faults``, ``state``, ``telemetry``, ``_slots``, ``_joins``,
``_next_replica``, ``scale_requests``, ``_counters``, ``_consumed``, ``restarts`` and ``events``,
and uses its deployment (``_launch``, ``_move``, ``_begin``, ``_drop_worker``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from relax.roles import Role
from relax.runtime.deploy import Slot
from relax.runtime.supervision import _cause


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



class Elastic:
    """Scaling the rollout replicas of a running run, and describing its workers."""

    def request_scale(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /scale``: queue the change for the watch loop and wait for it to be applied."""
        from relax.runtime.control import SCALE_TIMEOUT_S, ControlError

        replicas = request.get("rollout")
        if self.plan.rollout_replica is None:
            raise ControlError("this run's rollout is not elastic; set roles.rollout.max_replicas (separate mode) "
                               "to scale it mid-run")
        limit = self.plan.rollout_work.replica_limit
        if not isinstance(replicas, int) or not 1 <= replicas <= limit:
            raise ControlError(f"rollout={replicas!r}: this run allows 1 to {limit} rollout replicas "
                               "(roles.rollout.max_replicas)")
        item = ScaleRequest(replicas)
        self.scale_requests.put(item)
        if not item.done.wait(SCALE_TIMEOUT_S):
            raise ControlError(f"the change was not applied within {SCALE_TIMEOUT_S:.0f} s")
        if "error" in item.result:
            raise ControlError(item.result["error"])
        return item.result

    def _scale(self, item: ScaleRequest) -> None:
        """Start applying a scale request. Removed replicas are asked to drain at once; new ones
        are launched here and join (``_join``) once built, without holding up supervision."""
        rollouts = [s for s in self._slots if s.generates and not s.draining]
        item.before = len(rollouts)
        # Replicas that host only a rollout can leave, newest first; the one hosting the step loops stays.
        removable = sorted((s for s in rollouts if s.replica > 0), key=lambda s: -s.replica)
        try:
            if item.before - item.replicas > len(removable):
                raise ValueError(f"{item.before} replicas run and {len(removable)} of them can be removed (the "
                                 "first replica hosts the run's step loops); ask for at least "
                                 f"{item.before - len(removable)}")
            for _ in range(item.replicas - item.before):  # grow: each new replica syncs weights first
                n = self._next_replica
                slot = Slot(self.plan.rollout_replica.model_copy(update={"replica": n, "holder": f"rollout#{n}"}), {})
                self._next_replica += 1
                self._slots.append(slot)  # from now on teardown finds it
                self._move(slot, self.faults.restart_timeout_s)
                self._launch(slot)
                item.joining.append((slot, slot.worker.ready.remote()))
            for slot in removable[:max(0, item.before - item.replicas)]:  # shrink: drain, then drop
                slot.draining = True
                self._control(self.state.drain.remote(slot.holder))
        except Exception as exc:
            self._answer(item, {"error": f"{type(exc).__name__}: {exc}"})
            return
        item.deadline = time.monotonic() + self.faults.restart_timeout_s
        self._joins.append(item)
        self._join()

    def _join(self) -> None:
        """New replicas whose model is built start serving; a request is answered once all of its
        replicas serve (or one could not start: then it is dropped and the answer says why)."""
        import ray

        from relax.telemetry import SCALE

        for item in list(self._joins):
            for slot, ready in list(item.joining):
                done, _ = ray.wait([ready], timeout=0)
                failure = None
                if done:
                    try:
                        slot.started(ray.get(ready))
                        self._begin(slot, None)
                        item.joining.remove((slot, ready))
                        continue
                    except Exception as exc:
                        failure = _cause(exc)
                elif time.monotonic() > item.deadline:
                    failure = f"not ready after {self.faults.restart_timeout_s:.0f} s (fault_tolerance.restart_timeout_s)"
                if failure is not None:
                    for other, _ in item.joining:
                        self._drop_worker(other)
                        self._slots.remove(other)
                    self._joins.remove(item)
                    self._answer(item, {"error": f"a new rollout replica could not start: {failure}"})
                    break
            if item in self._joins and not item.joining:
                self._joins.remove(item)
                with self.telemetry.span(SCALE, role=Role.rollout, before=item.before, after=item.replicas):
                    pass
                self.events.append({"at": time.time(), "roles": [Role.rollout], "action": "scale",
                                    "reason": f"rollout replicas {item.before} -> {item.replicas}"})
                self._answer(item, {"rollout": {"before": item.before, "after": item.replicas},
                                    "replicas": self._replicas()})

    @staticmethod
    def _answer(item: ScaleRequest, result: dict[str, Any]) -> None:
        item.result = result
        item.done.set()

    def _replicas(self) -> list[dict[str, Any]]:
        return [self._describe(s) for s in self._slots if s.generates]

    @staticmethod
    def _describe(slot: Slot) -> dict[str, Any]:
        return {"holder": slot.holder, "roles": slot.roles, "node": slot.node, "pid": slot.pid,
                "draining": slot.draining, "ranks": slot.ranks}

    def status(self) -> dict[str, Any]:
        """``GET /status``: the workers, the rollout replicas, sample counters and faults so far."""
        return {"workers": [self._describe(s) for s in list(self._slots)], "replicas": self._replicas(),
                "counters": asdict(self._counters), "consumed": self._consumed, "restarts": dict(self.restarts),
                "events": list(self.events)}

