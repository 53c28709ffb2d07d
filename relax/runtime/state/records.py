"""What the run-state actor (``relax.runtime.state.run_state.RunState``) answers: small typed records.

Ray pickles dataclasses as they are, so a caller reads attributes (``status.stopped``) instead of
keys of a ``dict[str, Any]``. A rollout unit (``Lease.unit``) stays the ledger's plain dict
(``step``, ``unit``, ``start``, ``stop``, ``attempt``: see ``relax.runtime.state.ledger``), and a role's
step stats stay a dict of numbers: ``relax.runtime.metrics.step_row`` reads them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunStatus:
    """Whether the run is stopped, and for how long nothing moved in it (no publish, signal,
    report or unit): a waiting role gives up only on a run that stands still."""

    stopped: bool
    stalled_s: float


@dataclass(frozen=True)
class PolicyVersion:
    """The newest published policy: its version and ``[ObjectRef]`` of its weights (empty when
    the weights travel another way, e.g. over a weight group)."""

    version: int
    weights: list[Any]


@dataclass(frozen=True)
class Lease:
    """The answer to a rollout replica asking for work: exactly one of a unit to generate, ``done``
    (nothing left for it) or ``drain`` (the replica is being removed)."""

    unit: dict[str, Any] | None = None
    done: bool = False
    drain: bool = False
    policy: PolicyVersion | None = None
    """With a unit: the newest policy when it was leased (admission already waited for it), so the
    rollout needs no further call to learn it."""
    bound: int | None = None
    """With a unit: the staleness bound it is admitted under (``max_staleness: auto`` moves it)."""


@dataclass(frozen=True)
class UnitInfo:
    """What a reader of a step needs: how many units make it, which attempt of each counts,
    whether any unit was retried (then orphan rows may be on the bus), and how many rows the
    acknowledged attempts put (a sample may be several rows: a trajectory's segments)."""

    units: int
    accepted: dict[int, int]
    retried: bool
    rows: int


@dataclass(frozen=True)
class UnitDone:
    """``RunState.complete``'s answer: whether the unit counts (False: its lease was revoked), and
    the step's unit stats once this unit completed the step (None while units are missing)."""

    accepted: bool
    step_stats: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class SampleCounters:
    """Samples of the run so far: generated and acknowledged, generated again after a failure,
    dropped as orphans; produced per replica."""

    produced: int = 0
    regenerated: int = 0
    dropped: int = 0
    by_holder: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepsReported:
    """What the controller's wait for reports returns: the reports of steps ``first``,
    ``first + 1``, ... (per step, per report name, its stats), and the run's sample counters and the
    evaluations posted since its last wait, as of the answer."""

    first: int
    reports: list[dict[str, dict[str, Any]]]
    counters: SampleCounters
    evals: list[dict[str, float]]


@dataclass(frozen=True)
class Beat:
    """A worker's last heartbeat: when, what it was doing, and since when it has been busy with it
    (None while it waits on others)."""

    at: float
    activity: str
    busy_since: float | None


@dataclass(frozen=True)
class StepReport:
    """One role loop's report of one step: its name (a role, or ``critic_values``) and its stats
    (times, counts, the trainer's metrics: the numbers ``relax.runtime.metrics.step_row`` joins)."""

    step: int
    name: str
    stats: dict[str, Any]


class RoleFailure(RuntimeError):
    """A role's failure as a worker raises it to the controller: the cause on the first line, the
    traceback after it. ``stops_run`` marks a failure that would repeat on any retry (a worker that
    cannot start, a reward plugin that breaks its contract or fails under ``on_error: fail``): the
    controller stops the run at once instead of spending the role's restart budget on it."""

    def __init__(self, message: str, stops_run: bool = False) -> None:
        super().__init__(message)
        self.stops_run = stops_run

    def __reduce__(self) -> tuple[Any, ...]:  # Ray pickles it to the driver: keep the flag
        return (RoleFailure, (self.args[0], self.stops_run))

    @property
    def headline(self) -> str:
        """The cause alone (its first line)."""
        return self.args[0].splitlines()[0] if self.args and self.args[0] else "unknown failure"
