"""The controller: deploys a run's workers, joins their reports, and recovers from failures.

It takes no part in the data path. Each step it waits (in one-second slices) for every role's
report; between slices it supervises: a worker whose Ray task ended with an error, whose process
died (Ray's own signal), whose heartbeats stopped or whose current piece of work outlasted the
progress timeout has failed, and ``fault_tolerance.roles`` says what happens next:

- ``restart``: the worker is killed if it still lives, its leased rollout units go back to the
  ledger (generated again: ``samples/regenerated``), and a new worker starts in place, on its
  planned bundle (on a spare one when its node is gone), picking up where each of its roles last
  reported; a restarted rollout loads the current weights before it generates anything;
- ``resume``: every worker stops and the run starts again from its last checkpoint (the same
  prompts at the same steps: the data order is a function of the step);
- ``stop``: the run ends with a report naming the worker and the cause.

Restarts are counted per role against ``max_restarts``; past it the run stops with a report.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relax.plan.model import Plan
from relax.roles import Role
from relax.runtime.checkpoint import latest_checkpoint
from relax.runtime.hosts import Host, plan_hosts, report_names, run_roles
from relax.runtime.metrics import MetricsLog, Progress, step_row
from relax.runtime.records import RunStatus, SampleCounters
from relax.runtime.run_state import partition_of
from relax.spec.models import RunSpec
from relax.spec.rules import rollout_units

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
class Slot:
    """One worker of the run: what it hosts, where it goes, and its current Ray actor."""

    host: Host
    options: dict[str, Any]
    worker: Any = None
    task: Any = None
    """The ObjectRef of its ``run``/``serve`` call."""
    node: str | None = None
    pid: int | None = None
    ready_at: float = 0.0
    ranks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The other ranks of its multi-process model roles: rank, pid, node, GPU ids."""
    group: Any = None
    """A placement group of its own (a replica added by scaling, or re-placed after a node loss)."""
    draining: bool = False

    @property
    def holder(self) -> str:
        return self.host.holder

    def started(self, info: dict[str, Any]) -> None:
        """The worker answered ``ready``: where it runs, and since when it is watched."""
        self.node, self.pid, self.ready_at = info["node"], info["pid"], time.time()
        self.ranks = info.get("ranks", {})


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


