"""Render a Plan as a table, JSON, Graphviz DOT or Mermaid."""

from __future__ import annotations

import json
from collections import defaultdict

from relax.config.redaction import NONE as NO_REDACTIONS
from relax.config.redaction import Redactions
from relax.plan.model import DeviceMemory, MemoryItem, Plan, RoleWiring, WorkerPlan
from relax.roles import EVALUATION, Role


def _human_params(n: int | None) -> str:
    if n is None:
        return "unknown size"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit} params"
    return f"{n} params"


def _engines(plan: Plan, worker: WorkerPlan) -> str:
    """Where each rank of a colocated actor and its rollout engine run: ``rank 0 gpu0, rank 1 gpu1``."""
    return ", ".join(f"rank {i.rank} " + (f"gpu{','.join(map(str, i.gpus))}" if i.gpus else f"cpu[{i.bundles[0]}]")
                     for i in plan.instances_of(Role.actor))


def _instance_label(role: str, ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"{role}[{ranks[0]}]"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{role}[{ranks[0]}..{ranks[-1]}]"
    return f"{role}x{len(ranks)}"


def _loop_line(loop: RoleWiring) -> str:
    """One role loop of a worker: its plugins, where its rows come from and where they go."""
    plugins = [f"{p.kind}:{p.name}" for p in loop.plugins] + [f"rewards:{r.plugin.name}" for r in loop.rewards]
    parts = [f"{loop.task:<14} {' '.join(plugins) or '-'}"]
    if loop.takes_from:
        parts.append(f"reads {','.join(loop.reads)} (from {loop.takes_from} in memory)")
    elif loop.reads:
        parts.append(f"reads {','.join(loop.reads)} (bus, after {','.join(loop.waits_for)})")
    elif loop.task != EVALUATION:  # an evaluation worker reads only data.eval, said below
        parts.append("reads the data set")
    if loop.writes:
        parts.append(f"writes {','.join(loop.writes)} ({f'to {loop.hands_to} in memory' if loop.hands_to else 'bus'})")
    if loop.evaluation is not None:
        rewards = [r.plugin.name for r in loop.evaluation_rewards]
        parts.append(f"evaluates on data.eval ({loop.evaluation.kind}:{loop.evaluation.name}"
                     f"{', scored with ' + ','.join(rewards) if rewards else ''})")
    if loop.weights_in:
        parts.append(f"weights in: {loop.weights_in}")
    if loop.weights_out:
        parts.append(f"weights out: {', '.join(loop.weights_out)}")
    return "; ".join(parts)


def render_table(plan: Plan) -> str:
    """Per node and GPU: the roles there and the estimated memory; then pools, bus and sync."""
    lines = [f"Plan for {plan.run}: {plan.mode} mode, {plan.nodes} node(s) x {plan.gpus_per_node} GPU(s), "
             f"{plan.gpus_used} GPU(s) used, model {plan.model} ({_human_params(plan.model_params)})"]
    if plan.settings is not None:
        settings = plan.settings
        length = f"{settings.steps} training step(s)"
        if settings.epochs is not None:
            length += (f" (trainer.epochs={settings.epochs:g} over the training set, "
                       f"{settings.prompts_per_step} prompts a step)")
        lines.append(f"Run: {length}")
        lines.append(f"Rollout sampler: {settings.sampler}")
    lines.append("")
    lines.append("Pools (Ray placement groups):")
    for pool in plan.pools:
        gpus = pool.gpu_count
        lines.append(f"  {pool.name:<10} {pool.strategy:<11} {len(pool.bundles):>4} bundle(s) "
                     f"{gpus:>4} GPU(s)  roles: {', '.join(pool.roles)}")
    if plan.rollout_max_replicas:
        planned = len(plan.instances_of("rollout"))
        lines.append(f"  rollout: elastic up to {plan.rollout_max_replicas} replicas ({planned} planned; "
                     "`relax scale RUN_DIR rollout=N` adds or removes replicas mid-run)")
    lines += ["", "Placement and memory (GiB):"]
    where: dict[tuple[int, int | None], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for inst in plan.instances:
        for gpu in inst.gpus or [None]:
            where[(inst.node, gpu)][inst.role].append(inst.rank)
    memory = {(d.node, d.gpu): d for d in plan.memory}
    lines.append(f"  {'node':>4}  {'device':<6}  {'roles':<44}  {'peak':>8}  {'capacity':>8}  phases")
    for (node, gpu) in sorted(where, key=lambda k: (k[0], k[1] is None, k[1] or 0)):
        roles = ", ".join(_instance_label(r, ranks) for r, ranks in where[(node, gpu)].items())
        dev = memory.get((node, gpu))
        peak = f"{dev.peak_gib:8.2f}" if dev else f"{'-':>8}"
        cap = f"{dev.capacity_gib:8.0f}" if dev and dev.capacity_gib else f"{'host':>8}"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in dev.phases.items()) if dev else ""
        device = f"gpu{gpu}" if gpu is not None else "cpu"
        lines.append(f"  {node:>4}  {device:<6}  {roles:<44}  {peak}  {cap}  {phases}")
        lines += [f"{'':>16}{line}" for line in _memory_contents(dev)] if dev else []
    lines += ["", "Workers (one process each; loops in the order they run a step):"]
    for worker in plan.workers:
        gpus = f"gpu {','.join(map(str, worker.instance.gpus))}" if worker.instance.gpus else "cpu"
        ranks = "".join(f"; {role} ranks {len(r)}" for role, r in worker.ranks.items())
        if worker.engine_per_rank:
            ranks += f", a rollout engine in each ({_engines(plan, worker)})"
        lines.append(f"  {worker.holder:<28} {worker.pool}[{worker.bundle}] node {worker.instance.node} {gpus}, "
                     f"{worker.threads} thread(s){ranks}")
        for loop in worker.roles:
            lines.append(f"    {_loop_line(loop)}")
    lines += ["", "Bus fields (writer -> readers):"]
    for f in plan.bus:
        lines.append(f"  {f.name:<18} {f.writer} -> {', '.join(f.readers)}")
    lines += ["", "Weight sync:"]
    for e in plan.weight_sync:
        size = "" if e.bytes_per_sync is None else \
            f", {_byte_text(e.bytes_per_sync)} per sync{', LoRA adapter only' if e.adapter_only else ''}"
        lines.append(f"  {e.source} -> {e.target} ({e.mechanism}{size})")
    st = plan.staleness
    lines += ["", f"Staleness: max_staleness {st.max_staleness}, correction {st.correction}: {st.rule}"]
    lines.append("  " + "; ".join(f"step {w.step}: versions {w.min_version}..{w.max_version}" for w in st.first_steps))
    lines += ["", *(f"Note: {n}" for n in plan.notes)]
    return "\n".join(lines) + "\n"


def _role_groups(plan: Plan) -> dict[str, dict[str, int]]:
    """pool -> role -> instance count."""
    groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for inst in plan.instances:
        groups[inst.pool][inst.role] += 1
    return groups


def _edges(plan: Plan) -> list[tuple[str, str, str, bool]]:
    """(source role, target role, label, is_weight_sync)."""
    by_pair: dict[tuple[str, str], list[str]] = defaultdict(list)
    for f in plan.bus:
        for reader in f.readers:
            by_pair[(f.writer, reader)].append(f.name)
    edges = [(a, b, ", ".join(names), False) for (a, b), names in by_pair.items()]
    edges += [(e.source, e.target, f"weights ({e.mechanism})", True) for e in plan.weight_sync]
    return edges


def render_dot(plan: Plan) -> str:
    lines = [f'digraph "{plan.run}" {{', "  rankdir=LR;", '  node [shape=box, style=rounded];']
    for pool, roles in _role_groups(plan).items():
        lines.append(f'  subgraph "cluster_{pool}" {{')
        lines.append(f'    label="pool {pool}";')
        for role, count in roles.items():
            lines.append(f'    "{role}" [label="{role} x{count}"];')
        lines.append("  }")
    for a, b, label, weights in _edges(plan):
        style = ", style=dashed, color=red" if weights else ""
        lines.append(f'  "{a}" -> "{b}" [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_mermaid(plan: Plan) -> str:
    lines = ["flowchart LR"]
    for pool, roles in _role_groups(plan).items():
        lines.append(f"  subgraph pool_{pool}[pool {pool}]")
        for role, count in roles.items():
            lines.append(f'    {role}["{role} x{count}"]')
        lines.append("  end")
    for a, b, label, weights in _edges(plan):
        arrow = "-.->" if weights else "-->"
        lines.append(f'  {a} {arrow}|"{label}"| {b}')
    return "\n".join(lines) + "\n"


def _memory_contents(dev: DeviceMemory) -> list[str]:
    """What each role keeps on one device, in GiB, one line per role: what it holds for the whole
    run (weights, optimizer state), then what it frees between uses (gradients, activations,
    logits, KV cache), which roles sharing the device hold in turn."""
    by_role: dict[str, list[MemoryItem]] = defaultdict(list)
    for item in dev.items:
        by_role[item.role].append(item)
    lines = []
    for role, items in by_role.items():
        held = ", ".join(f"{i.what} {i.gib:.2f}" for i in items if not i.transient) or "nothing"
        freed = ", ".join(f"{i.what} {i.gib:.2f}" for i in items if i.transient)
        lines.append(f"{role}: {held}" + (f"; transient: {freed}" if freed else ""))
    return lines


def render(plan: Plan, fmt: str = "table", redactions: Redactions | None = None) -> str:
    """The plan in one of: table, json, dot, mermaid. ``redactions`` (the spec's, see
    ``relax.config.redaction``): plugin options hold what the spec gave them, so a value taken
    from the environment is shown as its expression and a credential named as such is redacted;
    the plan itself, which the workers are built from, keeps the real values."""
    redactions = redactions or NO_REDACTIONS
    if fmt == "json":
        data = plan.model_dump(mode="json")
        shown = redactions.data_view(data)
        if shown == data:  # pydantic's own JSON, as before
            return plan.model_dump_json(indent=2) + "\n"
        return json.dumps(shown, indent=2, ensure_ascii=False) + "\n"
    if fmt == "dot":
        return redactions.text_view(render_dot(plan))
    if fmt == "mermaid":
        return redactions.text_view(render_mermaid(plan))
    return redactions.text_view(render_table(plan))


def _byte_text(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1 (``12.5 MiB``)."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
