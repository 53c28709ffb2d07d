"""Deploying a run's workers: one ``Slot`` per worker, launching it on its planned bundle (or a
spare one), waiting until it is ready, starting its task, and tearing everything down.

``Deployment`` is a part of ``relax.runtime.controller.Controller`` (a mixin): it reads the
controller's ``run_spec``, ``plan``, ``placement``, ``state`` (the ``RunState`` handle), ``carrier``,
``spec_hash``, ``attempt_start``, ``resume_from_path`` and ``_slots``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from relax.runtime.hosts import Host


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




class Deployment:
    """Starting, placing and stopping the controller's workers."""

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

    def _move(self, slot: Slot, timeout_s: float) -> None:
        """Give a worker a placement group of its own on whatever node has room."""
        from ray.util.placement_group import remove_placement_group

        if slot.group is not None:
            remove_placement_group(slot.group)
        slot.options, slot.group = self.placement.spare(slot.host.instance, slot.holder.replace("/", "-").replace(
            "#", "-"), timeout_s)


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

