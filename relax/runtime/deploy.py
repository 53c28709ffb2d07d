"""Deploying a run's workers: one ``Slot`` per worker, launching it on its planned bundle (or a
spare one), waiting until it is ready, starting its task, and tearing everything down.

``Deployment`` is a part of ``relax.runtime.controller.Controller`` (a mixin): it reads the
controller's ``plan``, ``output_dir``, ``model_path``, ``placement``, ``state`` (the ``RunState`` handle), ``carrier``,
``spec_hash``, ``attempt_start``, ``resume_from_path`` and ``_slots``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from relax.plan.model import RoleInstance, WorkerPlan
from relax.roles import EVALUATION, Role


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
    group: Any = None
    """A placement group of its own (a replica added by scaling, or re-placed after a node loss)."""
    draining: bool = False

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

    placement_group: str | None = None
    """The id of the placement group Ray runs it in, as the worker itself reports it."""

    def started(self, info: dict[str, Any]) -> None:
        """The worker answered ``ready``: where it runs, and since when it is watched."""
        self.node, self.pid, self.ready_at = info["node"], info["pid"], time.time()
        self.placement_group = info.get("placement_group")
        self.ranks = info.get("ranks", {})
        self.shares_policy_model = bool(info.get("shares_policy_model"))




class Deployment:
    """Starting, placing and stopping the controller's workers."""

    def _teardown(self) -> None:
        import ray

        try:
            ray.get(self.state.stop.remote(), timeout=5)
        except Exception:  # the control plane itself failed
            pass
        # Only a worker that was ready has a close() to run: one still in its constructor (the run
        # failed while the workers came up) would answer after it, so it is only killed.
        live = [slot.worker for slot in self._slots if slot.worker is not None and slot.ready_at]
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
        threads = 2 + self.plan.rollout_work.replica_limit
        launch = WorkerLaunch(worker=slot.wiring, settings=self.plan.settings, work=self.plan.rollout_work,
                              output_dir=str(self.output_dir), model_path=self.model_path,
                              start_step=self.attempt_start,
                              resume_from=str(self.resume_from_path) if self.resume_from_path else None,
                              run_carrier=self.carrier, spec_hash=self.spec_hash, ranks=self._ranks(slot),
                              bus=bool(self.plan.bus))
        slot.worker = ray.remote(RoleWorker).options(**slot.options, max_concurrency=threads).remote(launch, self.state)

    def _ranks(self, slot: Slot) -> dict[str, list[Any]]:
        """The ranks of each multi-process model role the worker hosts, with their bundles."""
        from relax.runtime.ranks import RankPlacement

        return {Role(role): [RankPlacement(i.rank, dict(i.coords), self.placement.actor_options(i) if i.rank else {})
                             for i in self.plan.instances_of(role) if i.rank in ranks]
                for role, ranks in slot.wiring.ranks.items()}

    def _ready(self, slot: Slot, timeout_s: float) -> None:
        import ray

        slot.started(ray.get(slot.worker.ready.remote(), timeout=timeout_s))

    def _record_workers(self) -> None:
        """Write ``workers.json`` into the run folder: every worker started, where the plan put it
        (pool, bundle, node) and where it runs as it reports itself (Ray node and placement group),
        so anyone can check a run against its ``plan.json``."""
        groups = {group.id.hex(): name for name, group in self.placement.groups.items()}
        rows = [{"holder": slot.holder, "roles": [str(r) for r in slot.roles], "pool": slot.instance.pool,
                 "bundle": slot.instance.bundles[0], "node": slot.instance.node,
                 "ray_node": slot.node, "pid": slot.pid, "placement_group": slot.placement_group,
                 "placement_group_pool": groups.get(slot.placement_group or ""),
                 "moved": slot.group is not None, "shares_policy_model": slot.shares_policy_model,
                 "ranks": {role: [{"rank": r["rank"], "ray_node": r["node"], "gpus": r["gpus"]} for r in ranks]
                           for role, ranks in slot.ranks.items()}}
                for slot in self._slots]
        (self.output_dir / "workers.json").write_text(json.dumps(rows, indent=1) + "\n")

    def _begin(self, slot: Slot, resumed: dict[str, int] | None) -> None:
        if slot.evaluates:
            slot.task = slot.worker.evaluate.remote()
        elif slot.replica > 0:
            slot.task = slot.worker.serve.remote()
        else:
            slot.task = slot.worker.run.remote(self.attempt_start, resumed)

    def _move(self, slot: Slot, timeout_s: float) -> None:
        """Give a worker a placement group of its own on whatever node has room."""
        from ray.util.placement_group import remove_placement_group

        if slot.group is not None:
            remove_placement_group(slot.group)
        slot.options, slot.group = self.placement.spare(slot.instance, slot.holder.replace("/", "-").replace(
            "#", "-"), timeout_s)


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