class Controller:
    """Deploys the workers of one run, joins their reports, recovers failures and stops them."""

    def __init__(self, spec: RunSpec, plan: Plan, base_dir: Path, output_dir: Path, model_path: str,
                 start_step: int, resume_from: Path | None, stream: Any = None) -> None:
        self.spec, self.plan, self.base_dir, self.output_dir = spec, plan, base_dir, output_dir
        self.model_path = model_path
        self.start_step, self.resume_from = start_step, resume_from
        self.faults = spec.fault_tolerance
        self.progress = Progress(spec.trainer.steps, stream)
        self.metrics = MetricsLog(output_dir, start_step if resume_from else None)
        self.restarts: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self.scale_requests: queue.Queue[ScaleRequest] = queue.Queue()
        self._consumed = 0
        self._counters = SampleCounters()
        self._slots: list[Slot] = []
        self._joins: list[ScaleRequest] = []
        self._next_replica = 0

    # -- the run, and its resumes -------------------------------------------------------------

    def run(self) -> int:
        import hashlib

        from relax.runtime.control import ControlServer
        from relax.runtime.placement import create_placement
        from relax.telemetry import StepMetricsExporter, Telemetry

        spec = self.spec.model_copy(deep=True)
        spec.trainer.output_dir = str(self.output_dir)
        self.run_spec = spec
        spec_hash = hashlib.sha256(self.spec.model_dump_json().encode()).hexdigest()[:16]
        self.spec_hash = spec_hash
        self.telemetry = Telemetry.from_spec(spec, self.output_dir, role="controller", spec_hash=spec_hash)
        self.step_metrics = StepMetricsExporter.from_spec(spec, spec_hash=spec_hash)
        from relax.bus import Bus

        # The bus first: its actors take logical CPUs that the placement groups would reserve.
        self.bus = Bus.start(num_storage_units=1, node_resource=spec.cluster.bus_node_resource)
        self.placement = create_placement(self.plan)
        control = ControlServer(self.output_dir, self.status, self.request_scale)
        start, resume_from = self.start_step, self.resume_from
        try:
            with self.telemetry.run_span(steps=spec.trainer.steps, start_step=start, mode=self.plan.mode) as run:
                self.carrier = run.carrier()
                while True:
                    try:
                        self._attempt(start, resume_from)
                        return 0
                    except ResumeRun as exc:
                        self._charge(exc.roles, exc.reason, "resume")
                        found = latest_checkpoint(self.output_dir)
                        start, resume_from = found if found is not None else (0, None)
                        self.metrics = MetricsLog(self.output_dir, start)
                        print(f"relax run: {exc.reason}; resuming from step {start}", flush=True)
        finally:
            late = list(self._joins)
            while not self.scale_requests.empty():  # asked too late: say so instead of hanging up
                late.append(self.scale_requests.get())
            for item in late:
                self._answer(item, {"error": "the run ended before the change could be applied"})
            control.close()
            self.placement.remove()
            self.bus.close()
            self.telemetry.shutdown()
            self.step_metrics.shutdown()

    def _attempt(self, start: int, resume_from: Path | None) -> None:
        """Run from ``start`` (a checkpoint's step) to the end, recovering in-place failures."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from relax.runtime.ledger import RolloutLedger
        from relax.runtime.run_state import RunState

        spec = self.run_spec
        algo = spec.algorithm
        ledger = RolloutLedger(spec.trainer.steps, algo.prompts_per_step, algo.samples_per_prompt,
                               rollout_units(spec)[0], start_step=start)
        for partition in self.bus.partitions():  # a resumed attempt starts from an empty bus
            self.bus.clear(partition)
        # The control plane lives beside the driver: losing any other node must not take it along.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.state = ray.remote(RunState).options(num_cpus=0, max_concurrency=64, scheduling_strategy=here).remote(ledger)
        self.attempt_start, self.resume_from_path = start, resume_from
        self._consumed = 0
        self._slots = [Slot(host, self.placement.actor_options(host.instance))
                       for host in plan_hosts(self.plan, run_roles(spec))]
        self._next_replica = max((s.host.replica for s in self._slots), default=0) + 1
        try:
            alive = alive_nodes()
            for slot in self._slots:
                if self.placement.node_of(slot.host.instance) not in alive:  # a node lost before a resume
                    self._move(slot, self.faults.restart_timeout_s)
                self._launch(slot)
            for slot in self._slots:
                self._ready(slot, self.faults.wait_timeout_s)
            for slot in self._slots:
                self._begin(slot, resumed=None)
            self._watch(start)
            self._finish()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        import ray

        try:
            ray.get(self.state.stop.remote(), timeout=5)
        except Exception:  # the control plane itself failed
            pass
        live = [slot.worker for slot in self._slots if slot.worker is not None]
        ray.wait([w.close.remote() for w in live], num_returns=len(live), timeout=10)  # a frozen one never answers
        for slot in self._slots:
            self._drop_worker(slot)
        ray.kill(self.state)

    def _drop_worker(self, slot: Slot) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if slot.worker is not None:
            ray.kill(slot.worker, no_restart=True)
            slot.worker = None
        if slot.group is not None:
            remove_placement_group(slot.group)
            slot.group = None

    # -- starting workers -----------------------------------------------------------------------

    def _launch(self, slot: Slot) -> None:
        import ray

        from relax.runtime.workers import RoleWorker, WorkerLaunch

        # Threads: run, ready/close, and one weight send per rollout replica (collective weight sync).
        threads = 2 + self.run_spec.roles.rollout.replica_limit
        launch = WorkerLaunch(spec=self.run_spec, base_dir=str(self.base_dir), model_path=self.model_path,
                              roles=slot.host.roles, holder=slot.holder, threads=slot.host.threads,
                              start_step=self.attempt_start,
                              resume_from=str(self.resume_from_path) if self.resume_from_path else None,
                              run_carrier=self.carrier, spec_hash=self.spec_hash, ranks=self._ranks(slot))
        slot.worker = ray.remote(RoleWorker).options(**slot.options, max_concurrency=threads).remote(launch, self.state)

    def _ranks(self, slot: Slot) -> dict[str, list[Any]]:
        """The ranks of each multi-process model role the worker hosts, with their bundles."""
        from relax.runtime.ranks import RankPlacement

        return {role: [RankPlacement(i.rank, dict(i.coords), self.placement.actor_options(i) if i.rank else {})
                       for i in instances] for role, instances in slot.host.ranks.items()}

    def _ready(self, slot: Slot, timeout_s: float) -> None:
        import ray

        slot.started(ray.get(slot.worker.ready.remote(), timeout=timeout_s))

    def _begin(self, slot: Slot, resumed: dict[str, int] | None) -> None:
        if slot.host.replica > 0:
            slot.task = slot.worker.serve.remote()
        else:
            slot.task = slot.worker.run.remote(self.attempt_start, resumed)

    # -- watching -------------------------------------------------------------------------------

    def _watch(self, start: int) -> None:
        names = report_names(self.run_spec)
        last_end = time.time()
        supervised = 0.0
        for step in range(start, self.run_spec.trainer.steps):
            while True:
                # Supervise at least every SUPERVISE_S, also while steps keep arriving.
                if time.monotonic() - supervised >= SUPERVISE_S:
                    self._supervise()
                    supervised = time.monotonic()
                reports = self._control(self.state.wait_reports.remote(step, names, SUPERVISE_S))
                if reports:
                    break
            # Every role reported the step: its rows and units can go (not earlier: a role restarted
            # in place re-reads the step it had not finished).
            self.bus.clear_soon(partition_of(step))
            self.state.forget.remote(partition_of(step), step)
            self._consumed += reports[Role.actor].get("samples", 0)
            self._counters = self._control(self.state.counters.remote())
            end = reports[Role.actor]["end_time"]
            row = step_row(step + 1, reports, end - last_end)
            row.update(self._fault_metrics(reports))
            last_end = end
            self.metrics.append(row)
            self.progress.update(row)
            self.telemetry.record_step(step, min(r["started_at"] for r in reports.values()), end,
                                       staleness=row["staleness/max"], tokens=reports[Role.rollout]["response_tokens"])
            self.step_metrics.export(row)

    def _fault_metrics(self, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
        counters = self._counters
        row = {"samples/produced": counters.produced, "samples/consumed": self._consumed,
               "samples/regenerated": counters.regenerated, "samples/dropped": counters.dropped,
               "samples/trained_hash": reports[Role.actor].get("samples_hash"),
               "rollout/replicas": sum(1 for s in self._slots  # started (ready), not leaving
                                       if Role.rollout in s.host.roles and s.ready_at and not s.draining),
               "rollout/units": reports[Role.rollout].get("units", 1),
               "rollout/step_replicas": reports[Role.rollout].get("replicas", 1),
               "faults/restarts": sum(self.restarts.values())}
        row.update({f"faults/{role}/restarts": n for role, n in self.restarts.items()})
        return row

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
        if status.stalled_s > self.faults.wait_timeout_s:
            raise RunFailed(f"nothing moved in the run for {status.stalled_s:.0f} s (fault_tolerance.wait_timeout_s) "
                            "while every worker looked alive; a role waits on something no one will provide")
        beats = self._control(self.state.health.remote())
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

    # -- failures -------------------------------------------------------------------------------

    def _policy(self, roles: list[str]) -> str:
        policies = [getattr(self.faults.roles, role).on_failure for role in roles]
        return next(p for p in POLICY_ORDER if p in policies)

    def _charge(self, roles: list[str], reason: str, action: str) -> None:
        """Count a recovery against each role's budget; past it, stop with a report."""
        from relax.telemetry import FAULT

        for role in roles:
            self.restarts[role] = self.restarts.get(role, 0) + 1
            budget = getattr(self.faults.roles, role).max_restarts
            if self.restarts[role] > budget:
                raise RunFailed(f"{role} failed {self.restarts[role]} times, past fault_tolerance.roles.{role}."
                                f"max_restarts={budget}; last failure: {reason}")
        event = {"at": time.time(), "roles": roles, "action": action, "reason": reason.splitlines()[0][:500]}
        self.events.append(event)
        with self.telemetry.span(FAULT, role="/".join(roles), action=action, reason=event["reason"],
                                 restarts=sum(self.restarts.values())):
            pass

    def _failed(self, slot: Slot, reason: str) -> None:
        policy = self._policy(slot.host.roles)
        if policy == "stop":
            raise RunFailed(f"{slot.holder} failed and its policy is stop (fault_tolerance.roles): {reason}")
        if policy == "resume":
            raise ResumeRun(slot.host.roles, f"{slot.holder} failed: {reason.splitlines()[0]}")
        self._charge(slot.host.roles, reason, "restart")
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
            self._ready(slot, timeout)
        except ray.exceptions.GetTimeoutError:
            ray.kill(slot.worker, no_restart=True)
            try:
                self._move(slot, timeout)
            except PlacementError as exc:
                raise RunFailed(f"{slot.holder} cannot be placed again after it failed ({reason.splitlines()[0]}): "
                                f"{exc}") from None
            self._launch(slot)
            self._ready(slot, timeout)
        self.events[-1]["node"] = slot.node
        print(f"relax run: {slot.holder} failed ({reason.splitlines()[0][:200]}); restarted in place on node "
              f"{str(slot.node)[:12]}" + (f", {regenerated} samples to generate again" if regenerated else ""),
              file=sys.stderr, flush=True)
        self._begin(slot, resumed)
        if slot.draining:  # it was leaving when it failed: it still is
            self._control(self.state.drain.remote(slot.holder))

    def _move(self, slot: Slot, timeout_s: float) -> None:
        """Give a worker a placement group of its own on whatever node has room."""
        from ray.util.placement_group import remove_placement_group

        if slot.group is not None:
            remove_placement_group(slot.group)
        slot.options, slot.group = self.placement.spare(slot.host.instance, slot.holder.replace("/", "-").replace(
            "#", "-"), timeout_s)

    # -- elastic rollout ----------------------------------------------------------------------

    def request_scale(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /scale``: queue the change for the watch loop and wait for it to be applied."""
        from relax.runtime.control import SCALE_TIMEOUT_S, ControlError

        replicas = request.get("rollout")
        if self.spec.roles.rollout.max_replicas is None:
            raise ControlError("this run's rollout is not elastic; set roles.rollout.max_replicas (separate mode) "
                               "to scale it mid-run")
        limit = self.spec.roles.rollout.replica_limit
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
        rollouts = [s for s in self._slots if Role.rollout in s.host.roles and not s.draining]
        item.before = len(rollouts)
        # Replicas that host only a rollout can leave, newest first; the one hosting the step loops stays.
        removable = sorted((s for s in rollouts if s.host.replica > 0), key=lambda s: -s.host.replica)
        try:
            if item.before - item.replicas > len(removable):
                raise ValueError(f"{item.before} replicas run and {len(removable)} of them can be removed (the "
                                 "first replica hosts the run's step loops); ask for at least "
                                 f"{item.before - len(removable)}")
            for _ in range(item.replicas - item.before):  # grow: each new replica syncs weights first
                first = rollouts[0].host
                slot = Slot(Host([Role.rollout], first.instance, first.threads, replica=self._next_replica), {})
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
        return [self._describe(s) for s in self._slots if Role.rollout in s.host.roles]

    @staticmethod
    def _describe(slot: Slot) -> dict[str, Any]:
        return {"holder": slot.holder, "roles": slot.host.roles, "node": slot.node, "pid": slot.pid,
                "draining": slot.draining, "ranks": slot.ranks}

    def status(self) -> dict[str, Any]:
        """``GET /status``: the workers, the rollout replicas, sample counters and faults so far."""
        return {"workers": [self._describe(s) for s in list(self._slots)], "replicas": self._replicas(),
                "counters": asdict(self._counters), "consumed": self._consumed, "restarts": dict(self.restarts),
                "events": list(self.events)}


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _cause(exc: BaseException) -> str:
    """A worker's failure as one readable text (Ray wraps the worker's own exception)."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return f"its process died ({type(exc).__name__})"
    cause = getattr(exc, "cause", None) or exc
    return str(cause).strip() or repr(cause)
