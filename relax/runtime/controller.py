"""The controller: runs a run (its attempts and resumes) and joins the workers' step reports.

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

The controller's duties live in rooms of their own, joined in ``Controller``: deploying workers
(``relax.runtime.deploy``), supervising them and applying the fault policy
(``relax.runtime.supervision``), and scaling the rollout (``relax.runtime.elastic``).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax.plan.model import Plan
from relax.roles import Role
from relax.runtime.checkpoint import resume_checkpoint
from relax.runtime.deploy import Deployment, Slot, alive_nodes
from relax.runtime.elastic import Elastic, ScaleRequest
from relax.runtime.evaluation import evaluations_for_row
from relax.runtime.metrics import MetricsLog, Progress, mismatch_alarm, step_row
from relax.runtime.records import SampleCounters
from relax.runtime.run_state import partition_of
from relax.runtime.staleness import StalenessController
from relax.runtime.startup import InBackground, StartupClock
from relax.runtime.supervision import SUPERVISE_S, ResumeRun, RunFailed, Supervision, start_failure
from relax.runtime.trackers import Trackers
from relax.spec.models import RunSpec

if TYPE_CHECKING:
    from relax.bus import Bus
    from relax.runtime.placement import Placement

#: While the workers come up beside the bus, how often the driver checks that the bus started.
BUS_CHECK_S = 0.5

#: The controller asks ``RunState`` for finished steps at most this often. A call costs both
#: processes CPU (about 0.6 ms in ``RunState`` and as much in the driver on the 2-core box), and
#: steps of a tiny model end every 15-30 ms: asked once a step, the driver and the run state took
#: CPU from the workers on every step; now steps shorter than this come several to an answer, and a
#: metrics row is written at most this much later than its step ended (steps are timed where they
#: ran, so no figure changes). Each answer's steps also have their partitions cleared in one go.
WATCH_INTERVAL_S = 0.1


def bus_fits_beside(*, nodes: int, free_cpus: float, reserved_cpus: float, bus_cpus: float) -> bool:
    """Whether the bus may start beside the placement groups and the workers: its actors and the
    plan's bundles fit in Ray's free logical CPUs together. Only on a one-node Ray: on several nodes
    the bus's actors could take CPUs that a bundle pinned to their node needs."""
    return nodes == 1 and free_cpus >= reserved_cpus + bus_cpus


