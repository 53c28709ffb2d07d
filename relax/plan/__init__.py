"""``relax plan``: resolve a validated spec into a ``Plan`` (pure data; no torch, no ray)."""

from __future__ import annotations

import sys
import types
from typing import Any
from pathlib import Path

from relax.contracts import PluginKind
from relax.plan.memory import resident_phases, rollout_memory, trained_role_memory
from relax.plan.model import DeviceMemory, MemoryItem, Plan, RoleInstance
from relax.plan.placement import gpu_fractions, plan_placement
from relax.plan.render import render
from relax.plan.topology import bus_fields, staleness_schedule, weight_sync_edges
from relax.plan.wiring import crowded_cores_note, plan_workers, rollout_replica, rollout_work, run_settings
from relax.registry import PluginError, get_registry, trait
from relax.roles import EVALUATION, Role
from relax.spec.architecture import ModelArchitecture
from relax.spec.errors import SpecError, SpecIssue
from relax.spec.models import RunSpec
from relax.spec.validate import resolve_architecture

__all__ = ["Plan", "make_plan", "render"]

ACCURACY_NOTE = ("memory estimates follow docs/plan.md; expect them within about 20% for dense "
                 "models and 30% for MoE and multimodal models (allocator fragmentation and "
                 "framework buffers of 1-3 GiB per GPU are not included)")


def _trainer_trait(backend: str, name: str, default: str) -> str:
    """A memory-relevant class attribute of a trainer backend (``memory_sharding``,
    ``pipeline_schedule``), or ``default`` when the backend does not say or cannot be loaded."""
    try:
        cls = get_registry().load(PluginKind.trainer, backend)
    except PluginError:
        return default
    return trait(cls, PluginKind.trainer, name)


def judge_memory(spec: RunSpec, base_dir: Path) -> tuple[list[MemoryItem], list[str]]:
    """Per-GPU weights of the judge models of model-based rewards (``genrm``) on reward workers
    with GPUs, split over ``roles.reward.gpus_per_replica``; and notes on what is not estimated."""
    from relax.plan.memory import DTYPE_BYTES, gib

    reward = spec.roles.reward
    if reward.gpus_per_replica == 0:
        return [], []
    registry = get_registry()
    items, notes = [], []
    for i, entry in enumerate(spec.rewards):
        try:
            cls = registry.load(PluginKind.rewards, entry.name)
        except PluginError:
            continue
        if not trait(cls, PluginKind.rewards, "model_based"):
            continue
        config = registry.build_config(PluginKind.rewards, entry.name, entry.options)
        judge, _ = resolve_architecture(config.model, base_dir, registry, getattr(config, "model_options", {}))
        if judge is None:
            notes.append(f"rewards[{i}]: the judge {config.model} is unknown here; its memory is not estimated")
            continue
        width = DTYPE_BYTES[getattr(config, "dtype", spec.model.dtype)]
        items.append(MemoryItem(role="reward", what=f"weights ({entry.key})",
                                gib=gib(judge.params_total() * width / reward.gpus_per_replica)))
    if items:
        notes.append("a judge's KV cache is not in the reward workers' estimate (only its weights)")
    return items, notes


def _instance_items(inst: RoleInstance, spec: RunSpec, arch: ModelArchitecture,
                    cache: dict[str, list[MemoryItem]]) -> list[MemoryItem]:
    if inst.role not in cache:
        if inst.role == Role.rollout:
            cache[inst.role] = rollout_memory(spec, arch)
        elif inst.role == EVALUATION:  # a copy of the rollout engine
            cache[inst.role] = [item.model_copy(update={"role": EVALUATION}) for item in rollout_memory(spec, arch)]
        else:
            role = spec.trained_roles().get(inst.role)
            if role is None:  # CPU workers: reward, advantage
                cache[inst.role] = []
            else:
                dp = max(1, role.gpus // role.parallel.model_parallel)
                cache[inst.role] = trained_role_memory(
                    inst.role, role, spec, arch, _trainer_trait(role.backend, "memory_sharding", "none"), dp,
                    _trainer_trait(role.backend, "pipeline_schedule", "1f1b"))
    return cache[inst.role]


def estimate_memory(spec: RunSpec, arch: ModelArchitecture, instances: list[RoleInstance],
                    judge: list[MemoryItem] | None = None) -> list[DeviceMemory]:
    """Per GPU (and per host for CPU roles): what each role keeps there, and the resident peak."""
    cache: dict[str, list[MemoryItem]] = {"reward": judge or []}
    devices: dict[tuple[int, int | None], tuple[list[str], list[MemoryItem]]] = {}
    for inst in instances:
        items = _instance_items(inst, spec, arch, cache)
        for gpu in inst.gpus or [None]:
            roles, held = devices.setdefault((inst.node, gpu), ([], []))
            if inst.role not in roles:
                roles.append(inst.role)
                held.extend(items)
    colocate = spec.placement.mode == "colocate"
    out = []
    for (node, gpu), (roles, items) in sorted(devices.items(), key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0)):
        phases = resident_phases(items, colocate)
        out.append(DeviceMemory(node=node, gpu=gpu, roles=roles, items=items, phases=phases,
                                peak_gib=max(phases.values(), default=0.0),
                                capacity_gib=spec.cluster.gpu_memory_gb if gpu is not None else None))
    return out


