"""Resolve a spec's roles into pools (placement groups), bundles and role instances.

GPUs are handed out pool by pool, first-fit over nodes, in units that must not straddle a node: a rollout
engine's tp x pp GPUs, a trained role's tensor-parallel group. Which roles share a pool follows the
placement mode:

- colocate: one pool for the actor, rollout and every other model role (they time-share GPUs);
- separate: a pool per role;
- hybrid: the rollout alone; reference, actor_fwd and the advantage worker inside the actor's pool.

Reward and advantage workers are CPU bundles. A spec that cannot be laid out raises ``SpecError``
with the path to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from relax.errors import SpecError, SpecIssue, overrides
from relax.plan.model import Bundle, Pool, RoleInstance
from relax.plan.wiring import advantage_reads
from relax.roles import EVALUATION, Role
from relax.spec.models import ForwardRole, RunSpec

CPUS_PER_GPU_BUNDLE = 1.0


@dataclass
class GpuCursor:
    """Hands out GPUs first-fit over nodes, in order within a node; a unit never spans two nodes."""

    nodes: int
    per_node: int
    used: list[int] = field(default_factory=list)

    def take(self, size: int, path: str) -> list[tuple[int, int]]:
        if size > self.per_node:
            raise SpecError([SpecIssue(path, f"a group of {size} GPUs would span nodes (each node has "
                                             f"{self.per_node})", f"keep it at or below {self.per_node}")])
        if not self.used:
            self.used = [0] * self.nodes
        for node, used in enumerate(self.used):
            if used + size <= self.per_node:
                self.used[node] += size
                return [(node, used + i) for i in range(size)]
        raise SpecError([SpecIssue("cluster", f"the roles do not fit: {path} needs {size} GPUs on one node, but "
                                   "the earlier roles left only "
                                   f"{', '.join(str(self.per_node - u) for u in self.used)} "
                                   "free per node", "add nodes, or choose group sizes that pack into "
                                   "cluster.gpus_per_node")])


@dataclass
class PoolBuilder:
    """Accumulates one pool's bundles and instances."""

    name: str
    roles: list[str] = field(default_factory=list)
    bundles: list[Bundle] = field(default_factory=list)
    instances: list[RoleInstance] = field(default_factory=list)

    def add_gpu_bundles(self, gpus: list[tuple[int, int]]) -> list[int]:
        start = len(self.bundles)
        for node, gpu in gpus:
            self.bundles.append(Bundle(index=len(self.bundles), node=node, gpus=[gpu], cpus=CPUS_PER_GPU_BUNDLE))
        return list(range(start, len(self.bundles)))

    def add_cpu_bundle(self, cpus: float, node: int = 0) -> int:
        self.bundles.append(Bundle(index=len(self.bundles), node=node, cpus=cpus))
        return len(self.bundles) - 1

    def build(self, single_node: bool) -> Pool:
        nodes = {b.node for b in self.bundles}
        strategy = "STRICT_PACK" if len(nodes) <= 1 and single_node else "PACK"
        return Pool(name=self.name, strategy=strategy, roles=self.roles, bundles=self.bundles)


