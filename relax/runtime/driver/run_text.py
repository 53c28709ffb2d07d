"""What ``relax run`` says about itself: the banner before anything starts (the run, its output
folder, its mode, where each role runs), the phase line while a built-in model is built, and the
closing summary (steps, wall time, reward first -> last, and where the checkpoints, export, metrics,
report and traces are). A run that explains itself needs no reading of the plan or the folder to
know what it did; every line starts with ``relax run:`` or is indented under one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax.plan import number_ranges
from relax.plan.model import Plan
from relax.spec.architecture import BUILTIN_PREFIX
from relax.spec.models import RunSpec

#: Where the Hugging Face exports of a run with ``trainer.export_every`` go (``step-<n>`` each).
EXPORT_FOLDER = "export"


def worker_lines(plan: Plan) -> list[str]:
    """One line per kind of worker of the plan: the roles it hosts, how many such workers, on which
    nodes and with how many GPUs each (``CPU`` for none). A worker that drives several ranks (an
    actor of dp 4) counts the GPUs of all of them; rollout replicas (``rollout#1`` ...) of the same
    size are counted together, so 64 replicas are one line, not 64."""
    by_rank = {(i.role, i.rank): i for i in plan.instances}
    groups: dict[tuple[str, int, float], list[set[int]]] = {}
    for worker in plan.workers:
        driven = [worker.instance] + [by_rank[(role, rank)] for role, ranks in worker.ranks.items()
                                      for rank in ranks if (role, rank) in by_rank]
        gpus = len({(i.node, g) for i in driven for g in i.gpus})
        fraction = worker.instance.gpu_fraction if not gpus else 0.0
        groups.setdefault((worker.holder.split("#")[0], gpus, fraction), []).append({i.node for i in driven})
    lines = []
    for (holder, gpus, fraction), node_sets in groups.items():
        count = f" x{len(node_sets)}" if len(node_sets) > 1 else ""
        each = " each" if len(node_sets) > 1 else ""
        if gpus:
            device = f"{gpus} GPU{'s' if gpus != 1 else ''}{each}"
        elif fraction:
            device = f"{fraction:g} of a GPU{each}"
        else:
            device = "CPU"
        nodes = set().union(*node_sets)
        lines.append(f"{holder}{count} on node{'s' if len(nodes) > 1 else ''} {number_ranges(nodes)}, {device}")
    return lines


def banner(spec: RunSpec, plan: Plan, output_dir: Path, *, start_step: int = 0) -> str:
    """The lines ``relax run`` prints before it starts anything."""
    gpus = plan.gpus_used
    where = f"{gpus} GPU{'s' if gpus != 1 else ''} on {plan.nodes} node{'s' if plan.nodes != 1 else ''}" \
        if gpus else "CPU"
    total = plan.settings.steps if plan.settings is not None else spec.trainer.steps
    steps = (f"steps {start_step + 1}..{total} (resumed)" if start_step
             else f"{total} step{'s' if total != 1 else ''}")
    if spec.trainer.epochs is not None:
        steps += f" ({spec.trainer.epochs:g} epoch{'s' if spec.trainer.epochs != 1 else ''})"
    lines = [f"relax run: {spec.name}: {spec.algorithm.name}, {plan.mode} mode, {steps}, {where}",
             f"  output   {output_dir}",
             f"  model    {spec.model.path}"]
    lines += [f"  worker   {line}" for line in worker_lines(plan)]
    lines += [f"  note     {hint.text}" for hint in (plan.cores_note, plan.unused_gpus) if hint is not None]
    return "\n".join(lines) + "\n"


def model_phase(spec: RunSpec) -> str | None:
    """The line printed while ``model.path`` is made ready, for a built-in model (which is built,
    seconds to minutes, then cached); None for a folder or a hub id (the workers load those)."""
    if not spec.model.path.startswith(BUILTIN_PREFIX):
        return None
    return f"relax run: building the model {spec.model.path} (cached after the first run)..."


def summary(spec: RunSpec, output_dir: Path, rows: list[dict[str, Any]], wall_s: float) -> str:
    """The closing lines of a run that finished: steps, wall time, reward first -> last and where
    its files are, with the commands that read them."""
    from relax.runtime.checkpoint import CheckpointError, list_checkpoints
    from relax.runtime.driver.report import eval_keys, eval_rows
    from relax.runtime.metrics import EVAL_FILE, METRICS_FILE, format_duration
    from relax.telemetry.jsonl import TRACES_FILE

    head = f"relax run: done: {len(rows)} step{'s' if len(rows) != 1 else ''} in {format_duration(wall_s)}"
    if rows and "reward/mean" in rows[0]:
        head += f"; reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}"
    lines = [head]
    try:
        saved = list_checkpoints(output_dir)
    except CheckpointError:
        saved = []
    if saved:
        lines.append(f"  checkpoints  {saved[-1][1]} (newest of {len(saved)}; resume with --resume)")
    if getattr(spec.trainer, "export_every", None):  # trainer.export_every: Hugging Face exports
        exports = sorted((output_dir / EXPORT_FOLDER).glob("step-*"), key=lambda p: _step_of(p.name))
        if exports:
            lines.append(f"  export       {exports[-1]} (transformers' from_pretrained loads it)")
    lines.append(f"  metrics      {output_dir / METRICS_FILE}")
    evals = eval_rows(output_dir)
    if evals:  # data.eval: the held-out figures of the first and the last version evaluated
        first, last = evals[0], evals[-1]
        figures = ", ".join(f"{key.removeprefix('eval/')} {first[key]:.3f} -> {last[key]:.3f}"
                            for key in eval_keys(evals))
        lines.append(f"  evaluation   {output_dir / EVAL_FILE}: v{first['eval/version']:.0f} -> "
                     f"v{last['eval/version']:.0f}: {figures}")
    lines.append(f"  report       relax report {output_dir}   (reward and step time as a PNG)")
    traces = output_dir / TRACES_FILE
    if traces.is_file():
        lines.append(f"  traces       {traces}   (relax trace {output_dir})")
    return "\n".join(lines) + "\n"


def _step_of(name: str) -> int:
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1
