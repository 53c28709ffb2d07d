"""``relax run``: start (or join) Ray, the bus and the role workers from the Plan, and watch them.

The controller deploys, wires, watches health and stops; it takes no part in the data path. It
joins the roles' per-step reports into metrics.jsonl and the progress line.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.plan.model import Plan, RoleInstance
from relax.runtime.checkpoint import latest_checkpoint
from relax.runtime.metrics import MetricsLog, Progress, step_row
from relax.spec.models import RunSpec

EXIT_OK, EXIT_RUN_FAILED = 0, 1
#: How long a role may wait for another before the run is declared stuck.
ROLE_TIMEOUT_S = float(os.environ.get("RELAX_ROLE_TIMEOUT_S", "300"))
#: Logical CPUs an embedded Ray gets: TransferQueue's own actors need about 5 beyond the roles.
EMBEDDED_RAY_CPUS = 8
ROLES = ("rollout", "reward", "advantage", "actor")
#: Model roles a spec may add (each a block under ``roles``).
OPTIONAL_ROLES = ("reference", "critic", "actor_fwd")
MODEL_ROLES = frozenset({"rollout", "actor", *OPTIONAL_ROLES})
#: Environment of every Ray process of a run: no progress bars or advisory logs from the libraries.
QUIET_ENV = {"RAY_SCHEDULER_EVENTS": "0", "TQ_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "1"}
#: ``module.function`` that every Ray worker process of the run calls before anything else (Ray's
#: ``worker_process_setup_hook``): for process-wide settings a backend needs on an unusual machine,
#: such as a test harness's CPU stand-ins for CUDA calls. Plugins never rely on it.
WORKER_SETUP_ENV = "RELAX_WORKER_SETUP"


class LaunchError(Exception):
    """The run cannot start here; the message says why and what to do."""


def preflight(spec: RunSpec, plan: Plan) -> list[str]:
    """What keeps this spec from running on this machine and runtime, before anything starts."""
    problems = []
    if plan.gpus_used and spec.cluster.address is None:
        import torch

        local = torch.cuda.device_count()
        if local < plan.gpus_used:
            problems.append(f"the spec asks for {plan.gpus_used} GPU(s) but this machine has {local}; run it on a "
                            "GPU cluster (set cluster.address) or choose a CPU preset such as tiny-cpu "
                            "(`relax plan` still shows this spec's layout)")
    for name in ("actor", *OPTIONAL_ROLES):
        if len(plan.instances_of(name)) > 1:
            problems.append(f"roles.{name} spans {len(plan.instances_of(name))} data-parallel ranks; the runtime "
                            "runs one process per model role so far: give it the GPUs of one model copy "
                            "(gpus = tp x pp x cp) or run it on CPU")
    fwd = spec.roles.actor_fwd
    if fwd is not None and spec.placement.mode == "separate":
        from relax.registry import get_registry
        from relax.contracts import PluginKind

        if not hasattr(get_registry().load(PluginKind.trainer, fwd.backend), "load_weights"):
            problems.append(f"roles.actor_fwd.backend {fwd.backend} cannot take weights in memory (no load_weights); "
                            "use the torch backend, or hybrid mode where actor_fwd shares the actor's process")
    for name, replicas in (("rollout", spec.roles.rollout.replicas), ("reward", spec.roles.reward.replicas),
                           ("advantage", spec.roles.advantage.replicas)):
        if replicas != 1:
            problems.append(f"roles.{name}.replicas={replicas}: the runtime runs one {name} worker so far; set 1")
    return problems


@dataclass
class Host:
    """One role worker to start: the roles it hosts and the plan instance whose bundle it takes."""

    roles: list[str]
    instance: RoleInstance
    threads: int


def run_roles(spec: RunSpec) -> list[str]:
    """The roles of a run, in data order (the plan's names)."""
    optional = [name for name in OPTIONAL_ROLES if getattr(spec.roles, name) is not None]
    return [*ROLES, *optional]


def report_names(spec: RunSpec) -> list[str]:
    """The per-step reports the controller waits for: one per role loop (the critic has two)."""
    names = run_roles(spec)
    return names + (["critic_values"] if spec.roles.critic is not None else [])


def plan_hosts(plan: Plan, roles: list[str] | None = None) -> list[Host]:
    """One worker process per planned bundle: roles whose first instances share a bundle share a
    process (colocate's rollout and actor; a rollout and the scorer riding on it; reward and
    advantage), and hand data to each other in memory."""
    cores = os.cpu_count() or 2
    by_bundle: dict[tuple[str, int], list[RoleInstance]] = {}
    for role in roles or ROLES:
        first = plan.instances_of(role)[0]
        by_bundle.setdefault((first.pool, first.bundles[0]), []).append(first)
    model_processes = sum(1 for group in by_bundle.values() if MODEL_ROLES & {i.role for i in group})
    hosts = []
    for group in by_bundle.values():
        roles = [i.role for i in group]
        has_model = bool(MODEL_ROLES & set(roles))
        anchor = next((i for i in group if i.role == "actor"), group[0])
        hosts.append(Host(roles, anchor, max(1, cores // model_processes) if has_model else 1))
    return hosts


def output_path(spec: RunSpec) -> Path:
    """Runs write under the current directory unless output_dir is absolute."""
    return Path(spec.trainer.output_dir).expanduser().resolve()


def resume_point(output_dir: Path, resume: bool) -> tuple[int, Path | None]:
    """Where a run starts: its newest checkpoint with ``--resume``, step 0 otherwise."""
    found = latest_checkpoint(output_dir)
    if resume:
        if found is None:
            raise LaunchError(f"--resume: no checkpoint under {output_dir / 'checkpoints'}; run without --resume "
                              "to start fresh")
        return found
    return 0, None


def keep_previous_run(output_dir: Path) -> Path | None:
    """A fresh run never overwrites an earlier one: its folder is renamed to ``<name>.<n>`` first."""
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return None
    n = 1
    while (kept := output_dir.with_name(f"{output_dir.name}.{n}")).exists():
        n += 1
    output_dir.rename(kept)
    return kept


class Controller:
    """Deploys the workers of one run, joins their reports, and stops them."""

    def __init__(self, spec: RunSpec, plan: Plan, base_dir: Path, output_dir: Path, model_path: str,
                 start_step: int, resume_from: Path | None, stream: Any = None) -> None:
        self.spec, self.plan, self.base_dir, self.output_dir = spec, plan, base_dir, output_dir
        self.model_path = model_path
        self.start_step, self.resume_from = start_step, resume_from
        self.progress = Progress(spec.trainer.steps, stream)
        self.metrics = MetricsLog(output_dir, start_step if resume_from else None)

    def run(self) -> int:
        import ray

        from relax.bus import Bus
        from relax.runtime.placement import create_placement
        from relax.runtime.run_state import RunState
        from relax.runtime.workers import RoleWorker

        from relax.telemetry import StepMetricsExporter, Telemetry

        spec = self.spec.model_copy(deep=True)
        spec.trainer.output_dir = str(self.output_dir)
        spec_hash = hashlib.sha256(self.spec.model_dump_json().encode()).hexdigest()[:16]
        telemetry = Telemetry.from_spec(spec, self.output_dir, role="controller", spec_hash=spec_hash)
        step_metrics = StepMetricsExporter.from_spec(spec, spec_hash=spec_hash)
        bus = Bus.start(num_storage_units=1)
        placement = create_placement(self.plan)
        state = ray.remote(RunState).options(num_cpus=0, max_concurrency=64).remote()
        workers = []
        try:
            with telemetry.run_span(steps=spec.trainer.steps, start_step=self.start_step, mode=self.plan.mode) as run:
                for host in plan_hosts(self.plan, run_roles(spec)):
                    options = placement.actor_options(host.instance)
                    worker = ray.remote(RoleWorker).options(**options, max_concurrency=2).remote(
                        spec, str(self.base_dir), self.model_path, host.roles, state, self.start_step,
                        str(self.resume_from) if self.resume_from else None, host.threads, ROLE_TIMEOUT_S,
                        run.carrier(), spec_hash)
                    workers.append(worker)
                ray.get([w.ready.remote() for w in workers], timeout=ROLE_TIMEOUT_S)
                runs = [w.run.remote(self.start_step) for w in workers]
                self._watch(state, runs, telemetry, step_metrics)
                ray.get(runs)
            return EXIT_OK
        finally:
            ray.wait([w.close.remote() for w in workers], num_returns=len(workers), timeout=30)
            for worker in workers:
                ray.kill(worker)
            placement.remove()
            bus.close()
            telemetry.shutdown()
            step_metrics.shutdown()

    def _watch(self, state: Any, runs: list[Any], telemetry: Any, step_metrics: Any) -> None:
        import ray

        last_end = time.time()
        for step in range(self.start_step, self.spec.trainer.steps):
            while True:
                reports = ray.get(state.wait_reports.remote(step, report_names(self.spec), 1.0))
                if reports:
                    break
                finished, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
                for ref in finished:
                    ray.get(ref)  # raises the role's failure
                if finished and len(finished) == len(runs):
                    raise RuntimeError(f"every role stopped before step {step + 1} was reported")
            end = reports["actor"]["end_time"]
            row = step_row(step + 1, reports, end - last_end)
            last_end = end
            self.metrics.append(row)
            self.progress.update(row)
            telemetry.record_step(step, min(r["started_at"] for r in reports.values()), end,
                                  staleness=row["staleness/max"], tokens=reports["rollout"]["response_tokens"])
            step_metrics.export(row)


def _init_ray(spec: RunSpec) -> bool:
    """Start an embedded Ray (returns True) or join ``cluster.address`` (False)."""
    import ray

    os.environ.update(QUIET_ENV)
    if ray.is_initialized():
        return False
    runtime_env: dict[str, Any] = {"env_vars": dict(QUIET_ENV)}
    if hook := os.environ.get(WORKER_SETUP_ENV):
        runtime_env["worker_process_setup_hook"] = hook
        runtime_env["env_vars"][WORKER_SETUP_ENV] = hook
    if spec.cluster.address is None:
        # address="local" always starts a new Ray, even when another one runs on this machine.
        ray.init(address="local", num_cpus=EMBEDDED_RAY_CPUS, num_gpus=0, include_dashboard=False,
                 logging_level="ERROR", runtime_env=runtime_env)
        return True
    ray.init(address=spec.cluster.address, logging_level="ERROR", runtime_env=runtime_env)
    return False


def run_spec(spec: RunSpec, plan: Plan, *, base_dir: Path, resume: bool = False, stream: Any = None) -> int:
    """Train ``spec`` as ``plan`` lays it out; 0 on success, 1 when the run fails or cannot start."""
    problems = preflight(spec, plan)
    if problems:
        print("relax run: this spec cannot run here:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return EXIT_RUN_FAILED
    output_dir = output_path(spec)
    try:
        start_step, resume_from = resume_point(output_dir, resume)
    except LaunchError as exc:
        print(f"relax run: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    if start_step >= spec.trainer.steps:
        print(f"relax run: the checkpoint is at step {start_step}, trainer.steps is {spec.trainer.steps}: nothing to do")
        return EXIT_OK
    if resume_from is None and (kept := keep_previous_run(output_dir)) is not None:
        print(f"relax run: {output_dir} held an earlier run; it is kept as {kept}", file=sys.stderr)
    from relax.runtime.components import materialize_model

    model_path = materialize_model(spec, base_dir)  # once, here, before any worker needs it
    import ray

    embedded = _init_ray(spec)
    try:
        controller = Controller(spec, plan, base_dir, output_dir, model_path, start_step, resume_from, stream)
        return controller.run()
    except KeyboardInterrupt:
        print("relax run: interrupted; the last checkpoint is kept for --resume", file=sys.stderr)
        return EXIT_RUN_FAILED
    except Exception as exc:  # a role failed: report its cause, not the controller's traceback
        cause = getattr(exc, "cause", None) or exc  # a role's exception arrives wrapped by Ray
        lines = str(cause).strip().splitlines() or [repr(cause)]
        print(f"relax run: the run failed: {lines[0]}", file=sys.stderr)
        if os.environ.get("RELAX_DEBUG"):
            print(str(exc), file=sys.stderr)
        return EXIT_RUN_FAILED
    finally:
        if embedded:
            ray.shutdown()
