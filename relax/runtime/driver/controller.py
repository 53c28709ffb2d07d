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

The controller keeps the loop; its parts are objects of their own, each handed what it needs: the
``Fleet`` of one attempt owns its workers (``relax.runtime.driver.fleet``), the ``Supervisor`` holds
the fault policy as a pure function (``relax.runtime.driver.supervisor``), ``Recovery`` applies its
verdicts (``relax.runtime.driver.recovery``), the ``Scaler`` scales the rollout
(``relax.runtime.driver.scaler``), and an ``Attempt`` record (its number, start, cause and the
restart budget spent) is passed to each of them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax.plan.model import Plan
from relax.roles import Role
from relax.runtime.checkpoint import resume_checkpoint
from relax.runtime.driver.fleet import Fleet, FleetLaunch, StartFailed, alive_nodes
from relax.runtime.driver.recovery import Recovery
from relax.runtime.driver.scaler import Scaler
from relax.runtime.driver.supervisor import SUPERVISE_S, Attempt, Observation, ResumeRun, RunFailed, Supervisor
from relax.runtime.driver.trackers import Trackers
from relax.runtime.driver.truncation_hint import TruncationHint
from relax.runtime.metrics import MetricsLog, Progress, evaluations_for_row, mismatch_alarm, step_row
from relax.runtime.samples import SamplesLog
from relax.runtime.startup import InBackground, StartupClock
from relax.runtime.state.records import SampleCounters
from relax.runtime.state.run_state import partition_of
from relax.spec.models import RunSpec

if TYPE_CHECKING:
    from relax.bus import Bus
    from relax.runtime.driver.placement import Placement

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


