"""What the driver hands a role worker it starts (``WorkerLaunch``), with the ranks of its
multi-process model roles (``RankPlacement``): the message between the driver's ``Fleet`` and
the worker's ``RoleWorker``, so it belongs to neither room.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax.plan.model import RolloutWork, RunSettings, WorkerPlan
from relax.roles import Role


@dataclass
class RankPlacement:
    """One rank of a multi-process model role: its plan coordinates and Ray actor options."""

    rank: int
    coords: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)
    """``.options(...)`` for its Ray actor (its planned bundle); empty for rank 0, which is the
    worker hosting the role's loops."""

    @property
    def leads_data_shard(self) -> bool:
        """The rank whose results stand for its data-parallel group (the first stage of pipeline,
        the first shard of tensor and context parallelism)."""
        return all(self.coords.get(key, 0) == 0 for key in ("tp", "cp", "pp"))



@dataclass
class WorkerLaunch:
    """Everything one worker is built from (with the ``RunState`` handle, passed beside it): its
    part of the plan and where this attempt of the run stands."""

    worker: WorkerPlan
    """Its wiring (``Plan.workers``): the role loops it hosts, their plugins, columns and channels."""
    settings: RunSettings
    """The run-wide settings (``Plan.settings``)."""
    work: RolloutWork
    """How each step's rollout is cut into units (``Plan.rollout_work``)."""
    output_dir: str
    """The run folder (``settings.output_dir`` resolved by the driver)."""
    model_path: str
    """The model as a local folder (built-in models are materialized by the driver first)."""
    start_step: int = 0
    """The step this attempt of the run starts from (a checkpoint's after a resume)."""
    resume_from: str | None = None
    """The checkpoint folder it loads its state from, if any."""
    run_carrier: dict[str, str] = field(default_factory=dict)
    """The run span's trace context: this process's spans join the run's trace."""
    spec_hash: str = ""
    """The spec's hash, on every span and metric."""
    ranks: dict[Role, list[RankPlacement]] = field(default_factory=dict)
    """The ranks of each multi-process model role it hosts, with their bundles (rank 0 first)."""
    holder: str = ""
    """Its name in the run; the planned worker's unless it is an extra rollout replica."""
    bus: bool = True
    """Whether the run moves rows over the bus (``Plan.bus``); a colocated run that hands every step
    over in memory starts none, and its worker neither attaches nor imports TransferQueue."""

    @property
    def name(self) -> str:
        return self.holder or self.worker.holder