class Controller(Deployment, Supervision, Elastic):
    """Deploys the workers of one run, joins their reports, recovers failures and stops them."""

    def __init__(self, spec: RunSpec, plan: Plan, base_dir: Path, output_dir: Path, model_path: str,
                 start_step: int, resume_from: Path | None, stream: Any = None,
                 startup: StartupClock | None = None) -> None:
        self.spec, self.plan, self.base_dir, self.output_dir = spec, plan, base_dir, output_dir
        self.model_path = model_path
        self.start_step, self.resume_from = start_step, resume_from
        self.settings = plan.settings
        self.startup = startup or StartupClock()
        """Where the start-up time goes (printed by ``relax run`` at the end, ``startup.json``)."""
        self.faults = plan.settings.fault_tolerance
        self.progress = Progress(plan.settings.steps, stream, plan.settings.mismatch)
        self.metrics = MetricsLog(output_dir, start_step if resume_from else None)
        self.trackers = Trackers()
        """The spec's ``logging:`` loggers (built in ``run``): every row of ``metrics`` reaches them."""
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

        settings = self.settings
        spec_hash = hashlib.sha256(self.spec.model_dump_json().encode()).hexdigest()[:16]
        self.spec_hash = spec_hash
        self.telemetry = Telemetry.from_spec(settings, self.output_dir, role="controller", spec_hash=spec_hash)
        self.step_metrics = StepMetricsExporter.from_spec(settings, spec_hash=spec_hash)
        self.placement: Placement | None = None
        control = None
        start, resume_from = self.start_step, self.resume_from
        status = "failed"  # what the loggers are told at the end
        try:
            # Before anything starts: a logger that cannot start stops the run at once.
            self.trackers = Trackers.from_spec(self.spec, self.output_dir, start if resume_from else 0)
        except Exception:
            self.telemetry.shutdown()
            self.step_metrics.shutdown()
            raise
        self._bus_start = self._start_bus()
        try:
            placing = time.time()
            self.placement = create_placement(self.plan)
            self.startup.part("placement", placing)
            control = ControlServer(self.output_dir, self.status, self.request_scale)
            with self.telemetry.run_span(steps=settings.steps, start_step=start, mode=self.plan.mode) as run:
                self.carrier = run.carrier()
                while True:
                    try:
                        self._attempt(start, resume_from)
                        status = "finished"
                        return 0
                    except ResumeRun as exc:
                        self._charge(exc.roles, exc.reason, "resume")
                        found = resume_checkpoint(self.output_dir)
                        start, resume_from = found if found is not None else (0, None)
                        self.metrics = MetricsLog(self.output_dir, start)
                        for partition in self.bus.partitions() if self.bus is not None else ():
                            self.bus.clear(partition)  # the next attempt starts from an empty bus
                        print(f"relax run: {exc.reason}; resuming from step {start}", flush=True)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the trackers record the run as killed
            status = "killed"
            raise
        finally:
            late = list(self._joins)
            while not self.scale_requests.empty():  # asked too late: say so instead of hanging up
                late.append(self.scale_requests.get())
            for item in late:
                self._answer(item, {"error": "the run ended before the change could be applied"})
            self.progress.close()  # the live bar ends before any closing line is printed
            if control is not None:
                control.close()
            if self.placement is not None:
                self.placement.remove()
            self._close_bus()
            self.telemetry.shutdown()
            self.step_metrics.shutdown()
            self.trackers.close(status)

    # -- the bus ------------------------------------------------------------------------------------

    def _start_bus(self) -> InBackground[Bus]:
        """Start the bus in a background thread. It runs beside the placement groups and the workers
        (which wait for it in ``Bus.attach``) when Ray has the logical CPUs for both; otherwise it
        starts first, as its actors take logical CPUs the placement groups would reserve, and it
        refuses clearly when too few are free."""
        if not self.plan.bus:  # every step's rows are handed over in memory: no bus to start
            return InBackground(lambda: None, name="no-bus")
        from relax.bus import Bus

        beside = self._bus_fits_beside()
        starting = InBackground(lambda: Bus.start(node_resource=self.settings.bus_node_resource),
                                name="bus-start", clock=self.startup, part="bus")
        if not beside:
            starting.result()
        return starting

    def _bus_fits_beside(self) -> bool:
        import ray

        from relax.bus.deployment import logical_cpus

        return bus_fits_beside(nodes=sum(1 for n in ray.nodes() if n.get("Alive")),
                               free_cpus=ray.available_resources().get("CPU", 0.0),
                               reserved_cpus=sum(b.cpus for pool in self.plan.pools for b in pool.bundles),
                               bus_cpus=logical_cpus())

    @property
    def bus(self) -> Bus | None:
        """The run's bus (waits until it has started; raises why it could not); None when the plan
        moves nothing over it."""
        return self._bus_start.result()

    def _close_bus(self) -> None:
        """Stop the bus once its start has ended (a start that failed left nothing to stop)."""
        try:
            bus = self._bus_start.result()
        except Exception:  # already reported by whoever needed the bus
            return
        if bus is not None:
            bus.close()

    def _attempt(self, start: int, resume_from: Path | None) -> None:
        """Run from ``start`` (a checkpoint's step) to the end, recovering in-place failures."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from relax.runtime.ledger import RolloutLedger
        from relax.runtime.run_state import RunState, concurrency

        settings = self.settings
        ledger = RolloutLedger(settings.steps, settings.prompts_per_step, settings.samples_per_prompt,
                               self.plan.rollout_work.unit_prompts, start_step=start)
        # The control plane lives beside the driver: losing any other node must not take it along.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        auto = settings.auto_staleness
        self.staleness = None if auto is None else StalenessController(auto)
        self.state = ray.remote(RunState).options(
            num_cpus=0, max_concurrency=concurrency(len(self.plan.workers)), scheduling_strategy=here).remote(
            ledger, None if self.staleness is None else self.staleness.bound, self.metrics.evaluated_versions())
        self.attempt_start, self.resume_from_path = start, resume_from
        self._consumed = 0
        self._slots = [Slot(worker, self.placement.actor_options(worker.instance)) for worker in self.plan.workers]
        self._next_replica = max((s.replica for s in self._slots), default=0) + 1
        try:
            launching = time.time()
            alive = alive_nodes()
            for slot in self._slots:
                if self.placement.node_of(slot.instance) not in alive:  # a node lost before a resume
                    self._move(slot, self.faults.restart_timeout_s)
                self._launch(slot)
            self._all_ready(self._slots, self.faults.wait_timeout_s)
            self.startup.part("workers", launching)  # built their plugins, loaded the model, published the first weights
            self._bus_start.result()  # up, as the workers attached to it (re-raises a start that failed)
            self._record_workers()
            self.startup.mark("launch")
            for slot in self._slots:
                self._begin(slot, resumed=None)
            self._watch(start)
            self._finish()
        finally:
            self._teardown()

    def _all_ready(self, slots: list[Slot], timeout_s: float) -> None:
        """Wait until every worker has built its loops, each as soon as it is ready. A bus that
        failed to start (while the workers came up beside it) is raised at once: the workers would
        only wait for it in ``Bus.attach`` and then fail for the same reason."""
        import ray

        pending = {slot.worker.ready.remote(): slot for slot in slots}
        deadline = time.monotonic() + timeout_s
        while pending:
            if (failed := self._bus_start.failed) is not None:
                raise failed
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = ", ".join(slot.holder for slot in pending.values())
                raise ray.exceptions.GetTimeoutError(f"workers {waiting} were not ready after {timeout_s:g} s "
                                                     "(fault_tolerance.wait_timeout_s)")
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, BUS_CHECK_S))
            for ref in done:
                slot = pending.pop(ref)
                try:
                    info = ray.get(ref)
                except Exception as exc:  # its constructor failed: it would on every try (start_failure)
                    raise RunFailed(start_failure(slot.holder, exc)) from None
                slot.started(info)

    # -- watching -------------------------------------------------------------------------------

    def _watch(self, start: int) -> None:
        names = [name for worker in self.plan.workers for loop in worker.roles for name in loop.reports]
        last_end = time.time()
        supervised = asked = 0.0
        # Evaluations of versions newer than the row being written: the controller may lag the
        # workers (it was restarting one), so a step's reports can carry a later version's.
        early: list[dict[str, float]] = []
        step = start
        while step < self.settings.steps:
            # Supervise at least every SUPERVISE_S, also while steps keep arriving.
            if time.monotonic() - supervised >= SUPERVISE_S:
                self._supervise()
                supervised = time.monotonic()
            # Ask at most every WATCH_INTERVAL_S: steps shorter than that come several to an answer.
            time.sleep(max(0.0, asked + WATCH_INTERVAL_S - time.monotonic()))
            asked = time.monotonic()
            got = self._control(self.state.wait_reports.remote(step, names, SUPERVISE_S))
            if got is None:
                continue
            # RunState forgot the steps' signals and units meanwhile
            self._counters = got.counters
            early += got.evals
            first = step
            for reports in got.reports:
                early, last_end = self._write_row(step, reports, early, last_end)
                step += 1
            # The steps' rows and units can go now (not earlier: a role restarted in place re-reads
            # the step it had not finished), all in one go.
            if self.bus is not None and step > first:
                self.bus.clear_soon([partition_of(s) for s in range(first, step)])

    def _write_row(self, step: int, reports: dict[str, dict[str, Any]], early: list[dict[str, float]],
                   last_end: float) -> tuple[list[dict[str, float]], float]:
        """Every role reported ``step``: its metrics row; returns the evaluations kept for later
        rows and the step's end."""
        evals, early = evaluations_for_row(early, step + 1)
        if step + 1 == self.settings.steps and self.settings.evaluation is not None \
                and not any(e["eval/version"] >= self.settings.steps for e in evals):
            evals += self._final_evaluation()
        self._consumed += reports[Role.actor].get("samples", 0)
        end = reports[Role.actor]["end_time"]
        row = step_row(step + 1, reports, end - last_end)
        row.update(self._fault_metrics(reports))
        for figures in evals:  # evaluations finished since the last row; the newest stays in the row
            self.metrics.append_eval(step + 1, figures)
            row.update(figures)
        self.metrics.append(row)
        self.trackers.log(row)
        self.startup.step_finished()
        self.progress.update(row)
        if self.staleness is not None:  # max_staleness: auto chooses the bound of the next admissions
            bound = self.staleness.bound
            if self.staleness.update(row) != bound:
                self.state.set_bound.remote(self.staleness.bound)
        self.telemetry.record_step(step, min(r["started_at"] for r in reports.values()), end,
                                   staleness=row["staleness/max"], staleness_bound=row["staleness/bound"],
                                   tokens=reports[Role.rollout]["response_tokens"])
        self.step_metrics.export(row)
        self._mismatch_stop(row)
        return early, end

    def _final_evaluation(self) -> list[dict[str, float]]:
        """Wait (supervising the workers) until the rollout posted its evaluation of the final
        policy version, which it starts once the actor published it (``RolloutLoop.finish``)."""
        steps, got = self.settings.steps, []
        while not any(e["eval/version"] >= steps for e in got):
            self._supervise()
            got += self._control(self.state.wait_eval.remote(steps, SUPERVISE_S))
        return got

    def _mismatch_stop(self, row: dict[str, Any]) -> None:
        """With ``async_policy.mismatch.action: stop``, a step whose ``mismatch/kl`` is above the
        alarm ends the run (its row is written first)."""
        mismatch = self.settings.mismatch
        alarm = mismatch_alarm(row, mismatch)
        if alarm is not None and mismatch.action == "stop":
            raise RunFailed(f"step {row['step']}: {alarm}; async_policy.mismatch.action is stop. Raise kl_alarm, "
                            "set action: warn, or fix the mismatch (docs/off-policy.md)")

    def _fault_metrics(self, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
        counters = self._counters
        row = {"samples/produced": counters.produced, "samples/consumed": self._consumed,
               "samples/regenerated": counters.regenerated, "samples/dropped": counters.dropped,
               "samples/trained_hash": reports[Role.actor].get("samples_hash"),
               "rollout/replicas": sum(1 for s in self._slots  # started (ready), not leaving
                                       if s.generates and s.ready_at and not s.draining),
               "rollout/units": reports[Role.rollout].get("units", 1),
               "rollout/step_replicas": reports[Role.rollout].get("replicas", 1),
               "faults/restarts": sum(self.restarts.values())}
        row.update({f"faults/{role}/restarts": n for role, n in self.restarts.items()})
        return row
