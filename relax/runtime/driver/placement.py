"""Ray placement groups built from a ``Plan``, never re-derived from the spec.

Each plan pool becomes one placement group. Every bundle is pinned to its planned node with a
``ray.io/node-id`` label selector: plan node i is the i-th alive node that has GPUs (or, on a CPU
plan, the driver's node). Bundles are created in plan order on each node, which makes Ray hand
out GPU ids in the order the plan numbered them; ``verify_gpu_ids`` checks that it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.plan.model import Plan, RoleInstance

NODE_LABEL = "ray.io/node-id"


class PlacementError(RuntimeError):
    """The cluster cannot host the plan; the message says what is missing."""


def cluster_nodes(plan: Plan) -> list[str]:
    """Ray node ids standing for plan nodes 0..n-1."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if plan.gpus_used == 0:
        here = ray.get_runtime_context().get_node_id()
        return [here] + [n["NodeID"] for n in alive if n["NodeID"] != here]
    with_gpus = [n for n in alive if n.get("Resources", {}).get("GPU", 0) >= 1]
    if len(with_gpus) < plan.nodes:
        raise PlacementError(f"the plan needs {plan.nodes} node(s) with {plan.gpus_per_node} GPU(s) each, but the "
                             f"Ray cluster has {len(with_gpus)} node(s) with GPUs ({_gpus_seen(alive)}); start more "
                             "nodes, or lower cluster.nodes, or set cluster.gpus_per_node=0 and the roles' gpus "
                             "to 0 to run on CPU")
    for n in with_gpus[: plan.nodes]:
        if n["Resources"]["GPU"] < plan.gpus_per_node:
            raise PlacementError(f"node {n['NodeID'][:12]} has {int(n['Resources']['GPU'])} GPUs; the plan assumes "
                                 f"cluster.gpus_per_node={plan.gpus_per_node}")
    return [n["NodeID"] for n in with_gpus[: plan.nodes]]


def _gpus_seen(alive: list[dict]) -> str:
    """What Ray sees, for a placement error: ``GPUs per node: 0`` or ``GPUs per node: 8, 8``."""
    counts = ", ".join(str(int(n.get("Resources", {}).get("GPU", 0))) for n in alive)
    return f"GPUs per node: {counts or 'no nodes alive'}"


@dataclass
class Placement:
    """The placement groups of a run and how to schedule each role instance into them."""

    plan: Plan
    groups: dict[str, PlacementGroup]
    nodes: list[str]
    """Ray node ids of plan nodes 0..n-1."""

    def node_of(self, instance: RoleInstance) -> str:
        """The Ray node an instance's planned bundle is on."""
        return self.nodes[instance.node]

    def actor_options(self, instance: RoleInstance) -> dict[str, Any]:
        """``.options(...)`` for the Ray actor of one role instance: its pool, bundle and GPU share."""
        # The bundle reserves the CPUs; actors take none of them for scheduling, so roles that
        # share a bundle (colocate on CPU) fit in it.
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.groups[instance.pool], placement_group_bundle_index=instance.bundles[0]),
            "num_cpus": 0,
        }
        if instance.gpus:
            options["num_gpus"] = instance.gpu_fraction
        return options

    def remove(self) -> None:
        for group in self.groups.values():
            remove_placement_group(group)

    def bundle_of(self, instance: RoleInstance) -> dict[str, float]:
        """The resources of the planned bundle an instance sits on."""
        pool = next(p for p in self.plan.pools if p.name == instance.pool)
        bundle = pool.bundles[instance.bundles[0]]
        return {"CPU": bundle.cpus, **({"GPU": float(len(bundle.gpus))} if bundle.gpus else {})}

    def spare(self, instance: RoleInstance, name: str, timeout_s: float) -> tuple[dict[str, Any], PlacementGroup]:
        """A placement group of its own, on any node with room, for a worker like ``instance``: a
        rollout replica added mid-run, or a worker whose planned node is gone. Returns the actor
        options and the group (remove it when the worker leaves)."""
        resources = self.bundle_of(instance)
        group = placement_group([resources], strategy="PACK", name=f"relax-{self.plan.run}-{name}")
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise PlacementError(f"no node has room for another {instance.role} worker ({resources}) after "
                                 f"{timeout_s:.0f} s (fault_tolerance.restart_timeout_s); "
                                 f"{ray.available_resources()} available") from None
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            "num_cpus": 0,
        }
        if instance.gpus:
            options["num_gpus"] = instance.gpu_fraction
        return options, group


def create_placement(plan: Plan, timeout_s: float = 60.0) -> Placement:
    """Create (and wait for) one placement group per pool of the plan."""
    nodes = cluster_nodes(plan)
    groups: dict[str, PlacementGroup] = {}
    for pool in plan.pools:
        bundles = []
        for b in pool.bundles:
            resources: dict[str, float] = {"CPU": b.cpus}
            if b.gpus:
                resources["GPU"] = float(len(b.gpus))
            bundles.append(resources)
        selectors = [{NODE_LABEL: nodes[b.node]} for b in pool.bundles]
        groups[pool.name] = placement_group(bundles, strategy=pool.strategy, name=f"relax-{plan.run}-{pool.name}",
                                            bundle_label_selector=selectors)
    placement = Placement(plan=plan, groups=groups, nodes=nodes)
    try:
        ray.get([g.ready() for g in groups.values()], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        placement.remove()
        asked = ", ".join(f"{p.name}: {len(p.bundles)} bundles" for p in plan.pools)
        raise PlacementError(f"the placement groups ({asked}) were not ready after {timeout_s:.0f} s: the cluster "
                             "lacks the CPUs or GPUs the plan reserves "
                             f"({ray.available_resources()} available)") from None
    return placement


def verify_gpu_ids(plan: Plan, instance: RoleInstance, node_id: str, gpu_ids: list[Any],
                   nodes: list[str]) -> str | None:
    """None when an actor landed where the plan put it, else what differs."""
    if nodes[instance.node] != node_id:
        return f"{instance.role}[{instance.rank}] is on node {node_id[:12]}, planned {nodes[instance.node][:12]}"
    if instance.gpus and sorted(int(g) for g in gpu_ids) != sorted(instance.gpus):
        return f"{instance.role}[{instance.rank}] got GPUs {gpu_ids}, planned {instance.gpus}"
    return None
