"""Placement groups from a Plan on a simulated 2-node Ray cluster with fake GPUs."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from relax.config import load_spec_dict
from relax.plan import make_plan
from relax.runtime.driver.placement import cluster_nodes, create_placement, verify_gpu_ids
from relax.spec import validate_spec


@ray.remote(num_cpus=0)
class Probe:
    """Stands in for a role actor: reports where Ray put it."""

    def where(self) -> tuple[str, list, str | None]:
        import os

        return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=12, num_gpus=8)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def plan_for(preset: str, *overrides: str):
    raw, base = load_spec_dict(preset, list(overrides))
    return make_plan(validate_spec(raw, base_dir=base), base_dir=base)


@pytest.mark.parametrize("preset", ["qwen3-omni-30b-a3b", "qwen3-4b-grpo-colocate"])
def test_every_role_actor_lands_on_its_planned_node_and_gpu(two_nodes, preset: str) -> None:
    plan = plan_for(preset, "cluster.nodes=2") if preset.startswith("qwen3-4b") else plan_for(preset)
    placement = create_placement(plan)
    try:
        nodes = cluster_nodes(plan)
        actors = [Probe.options(**placement.actor_options(i)).remote() for i in plan.instances]
        found = ray.get([a.where.remote() for a in actors], timeout=60)
        problems = [verify_gpu_ids(plan, inst, node, gpus, nodes)
                    for inst, (node, gpus, _) in zip(plan.instances, found)]
        assert [p for p in problems if p] == []
        for inst, (_, gpus, visible) in zip(plan.instances, found):
            if inst.gpus:
                assert visible == ",".join(str(g) for g in inst.gpus)
        if plan.mode == "colocate":  # actor rank r and rollout replica r share GPU r
            by_gpu = {}
            for inst, (_, gpus, _) in zip(plan.instances, found):
                for g in gpus:
                    by_gpu.setdefault((inst.node, int(g)), set()).add(inst.role)
            assert all(roles == {"actor", "rollout"} for roles in by_gpu.values())
        for a in actors:
            ray.kill(a)
    finally:
        placement.remove()
