"""The workers of one attempt of a run: one ``Slot`` per worker (its Ray actor, its bundle, its
ranks, where it runs), and the ``Fleet`` that launches them on their planned bundles (or spare
ones), waits until they are ready, starts their tasks, reads what ended, and tears them down.

The fleet also holds the attempt's ``RunState`` handle: its workers report to it, and a call to
it that fails is the control plane's failure (the run resumes). It decides nothing about
failures: it reads them from Ray into ``Ended`` and ``StartFailure`` records for the
``Supervisor``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax.plan.model import Plan, RoleInstance, WorkerPlan
from relax.roles import EVALUATION, Role
from relax.runtime.driver.supervisor import Attempt, Ended, ResumeRun, StartFailure
from relax.runtime.state.records import RoleFailure

if TYPE_CHECKING:
    from relax.runtime.driver.placement import Placement

#: While the workers come up (beside the bus), how often ``Fleet.wait_ready`` looks at something
#: else: whether the bus started.
READY_CHECK_S = 0.5


@dataclass
class Slot:
    """One worker of the run: what it hosts, where it goes, and its current Ray actor."""

    wiring: WorkerPlan
    """The worker as the plan lays it out (an extra rollout replica: the plan's replica worker)."""
    options: dict[str, Any]
    worker: Any = None
    task: Any = None
    """The ObjectRef of its ``run``/``serve`` call."""
    node: str | None = None
    pid: int | None = None
    ready_at: float = 0.0
    ranks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The other ranks of its multi-process model roles: rank, pid, node, GPU ids."""
    shares_policy_model: bool = False
    """Its rollout generates with its actor's own model (colocate: ``share_policy_model``)."""
    rollout_engines: list[dict[str, Any]] = field(default_factory=list)
    """Colocation across ranks: the rollout engine in each actor rank's process (rank, pid, backend)."""
    group: Any = None
    """A placement group of its own (a replica added by scaling, or re-placed after a node loss)."""
    draining: bool = False
    placement_group: str | None = None
    """The id of the placement group Ray runs it in, as the worker itself reports it."""

    @property
    def holder(self) -> str:
        return self.wiring.holder

    @property
    def roles(self) -> list[Role]:
        return [Role(r) for r in self.wiring.role_names]

    @property
    def replica(self) -> int:
        return self.wiring.replica

    @property
    def evaluates(self) -> bool:
        """The evaluation worker (``trainer.eval.host: own``): a rollout engine that takes no
        rollout work."""
        return any(loop.task == EVALUATION for loop in self.wiring.roles)

    @property
    def generates(self) -> bool:
        """A rollout replica that generates the run's samples (the planned ones and those scaling
        added)."""
        return Role.rollout in self.roles and not self.evaluates

    @property
    def instance(self) -> RoleInstance:
        return self.wiring.instance

    def started(self, info: dict[str, Any]) -> None:
        """The worker answered ``ready``: where it runs, and since when it is watched."""
        self.node, self.pid, self.ready_at = info["node"], info["pid"], time.time()
        self.placement_group = info.get("placement_group")
        self.ranks = info.get("ranks", {})
        self.shares_policy_model = bool(info.get("shares_policy_model"))
        self.rollout_engines = list(info.get("rollout_engines", []))

    def describe(self) -> dict[str, Any]:
        """The worker as ``GET /status`` shows it."""
        return {"holder": self.holder, "roles": self.roles, "node": self.node, "pid": self.pid,
                "draining": self.draining, "ranks": self.ranks}


@dataclass(frozen=True)
class FleetLaunch:
    """What every worker of a run is launched with, besides its own wiring and the attempt."""

    output_dir: Path
    model_path: str
    carrier: Any
    """The run span's trace carrier: the workers' spans join the run's trace."""
    spec_hash: str
    wait_timeout_s: float
    """``fault_tolerance.wait_timeout_s``: how long a call to ``RunState`` may take."""


class StartFailed(Exception):
    """A worker failed while starting (not a timeout): ``failure`` says which and why."""

    def __init__(self, failure: StartFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


class Fleet:
    """The workers of one attempt, the placement they run in, and the ``RunState`` they report to."""

    def __init__(self, plan: Plan, placement: Placement, state: Any, attempt: Attempt, launch: FleetLaunch) -> None:
        self.plan, self.placement, self.state, self.attempt, self.launch = plan, placement, state, attempt, launch
        self.slots = [Slot(worker, placement.actor_options(worker.instance)) for worker in plan.workers]
        self.next_replica = max((s.replica for s in self.slots), default=0) + 1
        """The number of the next rollout replica scaling adds."""

    # -- the run state ------------------------------------------------------------------------------

    def ask(self, ref: Any) -> Any:
        """The answer of a call to ``RunState``; its loss is the controller role's failure (resume
        the run)."""
        import ray

        try:
            return ray.get(ref, timeout=self.launch.wait_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise ResumeRun(["controller"], f"the run's control plane failed: {type(exc).__name__}") from None

    # -- starting workers ---------------------------------------------------------------------------

    def slot(self, holder: str) -> Slot:
        return next(s for s in self.slots if s.holder == holder)

    def launch_worker(self, slot: Slot) -> None:
        """Create the worker's Ray actor (its constructor builds its loops while the caller goes on)."""
        import ray

        from relax.runtime.worker.workers import RoleWorker  # the worker process's entry class: what Ray starts
        from relax.runtime.worker_launch import WorkerLaunch

        # Threads: run, ready/close, and one weight send per rollout replica (collective weight sync).
        threads = 2 + self.plan.rollout_work.replica_limit
        attempt, launch = self.attempt, self.launch
        spec = WorkerLaunch(worker=slot.wiring, settings=self.plan.settings, work=self.plan.rollout_work,
                            output_dir=str(launch.output_dir), model_path=launch.model_path,
                            start_step=attempt.start_step,
                            resume_from=str(attempt.resume_from) if attempt.resume_from else None,
                            run_carrier=launch.carrier, spec_hash=launch.spec_hash, ranks=self._ranks(slot),
                            bus=bool(self.plan.bus))
        slot.worker = ray.remote(RoleWorker).options(**slot.options, max_concurrency=threads).remote(spec, self.state)

    def _ranks(self, slot: Slot) -> dict[str, list[Any]]:
        """The ranks of each multi-process model role the worker hosts, with their bundles."""
        from relax.runtime.worker_launch import RankPlacement

        return {Role(role): [RankPlacement(i.rank, dict(i.coords), self.placement.actor_options(i) if i.rank else {})
                             for i in self.plan.instances_of(role) if i.rank in ranks]
                for role, ranks in slot.wiring.ranks.items()}

    def start(self, slot: Slot, timeout_s: float) -> None:
        """Wait until a (re)started worker is ready. One that failed while starting raises
        ``StartFailed``; a timeout (``ray.exceptions.GetTimeoutError``) is left to the caller."""
        import ray

        try:
            slot.started(ray.get(slot.worker.ready.remote(), timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise
        except Exception as exc:
            raise StartFailed(StartFailure(slot.holder, start_failure(slot.holder, exc))) from None

    def wait_ready(self, timeout_s: float, meanwhile: Callable[[], None]) -> None:
        """Wait until every worker has built its loops, each as soon as it is ready, calling
        ``meanwhile`` every ``READY_CHECK_S`` (it raises what should stop the wait: a bus that
        failed to start). Raises ``StartFailed`` for the first worker that failed while starting."""
        import ray

        pending = {slot.worker.ready.remote(): slot for slot in self.slots}
        deadline = time.monotonic() + timeout_s
        while pending:
            meanwhile()
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = ", ".join(slot.holder for slot in pending.values())
                raise ray.exceptions.GetTimeoutError(f"workers {waiting} were not ready after {timeout_s:g} s "
                                                     "(fault_tolerance.wait_timeout_s)")
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, READY_CHECK_S))
            for ref in done:
                slot = pending.pop(ref)
                try:
                    info = ray.get(ref)
                except Exception as exc:  # its constructor failed: it would on every try
                    raise StartFailed(StartFailure(slot.holder, start_failure(slot.holder, exc))) from None
                slot.started(info)

    def begin(self, slot: Slot, resumed: dict[str, int] | None) -> None:
        """Start the worker's task: the step loops, an extra replica's serving, or evaluating."""
        if slot.evaluates:
            slot.task = slot.worker.evaluate.remote()
        elif slot.replica > 0:
            slot.task = slot.worker.serve.remote()
        else:
            slot.task = slot.worker.run.remote(self.attempt.start_step, resumed)

    def move(self, slot: Slot, timeout_s: float) -> None:
        """Give a worker a placement group of its own on whatever node has room."""
        from ray.util.placement_group import remove_placement_group

        if slot.group is not None:
            remove_placement_group(slot.group)
        slot.options, slot.group = self.placement.spare(slot.instance, slot.holder.replace("/", "-").replace(
            "#", "-"), timeout_s)

    def add_replica(self) -> Slot:
        """A new rollout replica's slot (``relax scale``), not yet placed or launched; from now on
        teardown finds it."""
        n = self.next_replica
        slot = Slot(self.plan.rollout_replica.model_copy(update={"replica": n, "holder": f"rollout#{n}"}), {})
        self.next_replica += 1
        self.slots.append(slot)
        return slot

    # -- watching -----------------------------------------------------------------------------------

    def ended(self) -> list[Ended]:
        """The workers whose task ended since the last look, read from Ray. A task that returned is
        forgotten here (``slot.task`` is None); a failed one is left for its recovery."""
        import ray

        live = [slot for slot in self.slots if slot.task is not None]
        if not live:
            return []
        done, _ = ray.wait([slot.task for slot in live], num_returns=len(live), timeout=0)
        ended = []
        for slot in [s for s in live if s.task in done]:
            roles = tuple(str(r) for r in slot.roles)
            try:
                result = ray.get(slot.task)
            except Exception as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, RoleFailure) and cause.stops_run:
                    ended.append(Ended(slot.holder, roles, error=cause.headline, repeats=True))
                else:
                    ended.append(Ended(slot.holder, roles, error=worker_failure(exc) + self._last_activity(slot, exc)))
                continue
            slot.task = None
            ended.append(Ended(slot.holder, roles, stopped=bool(result.get("stopped")), draining=slot.draining))
        return ended

    def _last_activity(self, slot: Slot, exc: BaseException) -> str:
        """For a worker whose process died (nothing of its own says why): what its last heartbeat
        said it was busy with, e.g. the reward plugin that called ``os._exit`` (reward work is
        announced before it starts, ``Activity.busy(announce=True)``); empty otherwise."""
        import ray

        if not isinstance(exc, ray.exceptions.RayActorError):
            return ""
        beat = self.ask(self.state.health.remote()).get(slot.holder)
        if beat is None or beat.busy_since is None:
            return ""
        return f" while busy with {beat.activity}"

    def watched(self) -> dict[str, float]:
        """The workers whose task runs: holder -> when it became ready."""
        return {slot.holder: slot.ready_at for slot in self.slots if slot.task is not None}

    def roles(self) -> dict[str, tuple[str, ...]]:
        return {slot.holder: tuple(str(r) for r in slot.roles) for slot in self.slots}

    def finish(self) -> None:
        """Every step is reported: wait for the workers' tasks to end (replicas see no more work)."""
        import ray

        tasks = [slot.task for slot in self.slots if slot.task is not None]
        done, _ = ray.wait(tasks, num_returns=len(tasks), timeout=self.launch.wait_timeout_s)
        for ref in done:
            ray.get(ref)

    def replicas(self) -> list[dict[str, Any]]:
        """The rollout replicas that generate, as ``GET /status`` shows them."""
        return [s.describe() for s in self.slots if s.generates]

    def serving_replicas(self) -> int:
        """Rollout replicas started (ready) and not leaving (``rollout/replicas``)."""
        return sum(1 for s in self.slots if s.generates and s.ready_at and not s.draining)

    def record(self) -> None:
        """Write ``workers.json`` into the run folder: every worker started, where the plan put it
        (pool, bundle, node) and where it runs as it reports itself (Ray node and placement group),
        so anyone can check a run against its ``plan.json``."""
        groups = {group.id.hex(): name for name, group in self.placement.groups.items()}
        rows = [{"holder": slot.holder, "roles": [str(r) for r in slot.roles], "pool": slot.instance.pool,
                 "bundle": slot.instance.bundles[0], "node": slot.instance.node,
                 "ray_node": slot.node, "pid": slot.pid, "placement_group": slot.placement_group,
                 "placement_group_pool": groups.get(slot.placement_group or ""),
                 "moved": slot.group is not None, "shares_policy_model": slot.shares_policy_model,
                 "ranks": {role: [{"rank": r["rank"], "ray_node": r["node"], "gpus": r["gpus"], "pid": r["pid"]}
                                  for r in ranks] for role, ranks in slot.ranks.items()},
                 "rollout_engines": slot.rollout_engines}
                for slot in self.slots]
        (self.launch.output_dir / "workers.json").write_text(json.dumps(rows, indent=1) + "\n")

    # -- stopping -----------------------------------------------------------------------------------

    def drop(self, slot: Slot) -> None:
        """Kill the worker and free the placement group of its own, if it has one."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if slot.worker is not None:
            ray.kill(slot.worker, no_restart=True)
            slot.worker = None
        if slot.group is not None:
            remove_placement_group(slot.group)
            slot.group = None

    def remove(self, slot: Slot) -> None:
        """Drop the worker and forget its slot."""
        self.drop(slot)
        self.slots.remove(slot)

    def teardown(self) -> None:
        """Stop the run state, close the ready workers, kill every worker and the run state."""
        import ray

        try:
            ray.get(self.state.stop.remote(), timeout=5)
        except Exception:  # the control plane itself failed
            pass
        # Only a worker that was ready has a close() to run: one still in its constructor (the run
        # failed while the workers came up) would answer after it, so it is only killed.
        live = [slot.worker for slot in self.slots if slot.worker is not None and slot.ready_at]
        ray.wait([w.close.remote() for w in live], num_returns=len(live), timeout=10)  # a frozen one never answers
        for slot in self.slots:
            self.drop(slot)
        ray.kill(self.state)


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


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
    first = text.splitlines()[0] if text else ""
    return f"worker {holder} failed while starting: {type(cause or exc).__name__}: {first}"


def worker_failure(exc: BaseException) -> str:
    """A worker's failure as one readable text (Ray wraps the worker's own exception)."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return f"its process died ({type(exc).__name__})"
    cause = getattr(exc, "cause", None) or exc
    return str(cause).strip() or repr(cause)
