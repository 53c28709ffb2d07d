"""The Plan: pure, serializable data saying where every role instance runs.

``relax plan`` renders it; ``relax run`` builds its Ray placement groups from it and never
re-derives placement. ``Plan.model_json_schema()`` is checked in as ``schemas/plan.schema.json``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


class PlanPart(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Bundle(PlanPart):
    """One Ray placement-group bundle: resources reserved on one node."""

    index: int
    """Position of the bundle in its pool."""
    node: int
    """Planned node index (0-based, in the order the cluster lists its nodes)."""
    gpus: list[int] = Field(default_factory=list)
    """GPU indices on that node (empty for a CPU bundle)."""
    cpus: float
    """Logical CPUs reserved."""


class Pool(PlanPart):
    """A Ray placement group shared by one or more roles."""

    name: str
    """Pool name (also the placement group's name)."""
    strategy: Strategy
    """Ray placement strategy: STRICT_PACK when the pool fits one node, PACK otherwise."""
    roles: list[str]
    """Roles whose instances sit in this pool."""
    bundles: list[Bundle]
    """The bundles, one per GPU (or one per CPU worker)."""

    @property
    def gpu_count(self) -> int:
        return sum(len(b.gpus) for b in self.bundles)


class RoleInstance(PlanPart):
    """One Ray actor: a rank of a trained role, a rollout engine or a CPU worker."""

    role: str
    """Role name (rollout, actor, reference, critic, actor_fwd, reward, advantage)."""
    rank: int
    """Index of this instance within its role."""
    pool: str
    """The pool it is placed in."""
    bundles: list[int]
    """Bundle indices in that pool (a rollout engine with tp x pp GPUs spans several)."""
    node: int
    """Planned node."""
    gpus: list[int] = Field(default_factory=list)
    """GPU indices on that node; empty on CPU."""
    gpu_fraction: float = 0.0
    """Share of each GPU's scheduling resource this actor takes (colocated roles split one GPU)."""
    coords: dict[str, int] = Field(default_factory=dict)
    """Parallel coordinates of a trained rank: dp, tp, pp, cp (replica for rollout engines)."""


class BusField(PlanPart):
    """A column on the TransferQueue bus: who writes it and who reads it."""

    name: str
    writer: str
    readers: list[str]


class WeightSyncEdge(PlanPart):
    """Versioned weights published by ``source`` and loaded by ``target`` at a batch boundary."""

    source: str
    target: str
    mechanism: Literal["in-process", "object-store", "nccl-broadcast", "gloo-broadcast", "cuda-ipc"]
    """How the bytes move: same process, Ray object store, a weight group's broadcast (NCCL on GPUs,
    gloo on CPU: ``roles.rollout.weight_sync``), or CUDA IPC (shared GPUs)."""


class StalenessWindow(PlanPart):
    """Policy versions a step may train on."""

    step: int
    min_version: int
    max_version: int


class StalenessSchedule(PlanPart):
    """The staleness bound as the runtime enforces it."""

    max_staleness: int
    correction: str
    rule: str
    """The admission rule in words."""
    first_steps: list[StalenessWindow]
    """The allowed version window of the first steps (the pattern repeats)."""


class MemoryItem(PlanPart):
    """One contribution to a GPU's memory, in GiB."""

    role: str
    what: str
    """weights, gradients, optimizer, activations, logits, kv_cache."""
    gib: float
    transient: bool = False
    """Freed between uses (activations, logits, KV cache) rather than held for the whole run."""


class DeviceMemory(PlanPart):
    """The estimate for one GPU (or the host, for CPU roles)."""

    node: int
    gpu: int | None
    """GPU index on the node; None for host memory of CPU roles."""
    roles: list[str]
    items: list[MemoryItem]
    phases: dict[str, float]
    """Resident GiB per phase (colocate: generate and train; otherwise one phase: run)."""
    peak_gib: float
    capacity_gib: float | None
    """The GPU's memory from cluster.gpu_memory_gb; None for the host."""


class Plan(PlanPart):
    """Everything ``relax run`` needs to place a run, and ``relax plan`` shows."""

    run: str
    mode: Literal["colocate", "separate", "hybrid"]
    nodes: int
    gpus_per_node: int
    gpus_used: int
    model: str
    model_params: int | None
    """Total parameters when the architecture is known."""
    rollout_max_replicas: int | None = None
    """The most rollout replicas ``relax scale`` may run when the rollout is elastic
    (``roles.rollout.max_replicas`` above ``replicas``; each new one gets a bundle like the planned
    ones); null: the rollout keeps its planned replicas."""
    pools: list[Pool]
    instances: list[RoleInstance]
    bus: list[BusField]
    weight_sync: list[WeightSyncEdge]
    staleness: StalenessSchedule
    memory: list[DeviceMemory]
    notes: list[str] = Field(default_factory=list)
    """Assumptions and caveats of the estimate."""

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def instances_of(self, role: str) -> list[RoleInstance]:
        return [i for i in self.instances if i.role == role]
