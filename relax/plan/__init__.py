"""``relax plan``: resolve a validated spec into a ``Plan`` (pure data; no torch, no ray)."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from relax.contracts import PluginKind
from relax.errors import SpecError, SpecIssue, fix_text
from relax.plan.memory import TrainerLayout, resident_phases, rollout_memory, trained_role_memory, trainer_layout
from relax.plan.model import DeviceMemory, MemoryItem, Plan, PlanHint, Pool, RoleInstance, UnusedGpus, WorkerPlan
from relax.plan.placement import gpu_fractions, plan_placement
from relax.plan.render import render
from relax.plan.topology import bus_fields, staleness_schedule, weight_sync_edges
from relax.plan.wiring import crowded_cores_note, plan_workers, rollout_replica, rollout_work, run_settings
from relax.registry import PluginError, get_registry, trait
from relax.roles import EVALUATION, Role
from relax.spec.architecture import ModelArchitecture
from relax.spec.hf_cache import HUB_ID, download_hint
from relax.spec.models import RunSpec
from relax.spec.run_length import run_steps
from relax.spec.validate import resolve_architecture

__all__ = ["Plan", "make_plan", "plan_spec", "render"]

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


def _role_layout(role: Any) -> TrainerLayout:
    """How the role's backend holds its state: its ``memory_sharding`` trait, or what its options
    choose (the torch trainer's ``fsdp`` block: ``relax.plan.memory.trainer_layout``)."""
    sharding = _trainer_trait(role.backend, "memory_sharding", "none")
    try:
        config = get_registry().build_config(PluginKind.trainer, role.backend, role.options)
    except Exception:  # noqa: BLE001 - an unloadable backend or bad options: validation names them
        config = None
    return trainer_layout(sharding, config)


def _sync_sizes(edges: list[Any], spec: RunSpec, arch: ModelArchitecture | None) -> list[Any]:
    """The weight-sync edges with the bytes one version moves (the LoRA adapter's alone with
    ``roles.actor.lora``), when the architecture is known."""
    from relax.plan.memory import weight_sync_bytes

    if arch is None:
        return edges
    size, adapter = weight_sync_bytes(spec, arch), spec.roles.actor.lora is not None
    return [e.model_copy(update={"bytes_per_sync": size, "adapter_only": adapter}) for e in edges]


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
            if inst.role == Role.reference and spec.roles.actor.lora is not None:
                role = None  # the LoRA actor's base model, adapter disabled: it holds nothing of its own
            if role is None:  # CPU workers: reward, advantage
                cache[inst.role] = []
            else:
                dp = max(1, role.gpus // role.parallel.model_parallel)
                cache[inst.role] = trained_role_memory(
                    inst.role, role, spec, arch, _role_layout(role), dp,
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
    def device_order(kv: Any) -> tuple[Any, bool, int]:
        return kv[0][0], kv[0][1] is None, kv[0][1] or 0

    for (node, gpu), (roles, items) in sorted(devices.items(), key=device_order):
        phases = resident_phases(items, colocate)
        out.append(DeviceMemory(node=node, gpu=gpu, roles=roles, items=items, phases=phases,
                                peak_gib=max(phases.values(), default=0.0),
                                capacity_gib=spec.cluster.gpu_memory_gb if gpu is not None else None))
    return out


def _over_memory(devices: list[DeviceMemory]) -> dict[str, DeviceMemory]:
    """Per role to blame, its worst GPU estimated over capacity: on a GPU that colocate mode
    time-shares, the rollout when only generating overflows, else the role holding the most."""
    worst: dict[str, DeviceMemory] = {}
    for dev in devices:
        if dev.capacity_gib is None or dev.peak_gib <= dev.capacity_gib:
            continue
        by_role: dict[str, float] = {}
        for item in dev.items:
            by_role[item.role] = by_role.get(item.role, 0.0) + item.gib
        heaviest = max(by_role, key=by_role.__getitem__)
        generating_only = dev.phases.get("generate", 0.0) > dev.capacity_gib >= dev.phases.get("train", 0.0)
        if generating_only and Role.rollout in by_role:
            heaviest = Role.rollout
        if heaviest not in worst or dev.peak_gib > worst[heaviest].peak_gib:
            worst[heaviest] = dev
    return worst


def memory_remedy(spec: RunSpec, role: str) -> tuple[str, list[tuple[str, ...]]]:
    """What lowers the memory of ``role`` (in words) and the candidate fixes, for what the role
    holds (a rollout engine's KV cache, a trained role's state and activations, a judge's weights)
    and what its backend supports."""
    from relax.plan.remedies import judge_memory_remedy, rollout_memory_remedy, trained_memory_remedy

    if role in (Role.rollout, EVALUATION):
        return rollout_memory_remedy(spec)
    if role in spec.trained_roles():
        backend = spec.trained_roles()[role].backend
        try:
            parallelism = frozenset(trait(get_registry().load(PluginKind.trainer, backend), PluginKind.trainer,
                                          "parallelism"))
        except PluginError:
            parallelism = frozenset()
        return trained_memory_remedy(spec, role, parallelism, _trainer_trait(backend, "memory_sharding", "none"))
    return judge_memory_remedy(spec)


def memory_issues(devices: list[DeviceMemory], spec: RunSpec | None = None) -> list[SpecIssue]:
    """One issue per role whose GPUs are estimated over capacity (at its worst GPU); with ``spec``,
    its remedy says what lowers that role's memory (``memory_remedy``), without a fix (``make_plan``
    finds one that works)."""
    issues = []
    for role, dev in sorted(_over_memory(devices).items()):
        parts = ", ".join(f"{i.role} {i.what} {i.gib:.1f}" for i in dev.items if i.gib >= 0.05)
        remedy = (memory_remedy(spec, role)[0] if spec is not None else
                  "raise tensor/pipeline parallel, enable gradient_checkpointing, lower micro_batch_size "
                  "or max_new_tokens, or give the role more GPUs")
        issues.append(SpecIssue(
            f"roles.{role}", f"estimated {dev.peak_gib:.1f} GiB on node {dev.node} GPU {dev.gpu} exceeds "
            f"cluster.gpu_memory_gb={dev.capacity_gib:g} ({parts})", remedy))
    return issues


def _with_fixes(issues: list[SpecIssue], spec: RunSpec, base_dir: Path) -> list[SpecIssue]:
    """The memory issues, each with the first candidate fix of its role under which the spec
    validates and plans within memory (none found: the remedy's words alone)."""
    from relax.plan.remedies import FixFinder

    out = []
    for issue in issues:
        finder = FixFinder(spec, base_dir, elsewhere=frozenset(i.path for i in issues if i is not issue))
        _, candidates = memory_remedy(spec, issue.path.removeprefix("roles."))
        out.append(dataclasses.replace(issue, fix=finder.first_fix(candidates)))
    return out


def _layout_fixes(issues: list[SpecIssue], spec: RunSpec, base_dir: Path) -> list[SpecIssue]:
    """Layout issues, each without a fix given the first candidate that lays the spec out and
    passes (``layout_candidates``)."""
    from relax.plan.remedies import FixFinder, layout_candidates

    return [issue if issue.fix else dataclasses.replace(issue, fix=FixFinder(spec, base_dir, fixing=issue.path)
                                                         .first_fix(layout_candidates(spec, issue.path)))
            for issue in issues]


def cores_hint(spec: RunSpec, workers: list[WorkerPlan], base_dir: Path, remedies: bool) -> PlanHint | None:
    """``crowded_cores_note`` with the overrides that run the spec in colocate mode (``remedies``:
    found and checked; else none)."""
    from relax.plan.remedies import FixFinder, colocate_fix

    text = crowded_cores_note(spec, workers)
    if text is None:
        return None
    fix = FixFinder(spec, base_dir).holds(colocate_fix()) if remedies else None
    if fix:
        text += f"; run it with {fix_text(fix)}"
    return PlanHint(text=text, fix=list(fix or ()))


def unused_gpus_hint(spec: RunSpec, pools: list[Pool], base_dir: Path, remedies: bool) -> UnusedGpus | None:
    """GPUs of the cluster no pool's bundle holds, beyond those an elastic rollout may grow into
    (``roles.rollout.max_replicas``), and (``remedies``) the first way to use them that validates
    and plans with none left unused (``unused_gpu_candidates``)."""
    from relax.plan.remedies import FixFinder, unused_gpu_candidates

    cluster, rollout = spec.cluster, spec.roles.rollout
    used = {(b.node, g) for pool in pools for b in pool.bundles for g in b.gpus}
    free = {node: [g for g in range(cluster.gpus_per_node) if (node, g) not in used] for node in range(cluster.nodes)}
    free = {node: gpus for node, gpus in free.items() if gpus}
    count = sum(len(gpus) for gpus in free.values())
    growth = (rollout.replica_limit - rollout.replicas) * rollout.gpus_per_replica
    if count <= growth:
        return None
    where = "; ".join(f"node {node}: GPU{'s' if len(g) > 1 else ''} {number_ranges(g)}" for node, g in free.items())
    text = f"{count} of the cluster's {cluster.gpus} GPUs {'is' if count == 1 else 'are'} unused ({where})"
    if growth:
        text += f", {growth} of them left for the elastic rollout to grow into (roles.rollout.max_replicas)"
    fix: tuple[str, ...] = ()
    if remedies:
        per_node = [sum(1 for n, _ in used if n == node) for node in range(cluster.nodes)]
        fix = FixFinder(spec, base_dir).first_fix(unused_gpu_candidates(spec, count - growth, per_node),
                                                  accept=lambda plan: plan.unused_gpus is None)
    if fix:
        them = "it" if count == 1 else "them"
        text += f": {fix_text(fix)} uses {them}" if not fix[0].startswith("cluster.") else \
            f": neither more rollout replicas nor a larger actor plan here; {fix_text(fix)} leaves {them} out"
    return UnusedGpus(text=text, fix=list(fix), count=count, by_node={str(n): g for n, g in free.items()})


def number_ranges(numbers: Iterable[int]) -> str:
    """``0-3,5``: sorted numbers, runs of consecutive ones joined (GPU indices, node indices)."""
    values, parts, i = sorted(set(numbers)), [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def _elastic_limit(spec: RunSpec) -> int | None:
    """``roles.rollout.max_replicas`` when it lets the rollout grow past its planned replicas."""
    rollout = spec.roles.rollout
    return rollout.max_replicas if rollout.max_replicas and rollout.max_replicas > rollout.replicas else None


def make_plan(spec: RunSpec, *, base_dir: Path | None = None, check_memory: bool = True,
              remedies: bool = True) -> Plan:
    """The placement, bus topology, weight-sync edges, staleness schedule and memory of a spec.

    Raises ``SpecError`` when the spec cannot be laid out on its cluster or is estimated to run
    out of GPU memory. ``remedies``: memory issues and the plan's hints (``cores_note``,
    ``unused_gpus``) come with fixes that were tried on the spec (``relax.plan.remedies``); off,
    they have none (as when a fix is being tried).
    """
    try:
        pools, instances = plan_placement(spec)
    except SpecError as exc:
        raise SpecError(_layout_fixes(exc.issues, spec, base_dir or Path.cwd()) if remedies else exc.issues) from None
    gpu_fractions(instances)
    arch, _ = resolve_architecture(spec.model.path, base_dir or Path.cwd(), get_registry(), spec.model.options)
    notes = [ACCURACY_NOTE]
    memory: list[DeviceMemory] = []
    if arch is None:
        notes.append(f"the architecture of {spec.model.path} is unknown here (no model folder, no config.json "
                     "in the Hugging Face cache and no shipped card), so memory is not estimated"
                     + (f"; {download_hint(spec.model.path)}" if HUB_ID.match(spec.model.path) else ""))
    else:
        judge, judge_notes = judge_memory(spec, base_dir or Path.cwd())
        notes += judge_notes
        memory = estimate_memory(spec, arch, instances, judge)
        if check_memory:
            issues = memory_issues(memory, spec)
            if issues:
                raise SpecError(_with_fixes(issues, spec, base_dir or Path.cwd()) if remedies else issues)
    workers = plan_workers(spec, instances, base_dir or Path.cwd(), arch=arch)
    crowded = cores_hint(spec, workers, base_dir or Path.cwd(), remedies)
    unused = unused_gpus_hint(spec, pools, base_dir or Path.cwd(), remedies)
    notes += [hint.text for hint in (crowded, unused) if hint is not None]
    return Plan(
        run=spec.name, mode=spec.placement.mode, nodes=spec.cluster.nodes,
        gpus_per_node=spec.cluster.gpus_per_node,
        gpus_used=sum(p.gpu_count for p in pools), model=spec.model.path,
        model_params=arch.params_total() if arch else None,
        rollout_max_replicas=_elastic_limit(spec),
        pools=pools, instances=instances, bus=bus_fields(workers),
        weight_sync=_sync_sizes(weight_sync_edges(workers, on_gpu=spec.roles.actor.gpus > 0), spec, arch),
        staleness=staleness_schedule(spec, total_steps=run_steps(spec, base_dir or Path.cwd())), memory=memory,
        workers=workers, rollout_replica=rollout_replica(spec, workers, base_dir or Path.cwd()),
        rollout_work=rollout_work(spec),
        settings=run_settings(spec, base_dir or Path.cwd()),
        notes=notes, cores_note=crowded, unused_gpus=unused,
    )


def plan_spec(spec: Any, overrides: Sequence[str] = (), *, base_dir: str | Path | None = None) -> Plan:
    """The ``Plan`` that ``relax plan`` renders, from a spec as the Python API takes it (a path or a
    preset name with overrides, a mapping, a ``RunSpec``: ``relax.plan.inputs``). It does not ask
    that this machine can run the spec (``relax plan`` shows a cluster's layout anywhere)."""
    from relax.plan.inputs import checked_spec

    checked, folder = checked_spec(spec, overrides, base_dir, runnable=False)
    return make_plan(checked, base_dir=folder)


class _CallablePackage(types.ModuleType):
    """``relax.plan`` is this package and also the Python API's ``relax.plan(spec, overrides)``:
    once any code imports the package, Python binds the name ``relax.plan`` to it, so the package
    itself answers the call (``plan_spec``; ``relax.api.plan`` is the same function)."""

    def __call__(self, spec: Any, overrides: Sequence[str] = (), **options: Any) -> Plan:
        return plan_spec(spec, overrides, **options)


sys.modules[__name__].__class__ = _CallablePackage