class Controller:
    """Runs one run: deploys the workers of each attempt, joins their reports, supervises them, and
    stops them. Every part it hands work to is built here and passed what it needs."""

    def __init__(self, spec: RunSpec, plan: Plan, base_dir: Path, output_dir: Path, model_path: str,
                 start_step: int, resume_from: Path | None, stream: Any = None,
                 startup: StartupClock | None = None) -> None:
        from relax.telemetry import StepMetricsExporter, Telemetry

        self.spec, self.plan, self.base_dir, self.output_dir = spec, plan, base_dir, output_dir
        self.model_path = model_path
        self.settings = plan.settings
        self.startup = startup or StartupClock()
        """Where the start-up time goes (printed by ``relax run`` at the end, ``startup.json``)."""
        self.faults = plan.settings.fault_tolerance
        self.progress = Progress(plan.settings.steps, stream, plan.settings.mismatch)
        self.metrics = MetricsLog(output_dir, start_step if resume_from else None)
        self.samples = SamplesLog(output_dir, start_step if resume_from else None)
        """samples.jsonl: the rows the scorer picked at each sampled step (trainer.log_samples_every)."""
        self.truncation = TruncationHint(plan.settings.agent)
        """Says once when an agentic step's trajectories (nearly) all end truncated, and why."""
        self.trackers = Trackers()
        """The spec's ``logging:`` loggers (built in ``run``): every row of ``metrics`` reaches them."""
        self.attempt = Attempt(start_step=start_step, resume_from=resume_from)
        """The attempt running now (the next one after a resume), with the restart budget spent."""
        self.fleet: Fleet | None = None
        """The current attempt's workers (None before the first starts)."""
        self.events: list[dict[str, Any]] = []
        """Failures, recoveries and scaling, as ``GET /status`` shows them."""
        self.consumed = 0
        """Samples the actor trained in this attempt (``samples/consumed``)."""
        self.counters = SampleCounters()
        """The run state's sample counters at its last answer (``samples/produced`` ...)."""
        self.placement: Placement | None = None
        """The run's placement groups (made in ``run``)."""
        self.carrier: dict[str, str] = {}
        """The run span's trace carrier, handed to every worker (set in ``run``)."""
        self._bus_start: InBackground[Bus | None] | None = None
        """The bus starting in the background (made in ``run``)."""
        self.spec_hash = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]
        self.telemetry = Telemetry.from_spec(self.settings, output_dir, role="controller", spec_hash=self.spec_hash)
        self.step_metrics = StepMetricsExporter.from_spec(self.settings, spec_hash=self.spec_hash)
        self.supervisor = Supervisor(self.faults)
        self.recovery = Recovery(self.supervisor, self.telemetry, self.events)
        self.scaler = Scaler(plan, self.faults.restart_timeout_s, self.telemetry, self.events)

    # -- the run, and its resumes -------------------------------------------------------------

    def run(self) -> int:
        from relax.runtime.driver.control import ControlServer
        from relax.runtime.driver.placement import create_placement

        settings = self.settings
        control = None
        attempt = self.attempt
        status = "failed"  # what the loggers are told at the end
        try:
            # Before anything starts: a logger that cannot start stops the run at once.
            self.trackers = Trackers.from_spec(self.spec, self.output_dir,
                                               attempt.start_step if attempt.resume_from else 0)
        except Exception:
            self.telemetry.shutdown()
            self.step_metrics.shutdown()
            raise
        self._bus_start = self._start_bus()
        try:
            placing = time.time()
            self.placement = create_placement(self.plan)
            self.startup.part("placement", placing)
            control = ControlServer(self.output_dir, self.status, self.scaler.request)
            with self.telemetry.run_span(steps=settings.steps, start_step=attempt.start_step,
                                         mode=self.plan.mode) as run:
                self.carrier = run.carrier()
                while True:
                    try:
                        self._attempt(attempt)
                        status = "finished"
                        return 0
                    except ResumeRun as exc:
                        self.recovery.charge(attempt, exc.roles, exc.reason, "resume")
                        found = resume_checkpoint(self.output_dir)
                        start, resume_from = found if found is not None else (0, None)
                        attempt = self.attempt = attempt.resumed(start, resume_from, exc.reason)
                        self.metrics = MetricsLog(self.output_dir, start)
                        self.samples = SamplesLog(self.output_dir, start)
                        for partition in self.bus.partitions() if self.bus is not None else ():
                            self.bus.clear(partition)  # the next attempt starts from an empty bus
                        print(f"relax run: {exc.reason}; resuming from step {start}", flush=True)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the trackers record the run as killed
            status = "killed"
            raise
        finally:
            self.scaler.close()  # requests asked too late: say so instead of hanging up
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

    def _start_bus(self) -> InBackground[Bus | None]:
        """Start the bus in a background thread. It runs beside the placement groups and the workers
        (which wait for it in ``Bus.attach``) when Ray has the logical CPUs for both; otherwise it
        starts first, as its actors take logical CPUs the placement groups would reserve, and it
        refuses clearly when too few are free."""
        if not self.plan.bus:  # every step's rows are handed over in memory: no bus to start
            return InBackground(lambda: None, name="no-bus")
        from relax.bus import Bus

        beside = self._bus_fits_beside()
        starting: InBackground[Bus | None] = InBackground(
            lambda: Bus.start(node_resource=self.settings.bus_node_resource), name="bus-start", clock=self.startup,
            part="bus")
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
        return self._started_bus().result()

    def _close_bus(self) -> None:
        """Stop the bus once its start has ended (a start that failed left nothing to stop)."""
        if self._bus_start is None:  # run() stopped before it started the bus
            return
        try:
            bus = self._bus_start.result()
        except Exception:  # already reported by whoever needed the bus
            return
        if bus is not None:
            bus.close()

    def _attempt(self, attempt: Attempt) -> None:
        """Run ``attempt`` from its start (a checkpoint's step) to the end, recovering in-place
        failures."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from relax.runtime.state.ledger import RolloutLedger
        from relax.runtime.state.run_state import RunState, concurrency

        settings, start = self.settings, attempt.start_step
        ledger = RolloutLedger(settings.steps, settings.prompts_per_step, settings.samples_per_prompt,
                               self.plan.rollout_work.unit_prompts, start_step=start)
        # The control plane lives beside the driver: losing any other node must not take it along.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        state = ray.remote(RunState).options(  # it owns the staleness policy: the current bound
            num_cpus=0, max_concurrency=concurrency(len(self.plan.workers)), scheduling_strategy=here).remote(
            ledger, settings.staleness_policy(), self.metrics.evaluated_versions())
        assert self.placement is not None, "the placement is made in run()"
        fleet = self.fleet = Fleet(self.plan, self.placement, state, attempt, FleetLaunch(
            self.output_dir, self.model_path, self.carrier, self.spec_hash, self.faults.wait_timeout_s))
        self.consumed = 0
        try:
            launching = time.time()
            alive = alive_nodes()
            for slot in fleet.slots:
                if self.placement.node_of(slot.instance) not in alive:  # a node lost before a resume
                    fleet.move(slot, self.faults.restart_timeout_s)
                fleet.launch_worker(slot)
            self._all_ready(attempt, fleet)
            # built their plugins, loaded the model, published the first weights
            self.startup.part("workers", launching)
            self._started_bus().result()  # up, as the workers attached to it (re-raises a start that failed)
            fleet.record()
            self.startup.mark("launch")
            for slot in fleet.slots:
                fleet.begin(slot, resumed=None)
            self._watch(attempt, fleet)
            fleet.finish()
        finally:
            fleet.teardown()

    def _all_ready(self, attempt: Attempt, fleet: Fleet) -> None:
        """Wait until every worker has built its loops. A bus that failed to start (while the
        workers came up beside it) is raised at once: the workers would only wait for it in
        ``Bus.attach`` and then fail for the same reason. A worker that failed while starting is
        judged by the supervisor (it stops the run: it would fail the same way on every try)."""
        starting = self._started_bus()

        def bus_failed() -> None:
            if (failed := starting.failed) is not None:
                raise failed

        try:
            fleet.wait_ready(self.faults.wait_timeout_s, bus_failed)
        except StartFailed as failed:
            self.recovery.apply(self.supervisor.check(Observation(start_failures=[failed.failure]), attempt),
                                attempt, fleet)

    def _started_bus(self) -> InBackground[Bus | None]:
        assert self._bus_start is not None, "the bus is started in run()"
        return self._bus_start

    # -- watching -------------------------------------------------------------------------------

    def _supervise(self, attempt: Attempt, fleet: Fleet) -> None:
        """One pass over the workers: their ended tasks first (a restart takes a while, and a
        restarted worker is watched from its new start), then the run's stall time and the
        heartbeats, then any scale request."""
        self.recovery.apply(self.supervisor.check(Observation(ended=fleet.ended()), attempt), attempt, fleet)
        status = fleet.ask(fleet.state.status.remote())
        beats = fleet.ask(fleet.state.health.remote())
        health = Observation(stalled_s=status.stalled_s, beats=beats, watched=fleet.watched(), roles=fleet.roles(),
                             now=time.time())
        self.recovery.apply(self.supervisor.check(health, attempt), attempt, fleet)
        self.scaler.apply(fleet)

    def _watch(self, attempt: Attempt, fleet: Fleet) -> None:
        names = [name for worker in self.plan.workers for loop in worker.roles for name in loop.reports]
        last_end = time.time()
        supervised = asked = 0.0
        # Evaluations of versions newer than the row being written: the controller may lag the
        # workers (it was restarting one), so a step's reports can carry a later version's.
        early: list[dict[str, float]] = []
        step = attempt.start_step
        while step < self.settings.steps:
            # Supervise at least every SUPERVISE_S, also while steps keep arriving.
            if time.monotonic() - supervised >= SUPERVISE_S:
                self._supervise(attempt, fleet)
                supervised = time.monotonic()
            # Ask at most every WATCH_INTERVAL_S: steps shorter than that come several to an answer.
            time.sleep(max(0.0, asked + WATCH_INTERVAL_S - time.monotonic()))
            asked = time.monotonic()
            got = fleet.ask(fleet.state.wait_reports.remote(step, names, SUPERVISE_S))
            if got is None:
                continue
            # RunState forgot the steps' signals and units meanwhile
            self.counters = got.counters
            early += got.evals
            first = step
            for reports in got.reports:
                early, last_end = self._write_row(step, reports, early, last_end, attempt, fleet)
                step += 1
            # The steps' rows and units can go now (not earlier: a role restarted in place re-reads
            # the step it had not finished), all in one go.
            if self.bus is not None and step > first:
                self.bus.clear_soon([partition_of(s) for s in range(first, step)])

    def _write_row(self, step: int, reports: dict[str, dict[str, Any]], early: list[dict[str, float]],
                   last_end: float, attempt: Attempt, fleet: Fleet) -> tuple[list[dict[str, float]], float]:
        """Every role reported ``step``: its metrics row; returns the evaluations kept for later
        rows and the step's end."""
        evals, early = evaluations_for_row(early, step + 1)
        if step + 1 == self.settings.steps and self.settings.evaluation is not None \
                and not any(e["eval/version"] >= self.settings.steps for e in evals):
            evals += self._final_evaluation(attempt, fleet)
        self.consumed += reports[Role.actor].get("samples", 0)
        end = reports[Role.actor]["end_time"]
        row = step_row(step + 1, reports, end - last_end)
        row.update(self._fault_metrics(reports, attempt, fleet))
        for figures in evals:  # evaluations finished since the last row; the newest stays in the row
            self.metrics.append_eval(step + 1, figures)
            row.update(figures)
        self.metrics.append(row)
        self.trackers.log(row)
        samples = reports[Role.reward].get("sample_rows") or []
        if samples:  # a sampled step (trainer.log_samples_every)
            self.samples.append(samples)
            self.trackers.log_samples(step + 1, samples)
        self.startup.step_finished()
        self.progress.update(row)
        if samples:
            self.progress.sample(samples[0])
        hint = self.truncation.check(row)
        if hint is not None:
            self.progress.note(row["step"], f"HINT: {hint}")
        if self.settings.auto_staleness is not None:  # auto: the run state moves the bound of the next admissions
            fleet.state.judge_step.remote(row)
        self.telemetry.record_step(step, min(r["started_at"] for r in reports.values()), end,
                                   staleness=row["staleness/max"], staleness_bound=row["staleness/bound"],
                                   tokens=reports[Role.rollout]["response_tokens"])
        self.step_metrics.export(row)
        self._mismatch_stop(row)
        return early, end

    def _final_evaluation(self, attempt: Attempt, fleet: Fleet) -> list[dict[str, float]]:
        """Wait (supervising the workers) until the rollout posted its evaluation of the final
        policy version, which it starts once the actor published it (``RolloutLoop.finish``)."""
        steps, got = self.settings.steps, []
        while not any(e["eval/version"] >= steps for e in got):
            self._supervise(attempt, fleet)
            got += fleet.ask(fleet.state.wait_eval.remote(steps, SUPERVISE_S))
        return got

    def _mismatch_stop(self, row: dict[str, Any]) -> None:
        """With ``async_policy.mismatch.action: stop``, a step whose ``mismatch/kl`` is above the
        alarm ends the run (its row is written first)."""
        mismatch = self.settings.mismatch
        alarm = mismatch_alarm(row, mismatch)
        if alarm is not None and mismatch.action == "stop":
            raise RunFailed(f"step {row['step']}: {alarm}; async_policy.mismatch.action is stop. Raise kl_alarm, "
                            "set action: warn, or fix the mismatch (docs/off-policy.md)")

    def _fault_metrics(self, reports: dict[str, dict[str, Any]], attempt: Attempt, fleet: Fleet) -> dict[str, Any]:
        counters = self.counters
        row = {"samples/produced": counters.produced, "samples/consumed": self.consumed,
               "samples/regenerated": counters.regenerated, "samples/dropped": counters.dropped,
               "samples/trained_hash": reports[Role.actor].get("samples_hash"),
               "rollout/replicas": fleet.serving_replicas(),  # started (ready), not leaving
               "rollout/units": reports[Role.rollout].get("units", 1),
               "rollout/step_replicas": reports[Role.rollout].get("replicas", 1),
               "faults/restarts": attempt.recoveries}
        row.update({f"faults/{role}/restarts": n for role, n in attempt.restarts.items()})
        return row

    def status(self) -> dict[str, Any]:
        """``GET /status``: the workers, the rollout replicas, sample counters and faults so far."""
        fleet, attempt = self.fleet, self.attempt
        slots = list(fleet.slots) if fleet is not None else []
        return {"workers": [s.describe() for s in slots], "replicas": [s.describe() for s in slots if s.generates],
                "counters": asdict(self.counters), "consumed": self.consumed, "restarts": dict(attempt.restarts),
                "events": list(self.events)}