def memory_issues(devices: list[DeviceMemory]) -> list[SpecIssue]:
    """One issue per role whose GPUs are estimated over capacity (at its worst GPU)."""
    worst: dict[str, DeviceMemory] = {}
    for dev in devices:
        if dev.capacity_gib is None or dev.peak_gib <= dev.capacity_gib:
            continue
        by_role: dict[str, float] = {}
        for item in dev.items:
            by_role[item.role] = by_role.get(item.role, 0.0) + item.gib
        heaviest = max(by_role, key=by_role.__getitem__)
        if heaviest not in worst or dev.peak_gib > worst[heaviest].peak_gib:
            worst[heaviest] = dev
    issues = []
    for role, dev in sorted(worst.items()):
        parts = ", ".join(f"{i.role} {i.what} {i.gib:.1f}" for i in dev.items if i.gib >= 0.05)
        issues.append(SpecIssue(
            f"roles.{role}", f"estimated {dev.peak_gib:.1f} GiB on node {dev.node} GPU {dev.gpu} exceeds "
            f"cluster.gpu_memory_gb={dev.capacity_gib:g} ({parts})",
            "raise tensor/pipeline parallel, enable gradient_checkpointing, lower micro_batch_size "
            "or max_new_tokens, or give the role more GPUs"))
    return issues


def _elastic_limit(spec: RunSpec) -> int | None:
    """``roles.rollout.max_replicas`` when it lets the rollout grow past its planned replicas."""
    rollout = spec.roles.rollout
    return rollout.max_replicas if rollout.max_replicas and rollout.max_replicas > rollout.replicas else None


def make_plan(spec: RunSpec, *, base_dir: Path | None = None, check_memory: bool = True) -> Plan:
    """The placement, bus topology, weight-sync edges, staleness schedule and memory of a spec.

    Raises ``SpecError`` when the spec cannot be laid out on its cluster or is estimated to run
    out of GPU memory.
    """
    pools, instances = plan_placement(spec)
    gpu_fractions(instances)
    arch, _ = resolve_architecture(spec.model.path, base_dir or Path.cwd(), get_registry(), spec.model.options)
    notes = [ACCURACY_NOTE]
    memory: list[DeviceMemory] = []
    if arch is None:
        notes.append(f"the architecture of {spec.model.path} is unknown here (no local config.json "
                     "and no shipped card), so memory is not estimated")
    else:
        judge, judge_notes = judge_memory(spec, base_dir or Path.cwd())
        notes += judge_notes
        memory = estimate_memory(spec, arch, instances, judge)
        if check_memory:
            issues = memory_issues(memory)
            if issues:
                raise SpecError(issues)
    workers = plan_workers(spec, instances, base_dir or Path.cwd(), arch=arch)
    crowded = crowded_cores_note(spec, workers)
    if crowded is not None:
        notes.append(crowded)
    return Plan(
        run=spec.name, mode=spec.placement.mode, nodes=spec.cluster.nodes,
        gpus_per_node=spec.cluster.gpus_per_node,
        gpus_used=sum(p.gpu_count for p in pools), model=spec.model.path,
        model_params=arch.params_total() if arch else None,
        rollout_max_replicas=_elastic_limit(spec),
        pools=pools, instances=instances, bus=bus_fields(workers),
        weight_sync=weight_sync_edges(workers, on_gpu=spec.roles.actor.gpus > 0),
        staleness=staleness_schedule(spec), memory=memory, workers=workers, rollout_replica=rollout_replica(spec, workers, base_dir or Path.cwd()),
        rollout_work=rollout_work(spec),
        settings=run_settings(spec, base_dir or Path.cwd()),
        notes=notes, cores_note=crowded,
    )


class _CallablePackage(types.ModuleType):
    """``relax.plan`` is this package and also the Python API's ``relax.plan(spec, overrides)``
    (``relax.api.plan``): once any code imports the package, Python binds the name ``relax.plan``
    to it, so the package itself answers the call."""

    def __call__(self, spec: Any, overrides: Any = (), **options: Any) -> Plan:
        from relax.api import plan

        return plan(spec, overrides, **options)


sys.modules[__name__].__class__ = _CallablePackage
