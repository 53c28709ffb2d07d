"""What every role loop of a worker shares: the run's settings and this worker's wiring (both from
the plan), the bus, the run-state actor and its waits.

The data path is the bus only: the rollout writes a step's rows to partition ``step-<n>``, the
reward and advantage tasks add their columns, and the actor takes the finished rows. ``RunState``
only says when a column is ready and which policy version exists, so nobody polls: a role blocks in
``RoleEnv.wait_for`` (in slices, so a stopped or stalled run ends the wait) and reads with
``RoleEnv.take``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from relax.algo.staleness import StalenessPolicy
from relax.bus.records import BusBatch
from relax.contracts import PluginKind
from relax.plan.model import RoleWiring, RolloutWork, RunSettings, WorkerPlan
from relax.roles import Column, Role
from relax.runtime.state.health import Activity
from relax.runtime.state.records import Lease, PolicyVersion, RunStatus, StepReport, UnitInfo
from relax.runtime.state.run_state import partition_of
from relax.runtime.worker.ranks import RankPlacement, build_role_trainer
from relax.runtime.worker.rows import relayout, restack
from relax.telemetry import Telemetry

if TYPE_CHECKING:
    from relax.bus import Bus

#: Longest single wait on the control plane before re-checking whether the run was stopped.
WAIT_SLICE_S = 2.0


class RunStopped(Exception):
    """The run was stopped (by a failure elsewhere or by the user) while this role waited."""


class StalenessViolation(RuntimeError):
    """A batch holds samples older than ``async_policy.max_staleness`` allows: never trained."""


@dataclass
class RoleEnv:
    """What every loop of a run shares inside one worker process."""

    settings: RunSettings
    """The run-wide settings (``Plan.settings``)."""
    worker: WorkerPlan
    """This worker's wiring (``Plan.workers``): the loops it hosts, what each builds, reads and writes."""
    work: RolloutWork
    """How each step's rollout is cut into units (``Plan.rollout_work``)."""
    output_dir: Path
    bus: Bus | None
    """The bus; ``None`` only while the worker builds its loops (it attaches meanwhile)."""
    state: Any
    """The ``RunState`` actor handle."""
    timeout_s: float
    threads: int | None
    model_path: str
    """The model as a local folder (built-in models are materialized by the driver first)."""
    telemetry: Telemetry
    """This process's tracer: spans join the run's trace and parent to their step."""
    holder: str = "worker"
    """This worker's name in the run (heartbeats, rollout leases)."""
    activity: Activity = field(default_factory=Activity)
    """What this worker does right now, for its heartbeat."""
    ranks: dict[Role, list[RankPlacement]] = field(default_factory=dict)
    """The ranks of each model role hosted here that spans several processes (rank 0 first)."""
    leased_policy: PolicyVersion | None = None
    """The policy the last rollout lease carried (``lease``)."""
    bound: int | None = None
    """The staleness bound the last rollout lease was admitted under (``max_staleness: auto`` moves
    it); None before the first lease."""

    def staleness(self) -> StalenessPolicy:
        """The staleness policy a rollout generates its current unit under: the bound of the last
        lease (which the run state admitted it under), else the run's own."""
        return self.settings.staleness_policy() if self.bound is None else StalenessPolicy(self.bound)
    _lease_ahead: tuple[list[int], Any] | None = None
    """Leases asked ahead (``lease_ahead``): their steps and the pending call."""
    _granted: dict[int, Lease] = field(default_factory=dict)
    """Leases granted ahead of their step, by step."""
    carried_reports: list[StepReport] = field(default_factory=list)
    """Step reports that ride on this worker's next call to ``RunState`` that takes them instead of
    a call of their own (``RoleWorker.run``): a lease asked ahead, or a publish of weights."""

    def take_carried_reports(self) -> list[StepReport] | None:
        """The ``carried_reports`` for the call being made (None when there are none), now taken."""
        reports, self.carried_reports = self.carried_reports, []
        return reports or None

    def build_trainer(self, wiring: RoleWiring) -> Any:
        """A model role's backend as its wiring plans it (the trainer, and the actor's loss): in this
        process, or across its ranks (``relax.runtime.worker.ranks``)."""
        trainer = next(p for p in wiring.plugins if p.kind == PluginKind.trainer)
        loss = next((p for p in wiring.plugins if p.kind == PluginKind.losses), None)
        return build_role_trainer(trainer, loss, wiring.role, self.model_path, self.threads,
                                  self.ranks.get(wiring.role), self.timeout_s)

    def call(self, ref: Any) -> Any:
        """``ray.get`` of a call to ``RunState``, bounded (a lost control plane fails the role)."""
        return ray.get(ref, timeout=self.timeout_s)

    def wait_for(self, ask: Callable[[float], Any], what: str, activity: Activity | None = None) -> Any:
        """Block on a ``RunState`` wait in slices, failing clearly on stop, or once the whole run
        has stood still for ``fault_tolerance.wait_timeout_s`` (a role waits as long as the run
        moves: a slow producer upstream is not a failure, a dead or stuck one is).

        ``ask(slice_s)`` makes the call (``state.wait_ready.remote(..., slice_s)``); a falsy answer
        means the slice ran out. ``what`` names the wait in the heartbeat and in errors; a wait in a
        background thread gives an ``activity`` of its own (the heartbeat reports the main thread's)."""
        started = time.monotonic()
        with (activity or self.activity).waiting(what):
            while True:
                result = self.call(ask(WAIT_SLICE_S))
                if result:
                    return result
                status: RunStatus = self.call(self.state.status.remote())
                if status.stopped:
                    raise RunStopped(f"run stopped while waiting ({what})")
                if min(time.monotonic() - started, status.stalled_s) > self.timeout_s:
                    raise TimeoutError(f"waited {time.monotonic() - started:.0f} s for {what} while "
                                       f"nothing moved in the run for {status.stalled_s:.0f} s "
                                       "(fault_tolerance.wait_timeout_s); the role that should provide it is "
                                       "stuck or dead")

    def lease(self, only_step: int | None) -> Lease:
        """The next rollout unit for this worker (see ``RunState.lease``); the policy it carries is
        remembered for ``wait_version``. A lease asked ahead for this step (``lease_ahead``) is
        taken first: usually it is granted by now, and the rollout waits for nothing."""
        what = f"lease{(self.holder, only_step)}"
        ahead = self._lease_ahead
        if only_step not in self._granted and ahead is not None and only_step in ahead[0]:
            self._lease_ahead = None
            with self.activity.waiting(what):
                answer = self.call(ahead[1])
            for got in answer or ():
                self._granted[got.unit["step"] if got.unit is not None else only_step] = got
        got = self._granted.pop(only_step, None)
        if got is None:  # none asked ahead, or its wait ran out: ask until it is granted
            got = self.wait_for(lambda slice_s: self.state.lease.remote(self.holder, only_step, slice_s), what)
        self.leased_policy = got.policy
        if got.bound is not None:
            self.bound = got.bound
        return got

    def leased_ahead(self, step: int) -> bool:
        """Whether a lease for ``step`` was asked ahead (granted or on its way)."""
        return step in self._granted or (self._lease_ahead is not None and step in self._lease_ahead[0])

    def lease_ahead(self, steps: list[int], acknowledging: list[tuple[Any, ...]], admit: bool = False) -> None:
        """Ask now for the units of ``steps`` that the next ``lease`` calls take, so the answer
        travels while this worker does other work. A unit granted to a worker that then fails goes
        back to the ledger like any. ``acknowledging``: ``RunState.complete`` arguments not yet sent
        (without the holder), sent in the same call (``complete_and_lease``), with the
        ``carried_reports``. ``admit``: RunState holds the call until the staleness bound admits the
        first step, and the policy the lease carries is then new enough (``wait_version`` asks
        nothing)."""
        asked = self.state.complete_and_lease.remote(self.holder, acknowledging, steps, WAIT_SLICE_S,
                                                     self.take_carried_reports(), admit)
        self._lease_ahead = (steps, asked)

    def wait_version(self, min_version: int) -> PolicyVersion:
        """The newest published policy once it is at least ``min_version`` (the one the last lease
        carried, when new enough: no call)."""
        known = self.leased_policy
        if known is not None and known.version >= min_version:
            return known
        return self.wait_for(lambda t: self.state.wait_version.remote(min_version, t), f"wait_version({min_version},)")

    def wait_ready(self, step: int, columns: tuple[Column, ...], activity: Activity | None = None) -> UnitInfo:
        """Until every column of ``columns`` is announced for every row of the step; then how the
        step's rows were made (``RunState.wait_ready``: one call for both)."""
        fields = [str(c) for c in columns]
        return self.wait_for(lambda t: self.state.wait_ready.remote(step, fields, t),
                             f"wait_ready{(partition_of(step), *fields)}", activity)

    def bus_task(self, step: int, done: dict[int, dict[str, Any]], after: Column | tuple[Column, ...],
                 fields: tuple[Column, ...], task: str, work: Any) -> dict[str, Any]:
        """One step of a task that reads rows from the bus, unless a co-hosted loop already did the
        step in memory (its stats wait in ``done``). ``work(step, batch)`` computes and writes; the
        time outside it is bus time."""
        if step not in done:
            started = time.perf_counter()
            work(step, self.take(step, after, fields, task))
            computed = sum(v for k, v in done[step].items() if k.endswith("_s") and k != "bus_s")
            done[step]["bus_s"] = time.perf_counter() - started - computed
        return done.pop(step)

    def take(self, step: int, after: Column | tuple[Column, ...], fields: tuple[Column, ...], task: str,
             activity: Activity | None = None) -> BusBatch:
        """This task's rows of a step, once every column in ``after`` has been announced for them:
        exactly the rows of the acknowledged rollout attempts (orphans of a failed replica are
        skipped and counted as dropped), in sample order, token columns in one layout. A take in a
        background thread (reading ahead) passes an ``activity`` of its own."""
        partition = partition_of(step)
        activity = activity or self.activity
        info = self.wait_ready(step, (after,) if isinstance(after, str) else tuple(after), activity)
        mixed = info.units > 1
        with activity.busy(f"{task} reads step {step}"):
            if not info.retried:
                batch = self.bus.get(partition, list(fields), task=task, batch_size=info.rows,
                                     timeout_s=self.timeout_s)
                keep = list(range(len(batch)))
            else:  # a replica failed during this step: its unacknowledged rows may be here too
                ready = self.bus.counts(partition, task=task, fields=fields).ready
                batch = self.bus.get(partition, list(fields), task=task, batch_size=max(ready, info.rows),
                                     timeout_s=self.timeout_s)
                keep, orphans = accepted_rows(batch.meta, info.accepted)
                for (unit, attempt), rows in orphans.items():
                    self.state.drop.remote(step, unit, attempt, rows)
                if len(keep) != info.rows:
                    raise RuntimeError(f"step {step} has {len(keep)} acknowledged rows for {task}, expected "
                                       f"{info.rows}; the bus and the rollout ledger disagree")
            order = sorted(keep, key=lambda i: sample_key(batch.meta[i]))
            if order != list(range(len(batch))):
                batch = batch.select(order)
            if info.retried:
                batch = restack(batch, keep_ragged=mixed)
            return relayout(batch) if mixed else batch

    def announce(self, step: int, *columns: Column) -> None:
        """Tell waiting roles that ``columns`` of a step are on the bus (ordered after the writes
        of this process, so nothing needs to be awaited)."""
        for column in columns:
            self.state.announce.remote(partition_of(step), column)


def sample_key(meta: Any) -> tuple[int, int, int]:
    """Where a row sits in its step: (its prompt's position, its sample of that prompt, its segment
    of that sample: a trajectory's segments are rows of one sample)."""
    return int(meta.extra["group"]), int(meta.extra.get("sample", 0)), int(meta.extra.get("segment", 0))


def accepted_rows(meta: list[Any], accepted: dict[int, int]) -> tuple[list[int], dict[tuple[int, int], int]]:
    """Positions of the rows of acknowledged attempts, and the orphan rows per (unit, attempt)."""
    keep, orphans = [], {}
    for i, m in enumerate(meta):
        key = int(m.extra.get("unit", 0)), int(m.extra.get("attempt", 1))
        if accepted.get(key[0]) == key[1]:
            keep.append(i)
        else:
            orphans[key] = orphans.get(key, 0) + 1
    return keep, orphans


def group_ids(meta: list[Any]) -> torch.Tensor:
    """The group of each row (the index of the prompt it answers), from the rows' metadata."""
    return torch.tensor([int(m.extra["group"]) for m in meta], dtype=torch.long)