def rank_coords(rank: int, tp: int, cp: int, dp: int) -> dict[str, int]:
    """Megatron's rank order, tensor parallel fastest: tp, cp, dp, then pp."""
    return {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": (rank // (tp * cp)) % dp,
            "pp": rank // (tp * cp * dp)}


def _trained_instances(name: str, role: ForwardRole, pool: PoolBuilder, bundles: list[int]) -> None:
    """One instance per GPU (rank); a CPU role is one instance per ``cpu_ranks`` (data-parallel
    ranks), each on a CPU bundle of its own (``bundles``' when given)."""
    if role.gpus == 0:
        for rank in range(role.cpu_ranks):
            index = bundles[rank] if rank < len(bundles) else pool.add_cpu_bundle(1.0)
            pool.instances.append(RoleInstance(role=name, rank=rank, pool=pool.name, bundles=[index],
                                               node=pool.bundles[index].node,
                                               coords=rank_coords(rank, 1, 1, role.cpu_ranks)))
        return
    par = role.parallel
    dp = role.gpus // par.model_parallel
    for rank in range(role.gpus):
        bundle = pool.bundles[bundles[rank]]
        pool.instances.append(RoleInstance(role=name, rank=rank, pool=pool.name, bundles=[bundle.index],
                                           node=bundle.node, gpus=list(bundle.gpus),
                                           coords=rank_coords(rank, par.tp, par.cp, dp)))


def _rollout_instances(spec: RunSpec, pool: PoolBuilder, bundles: list[int]) -> None:
    rollout = spec.roles.rollout
    for replica in range(rollout.replicas):
        if rollout.gpus_per_replica == 0:
            index = bundles[replica] if replica < len(bundles) else pool.add_cpu_bundle(1.0)
            mine = [index]
        else:
            mine = bundles[replica * rollout.gpus_per_replica:(replica + 1) * rollout.gpus_per_replica]
        first = pool.bundles[mine[0]]
        gpus = [g for i in mine for g in pool.bundles[i].gpus]
        pool.instances.append(RoleInstance(role=Role.rollout, rank=replica, pool=pool.name, bundles=mine,
                                           node=first.node, gpus=gpus, coords={"replica": replica}))


def _take_units(cursor: GpuCursor | None, total: int, unit: int, path: str) -> list[tuple[int, int]]:
    if cursor is None or total == 0:
        return []
    taken: list[tuple[int, int]] = []
    for _ in range(total // unit):
        taken += cursor.take(unit, path)
    return taken


def _cpu_workers(pool: PoolBuilder, name: str, replicas: int, cpus: float) -> None:
    pool.roles.append(name)
    for rank in range(replicas):
        index = pool.add_cpu_bundle(cpus)
        pool.instances.append(RoleInstance(role=name, rank=rank, pool=pool.name, bundles=[index], node=0))


def _reward_workers(spec: RunSpec, cursor: GpuCursor | None, pool: PoolBuilder, cpus: float) -> None:
    """``roles.reward.host: own``: CPU workers, or each on ``gpus_per_replica`` GPUs of its own
    (a model-based reward's judge runs there)."""
    reward = spec.roles.reward
    if reward.gpus_per_replica == 0:
        _cpu_workers(pool, Role.reward, reward.replicas, cpus)
        return
    pool.roles.append(Role.reward)
    bundles = pool.add_gpu_bundles(_take_units(cursor, reward.replicas * reward.gpus_per_replica,
                                               reward.gpus_per_replica, "roles.reward.gpus_per_replica"))
    for rank in range(reward.replicas):
        mine = bundles[rank * reward.gpus_per_replica:(rank + 1) * reward.gpus_per_replica]
        first = pool.bundles[mine[0]]
        pool.instances.append(RoleInstance(role=Role.reward, rank=rank, pool=pool.name, bundles=mine, node=first.node,
                                           gpus=[g for i in mine for g in pool.bundles[i].gpus],
                                           coords={"replica": rank}))


def _score_in_rollout(spec: RunSpec, builders: list[PoolBuilder]) -> None:
    """``roles.reward.host: rollout``: a scorer rides on each rollout engine's first bundle, and
    outside hybrid mode the advantage estimator rides with the first one."""
    pool = next(b for b in builders if b.name in ("rollout", "colocate"))
    engines = [i for i in pool.instances if i.role == Role.rollout]
    pool.roles.append(Role.reward)
    for engine in engines:
        pool.instances.append(RoleInstance(role=Role.reward, rank=engine.rank, pool=pool.name,
                                           bundles=engine.bundles[:1], node=engine.node))
    if spec.placement.mode != "hybrid" and not advantage_reads(spec):
        pool.roles.append(Role.advantage)
        first = engines[0]
        pool.instances.append(RoleInstance(role=Role.advantage, rank=0, pool=pool.name,
                                           bundles=first.bundles[:1], node=first.node))


def evaluates_on_own(spec: RunSpec) -> bool:
    """Whether ``trainer.eval.host`` asks for an evaluation worker of its own (``auto``: outside
    colocate mode; whether it gets one on GPUs is up to the free GPUs, ``_evaluation_worker``)."""
    host = spec.trainer.eval.host
    return spec.data.eval is not None and (host == "own" or (host == "auto" and spec.placement.mode != "colocate"))


def _evaluation_worker(spec: RunSpec, cursor: GpuCursor | None, builders: list[PoolBuilder]) -> None:
    """The evaluation worker (``trainer.eval.host``), in a pool of its own: a CPU bundle, or a
    rollout engine's ``gpus_per_replica`` GPUs from those the roles left free. With ``auto`` and too
    few free GPUs there is none, and the rollout evaluates between steps."""
    if not evaluates_on_own(spec):
        return
    gpus = spec.roles.rollout.gpus_per_replica
    pool = PoolBuilder(name=EVALUATION, roles=[EVALUATION])
    if gpus == 0 or cursor is None:
        mine = [pool.add_cpu_bundle(1.0)]
    else:
        try:
            mine = pool.add_gpu_bundles(cursor.take(gpus, "trainer.eval.host"))
        except SpecError:
            if spec.trainer.eval.host == "auto":
                return
            free = (sum(cursor.per_node - used for used in cursor.used) if cursor.used
                    else cursor.per_node * cursor.nodes)
            raise SpecError([SpecIssue("trainer.eval.host", f"an evaluation worker of its own needs {gpus} free GPUs "
                                       f"on one node (roles.rollout.gpus_per_replica), but the roles leave {free} "
                                       "free", "set trainer.eval.host: rollout (the rollout evaluates between "
                                       "steps) or auto, or add GPUs to the cluster",
                                       overrides(trainer__eval__host="rollout"))]) from None
    first = pool.bundles[mine[0]]
    pool.instances.append(RoleInstance(role=EVALUATION, rank=0, pool=pool.name, bundles=mine, node=first.node,
                                       gpus=[g for i in mine for g in pool.bundles[i].gpus]))
    builders.append(pool)


def plan_placement(spec: RunSpec) -> tuple[list[Pool], list[RoleInstance]]:
    """The pools and role instances of a validated spec."""
    roles, mode = spec.roles, spec.placement.mode
    cursor = GpuCursor(spec.cluster.nodes, spec.cluster.gpus_per_node) if spec.cluster.gpus_per_node else None
    single_node = spec.cluster.nodes == 1
    trained = spec.trained_roles()
    builders: list[PoolBuilder] = []

    def trained_pool(name: str, role: ForwardRole) -> PoolBuilder:
        pool = PoolBuilder(name=name, roles=[name])
        bundles = pool.add_gpu_bundles(_take_units(cursor, role.gpus, role.parallel.tp, f"roles.{name}.parallel.tp"))
        _trained_instances(name, role, pool, bundles)
        builders.append(pool)
        return pool

    rollout_unit = max(1, roles.rollout.gpus_per_replica)
    if mode == "colocate":
        pool = PoolBuilder(name="colocate", roles=[Role.actor, Role.rollout])
        unit = math.lcm(roles.actor.parallel.tp, rollout_unit)
        bundles = pool.add_gpu_bundles(_take_units(cursor, roles.actor.gpus, unit, "roles.actor.parallel.tp"))
        if not bundles:  # on CPU: a bundle per actor rank
            bundles = [pool.add_cpu_bundle(1.0) for _ in range(roles.actor.cpu_ranks)]
        _trained_instances(Role.actor, roles.actor, pool, bundles)
        # each replica on its GPUs; on CPU in the actor's first process, or in each rank's
        # (colocation across ranks: ``RunSpec.engine_per_rank``)
        _rollout_instances(spec, pool, bundles if roles.rollout.gpus_per_replica or spec.engine_per_rank
                           else [bundles[0]] * roles.rollout.replicas)
        for name, role in trained.items():
            if name != Role.actor:
                pool.roles.append(name)
                _trained_instances(name, role, pool, bundles)
        builders.append(pool)
    else:
        rollout_pool = PoolBuilder(name="rollout", roles=[Role.rollout])
        bundles = rollout_pool.add_gpu_bundles(
            _take_units(cursor, roles.rollout.gpus, rollout_unit, "roles.rollout.gpus_per_replica"))
        _rollout_instances(spec, rollout_pool, bundles)
        builders.append(rollout_pool)
        actor_pool = trained_pool(Role.actor, roles.actor)
        actor_bundles = [i.bundles[0] for i in actor_pool.instances]
        for name, role in trained.items():
            if name == Role.actor:
                continue
            # With the actor's LoRA the reference is the actor's base model, adapter off: beside it.
            if (mode == "hybrid" and name in (Role.reference, Role.actor_fwd)) or \
                    (name == Role.reference and roles.actor.lora is not None):
                actor_pool.roles.append(name)
                _trained_instances(name, role, actor_pool, actor_bundles)
            else:
                trained_pool(name, role)
    if roles.reward.host == "rollout":
        _score_in_rollout(spec, builders)
    elif mode == "hybrid":
        reward_pool = PoolBuilder(name="reward")
        _reward_workers(spec, cursor, reward_pool, roles.reward.cpus)
        builders.append(reward_pool)
    else:
        # Scoring and advantages are cheap CPU work on the same rows: one pool, and the first
        # advantage worker shares the first reward bundle, so the runtime can hand rewards to it
        # in memory instead of through another bus round trip.
        scoring = PoolBuilder(name="scoring")
        _reward_workers(spec, cursor, scoring, roles.reward.cpus + roles.advantage.cpus)
        scoring.roles.append(Role.advantage)
        for rank in range(roles.advantage.replicas):
            index = 0 if rank == 0 else scoring.add_cpu_bundle(roles.advantage.cpus)
            scoring.instances.append(RoleInstance(role=Role.advantage, rank=rank, pool=scoring.name,
                                                  bundles=[index], node=0))
        builders.append(scoring)
    if mode == "hybrid" or (roles.reward.host == "rollout" and advantage_reads(spec)):
        # The estimator reads columns of the critic or the reference: it waits for them beside
        # the actor rather than in the rollout worker, which would stall generation.
        actor_pool = next(b for b in builders if b.name in ("actor", "colocate"))
        _cpu_workers(actor_pool, Role.advantage, roles.advantage.replicas, roles.advantage.cpus)
    _evaluation_worker(spec, cursor, builders)
    pools = [b.build(single_node) for b in builders]
    instances = [i for b in builders for i in b.instances]
    return pools, instances


def gpu_fractions(instances: list[RoleInstance]) -> None:
    """Split each GPU's scheduling resource between the instances that share it."""
    sharing: dict[tuple[str, int, int], int] = {}
    for inst in instances:
        for gpu in inst.gpus:
            key = (inst.pool, inst.node, gpu)
            sharing[key] = sharing.get(key, 0) + 1
    for inst in instances:
        if inst.gpus:
            inst.gpu_fraction = round(1.0 / max(sharing[(inst.pool, inst.node, g)] for g in inst.gpus), 6)
