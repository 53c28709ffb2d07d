"""What flows between roles, read off the workers' wiring (``relax.plan.wiring``): bus fields and
weight-sync edges; and the staleness schedule."""

from __future__ import annotations

from relax.algo.staleness import StalenessPolicy, staleness_policy
from relax.plan.model import BusField, StalenessSchedule, StalenessWindow, WeightSyncEdge, WorkerPlan
from relax.roles import AGENT_COLUMNS, EVALUATION, ROLLOUT_COLUMNS, ROUTING_COLUMNS, Column, Role
from relax.spec.models import RunSpec

#: The order in which ``relax plan`` lists the bus columns (data order).
COLUMN_ORDER = (*ROLLOUT_COLUMNS, Column.media, *AGENT_COLUMNS, *ROUTING_COLUMNS, Column.rewards, Column.ref_logprobs,
                Column.old_logprobs, Column.values, Column.returns, Column.advantages)


def bus_fields(workers: list[WorkerPlan]) -> list[BusField]:
    """Every column that travels on the bus, with its single writer and the roles that read it
    there, read off the workers' wiring. Rows handed over in memory (``hands_to``) reach the bus
    only with the last loop of their chain, and only if that loop writes (a scorer or an
    estimator puts the chain's columns; the actor, at the end of colocate's chain, puts nothing);
    a loop that takes its rows in memory (``takes_from``) reads nothing from the bus."""
    writers: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    for worker in workers:
        chain: list[tuple[str, list[str]]] = []  # (role, columns) handed along so far
        for loop in worker.roles:
            chain.append((loop.role, list(loop.writes)))
            if loop.hands_to is None:
                if loop.writes:
                    for role, columns in chain:
                        for column in columns:
                            writers.setdefault(column, role)
                chain = []
            if loop.takes_from is None:
                for column in loop.reads:
                    if loop.role not in readers.setdefault(column, []):
                        readers[column].append(loop.role)
    order = {name: i for i, name in enumerate(COLUMN_ORDER)}
    return [BusField(name=name, writer=writer, readers=[r for r in readers.get(name, []) if r != writer])
            for name, writer in sorted(writers.items(), key=lambda kv: order.get(kv[0], len(order)))]


def weight_sync_edges(workers: list[WorkerPlan], on_gpu: bool) -> list[WeightSyncEdge]:
    """The actor publishes each new policy version to the rollout, to actor_fwd and to an
    evaluation worker, by the channel each one's wiring names. The reference policy is frozen, so it
    gets no edge."""
    in_memory = "cuda-ipc" if on_gpu else "in-process"
    mechanisms = {"in-process": in_memory, "shared": in_memory, "object-store": "object-store",
                  "collective": "nccl-broadcast" if on_gpu else "gloo-broadcast"}
    edges: dict[str, WeightSyncEdge] = {}
    for worker in workers:
        for loop in worker.roles:
            if loop.weights_in is not None and loop.task not in edges:
                edges[loop.task] = WeightSyncEdge(source=Role.actor, target=loop.task,
                                                  mechanism=mechanisms[loop.weights_in])
    return [edges[task] for task in (Role.rollout, Role.actor_fwd, EVALUATION) if task in edges]


def staleness_schedule(spec: RunSpec, shown_steps: int = 4, total_steps: int | None = None) -> StalenessSchedule:
    """Which policy versions each step may train on: [t - k, t] for step t (versions count updates);
    ``total_steps``: the run's steps (``relax.spec.run_length.run_steps``; default ``trainer.steps``)."""
    k = spec.async_policy.staleness_cap
    policy = staleness_policy(k, spec.async_policy.auto if spec.async_policy.max_staleness == "auto" else None)
    widest = StalenessPolicy(policy.cap)
    steps = min(total_steps or spec.trainer.steps or 1, k + shown_steps)
    return StalenessSchedule(
        max_staleness=k, correction=spec.async_policy.correction, rule=policy.describe(),
        first_steps=[StalenessWindow(step=t, min_version=max(0, widest.min_version(t)), max_version=t)
                     for t in range(steps)],
    )
