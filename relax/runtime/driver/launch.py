"""``relax run``: check the spec against this runtime and machine, start (or join) Ray, and hand the run to
its controller (``relax.runtime.driver.controller``), which deploys, watches, recovers and stops it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relax.environment import temporarily_set
from relax.errors import SpecIssue
from relax.plan.model import Plan
from relax.runtime.checkpoint import CheckpointError, list_checkpoints, resume_checkpoint
from relax.spec.models import RunSpec

EXIT_OK, EXIT_RUN_FAILED, EXIT_INVALID = 0, 1, 2
#: Ctrl-C (SIGINT) or SIGTERM: the run stopped gracefully, its last checkpoint is kept (128 + SIGINT,
#: the shell's convention for a process ended by Ctrl-C).
EXIT_INTERRUPTED = 130
#: The file a run writes first into its output folder: only a folder holding it is taken for an
#: earlier run (and renamed to keep it); any other non-empty folder is the user's, never touched.
RUN_MARKER = ".relax-run"
#: Spec fields that give a checkpoint its meaning: a resume with other values is refused.
RESUME_FIXED = ("algorithm", "model.path", "model.options", "trainer.backend")
#: Logical CPUs an embedded Ray gets: TransferQueue's own actors need about 5 beyond the roles.
EMBEDDED_RAY_CPUS = 8
#: Environment of every Ray process of a run: no progress bars or advisory logs from the libraries.
QUIET_ENV = {"RAY_SCHEDULER_EVENTS": "0", "TQ_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "1"}
#: Environment of an embedded Ray's processes (set before ``ray.init`` starts them): no per-call
#: task events for Ray's state API and dashboard, and no Ray metrics export, neither of which an
#: embedded run exposes. Every actor call otherwise records an event in both processes and the
#: events go on to the GCS: on two cores that was about a tenth of a tiny separate-mode step
#: (68-70 ms against 61-62 ms per step, measured in two alternating pairs).
#: And workers at the priority of the command that started the run: Ray starts its workers at nice
#: 15 (``RAY_worker_niceness``), so that its own daemons stay responsive on a shared cluster, but on
#: a user's machine that hands the run's every worker to whatever else is busy. With two busy
#: processes beside a tiny colocated run on the 2-core box, a step took 28 s at nice 15 against
#: 0.10-0.11 s at the driver's priority (0.03 s on an idle machine), while the plugins' loop in one
#: process only slowed from 0.030 to 0.042 s.
#: And no routing probe: a Ray process that has not joined the node yet (the runtime-env agent) asks
#: for its node's address with a UDP ``connect`` to 8.8.8.8:53 (no datagram is sent, but it is an
#: attempt at another machine, and the answer is not the loopback the node listens on). With
#: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` Ray's ``get_node_ip_address`` answers the localhost
#: address instead, as on a laptop (``ray._private.services``; read in Ray 2.60). The variable only
#: decides how a process that is not yet part of a node finds its address, which for an embedded
#: Ray on loopback is loopback; ``ray start`` for a cluster never sees it.
EMBEDDED_RAY_ENV = {"RAY_task_events_report_interval_ms": "0", "RAY_enable_metrics_collection": "0",
                    "RAY_worker_niceness": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: What a user's own environment sets wins over ``EMBEDDED_RAY_ENV`` (a deliberately nice run).
USER_KEPT_ENV = ("RAY_worker_niceness",)
#: What the driver needs once Ray runs (torch, TransferQueue, telemetry, the controller): imported
#: in a background thread while Ray starts, since ``ray.init`` mostly waits for its own processes.
RUNTIME_MODULES = ("relax.telemetry", "relax.runtime.driver.placement", "relax.runtime.driver.control",
                   "relax.runtime.driver.controller", "relax.runtime.state.run_state", "relax.runtime.state.ledger",
                   "relax.runtime.worker.workers")
#: ``module.function`` that every Ray worker process of the run calls before anything else (Ray's
#: ``worker_process_setup_hook``): for process-wide settings a backend needs on an unusual machine,
#: such as a test harness's CPU stand-ins for CUDA calls. Plugins never rely on it.
WORKER_SETUP_ENV = "RELAX_WORKER_SETUP"
#: The one address an embedded Ray listens on: a run on one machine is reachable from it alone.
LOOPBACK = "127.0.0.1"


class LaunchError(Exception):
    """The run cannot start here; the message says why and what to do."""


class OutputFolderError(LaunchError):
    """The output folder or the checkpoint to resume from cannot be used as it is (exit 2, like a
    bad spec): nothing was touched; the message names the folder and what to do."""


def preflight(spec: RunSpec, base_dir: Path) -> list[SpecIssue]:
    """What keeps this spec from running with this runtime on this machine, before anything starts:
    exactly the checks of ``relax validate`` (``validate_spec(..., runnable=True)``), so that the
    two cannot disagree. Empty when it can run."""
    from relax.spec import SpecError, check_spec

    try:
        check_spec(spec, base_dir=base_dir, runnable=True)
    except SpecError as exc:
        return exc.issues
    return []


def output_path(spec: RunSpec) -> Path:
    """Runs write under the current directory unless output_dir is absolute (``OutputFolderError``
    when the path is a file)."""
    path = Path(spec.trainer.output_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise OutputFolderError(f"trainer.output_dir {path} is a file, not a folder; choose another "
                                "trainer.output_dir")
    return path


def resume_point(output_dir: Path, resume: bool) -> tuple[int, Path | None]:
    """Where a run starts: with ``--resume``, its newest checkpoint whose step has its metrics row
    (step 0 when none has, see ``resume_checkpoint``); step 0 otherwise. Checkpoints are read only
    for ``--resume``: a fresh run renames the old folder whatever it holds."""
    if not resume:
        return 0, None
    try:
        found = resume_checkpoint(output_dir)
        saved = list_checkpoints(output_dir)
    except CheckpointError as exc:
        raise OutputFolderError(f"--resume: {exc}") from None
    if found is None and not saved:
        raise LaunchError(f"--resume: no checkpoint under {output_dir / 'checkpoints'}; run without --resume "
                          "to start fresh")
    if found is None:
        print(f"relax run: --resume: the checkpoint at step {saved[-1][0]} has no row in metrics.jsonl (the run "
              "stopped before it wrote it); resuming from it would leave steps out, so the run starts over "
              "from step 0", file=sys.stderr)
        return 0, None
    return found


def run_inputs(spec: RunSpec, base_dir: Path) -> tuple[tuple[str, Path], ...]:
    """The files and folders this run reads, by spec field (``model.path``, the data files, the chat
    template), resolved as the run resolves them; plugin names (``builtin:...``, ``synthetic:...``)
    and hub ids that are no local path are left out."""
    from relax.spec.data_files import data_path

    named = [("model.path", spec.model.path), ("data.train.source", spec.data.train.source),
             ("data.chat_template", spec.data.chat_template)]
    if spec.data.eval is not None:
        named.append(("data.eval.source", spec.data.eval.source))
    found = []
    for field, value in named:
        if not isinstance(value, str) or ":" in value.split("/")[0] or value in ("auto", "none"):
            continue
        path = data_path(value, base_dir)
        if path.exists():
            found.append((field, path.resolve()))
    return tuple(found)


def keep_previous_run(output_dir: Path, protected: tuple[Path, ...] = (),
                      inputs: tuple[tuple[str, Path], ...] = ()) -> Path | None:
    """A fresh run never overwrites an earlier one: its folder is renamed to ``<name>.<n>`` first.
    Only a folder that Relax wrote (it holds ``RUN_MARKER``) is renamed, and never one that holds a
    ``protected`` path (the current directory, the spec's folder) or one of the run's own ``inputs``
    (``run_inputs``: renaming it would move the model or data out from under the run); any other
    non-empty folder is refused with ``OutputFolderError`` and left as it is."""
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return None
    if not (output_dir / RUN_MARKER).is_file():
        raise OutputFolderError(f"trainer.output_dir {output_dir} is not empty and was not written by a Relax run "
                                f"(it has no {RUN_MARKER} file); Relax touches nothing in it. Choose another "
                                "trainer.output_dir (e.g. runs/<name>), or empty that folder")
    for inner in protected:
        if inner == output_dir or output_dir in inner.parents:
            raise OutputFolderError(f"trainer.output_dir {output_dir} holds an earlier run, but also {inner} (the "
                                    "current directory or the spec's folder), so Relax will not rename it to keep "
                                    "the earlier run. Choose a trainer.output_dir of its own (e.g. runs/<name>), "
                                    "or remove the earlier run's files")
    for field, inner in inputs:
        if inner == output_dir or output_dir in inner.parents:
            raise OutputFolderError(f"trainer.output_dir {output_dir} holds an earlier run, but also {field} "
                                    f"{inner}, an input of this run, so Relax will not rename it to keep the earlier "
                                    "run (the run would lose its input). Choose another trainer.output_dir (e.g. "
                                    f"runs/<name>), or move {inner} out of that folder")
    n = 1
    while (kept := output_dir.with_name(f"{output_dir.name}.{n}")).exists():
        n += 1
    output_dir.rename(kept)
    return kept


def resume_mismatch(output_dir: Path, spec: RunSpec) -> list[str]:
    """The ``RESUME_FIXED`` fields on which ``spec`` differs from the run's saved ``spec.yaml``, as
    ``field: saved -> new`` lines (empty when they agree, or when the run saved no spec)."""
    import yaml

    from relax.config.bounded_yaml import LimitExceeded, load_yaml

    saved_path = output_dir / "spec.yaml"
    if not saved_path.is_file():
        return []
    try:
        saved = load_yaml(saved_path.read_text(encoding="utf-8"))
    except (LimitExceeded, yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        return [f"the saved {saved_path} cannot be read, so the checkpoints' spec is unknown "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"]
    from relax.config.redaction import spec_view

    new = spec_view(spec)  # as spec.yaml was written: expressions, not the environment's values
    differ = []
    for field in RESUME_FIXED:
        before, after = _dotted(saved, field), _dotted(new, field)
        if before != after:
            differ.extend(_differences(field, before, after))
    return differ


def _dotted(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _differences(path: str, before: Any, after: Any) -> list[str]:
    """``path: before -> after`` for each leaf that differs (mappings are compared key by key)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [line for key in sorted(set(before) | set(after), key=str)
                for line in _differences(f"{path}.{key}", before.get(key), after.get(key))]
    return [f"{path}: {json.dumps(before)} -> {json.dumps(after)}"] if before != after else []


#: The bus's module (torch, TransferQueue, tensordict): imported beside the runtime only for a run
#: that moves rows over the bus (``relax.bus`` itself loads its names lazily).
BUS_MODULE = "relax.bus.bus"


def import_runtime(plan: Plan) -> None:
    """Import ``RUNTIME_MODULES``, and the bus when the plan uses one (run in a background thread
    while Ray starts)."""
    import importlib

    for name in (*RUNTIME_MODULES, *([BUS_MODULE] if plan.bus else [])):
        importlib.import_module(name)


def bus_environment() -> None:
    """TransferQueue reads ``TQ_NUM_THREADS`` once, at import, and warns on every put and get when it
    exceeds the physical cores; its actors see it only if it is set before ``ray.init`` starts the
    raylet. ``relax.bus.deployment`` sets the same default when it is imported, which now happens
    while Ray starts, so the driver sets it first."""
    import psutil

    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))


def _init_ray(spec: RunSpec) -> bool:
    """Start an embedded Ray (returns True) or join ``cluster.address`` (False). An embedded Ray
    listens on loopback alone (``_loopback_node``); a joined cluster keeps the ports and addresses it
    was started with (docs/security.md)."""
    import ray

    os.environ.update(QUIET_ENV)
    bus_environment()
    if ray.is_initialized():
        return False
    hook = os.environ.get(WORKER_SETUP_ENV)
    if spec.cluster.address is None:
        # address="local" always starts a new Ray, even when another one runs on this machine. Its
        # processes inherit this environment, so the run needs no runtime_env of its own, and without
        # one Ray hands the actors the worker processes it prestarts (each saves a Python start and
        # `import ray`); a worker setup hook does need one.
        with _loopback_node(), lean_head_node(), temporarily_set(embedded_ray_env()):
            ray.init(address="local", num_cpus=EMBEDDED_RAY_CPUS, num_gpus=embedded_ray_gpus(spec),
                     include_dashboard=False,
                     logging_level="ERROR", runtime_env=_runtime_env(hook) if hook else None,
                     _node_ip_address=LOOPBACK)
        _check_loopback()
        return True
    ray.init(address=spec.cluster.address, logging_level="ERROR", runtime_env=_runtime_env(hook))
    return False


def embedded_ray_env() -> dict[str, str]:
    """``EMBEDDED_RAY_ENV``, with the values of ``USER_KEPT_ENV`` this environment sets itself."""
    return {**EMBEDDED_RAY_ENV, **{k: os.environ[k] for k in USER_KEPT_ENV if k in os.environ}}


def embedded_ray_gpus(spec: RunSpec) -> int | None:
    """The GPUs an embedded Ray offers: none for a CPU spec, so a CPU run on a GPU machine leaves the
    GPUs alone; for a spec that asks for GPUs, ``None``: Ray counts this machine's own, and
    ``cluster_nodes`` then says plainly when there are fewer than ``cluster.gpus_per_node``. (A
    fixed 0 here once made every GPU spec fail placement on a one-machine run without a cluster.)"""
    return None if spec.cluster.gpus_per_node > 0 else 0


#: Ray's head-node processes that an embedded run never uses (``lean_head_node``).
_SKIPPED_HEAD_PROCESSES = ("start_api_server", "start_monitor")


@contextmanager
def lean_head_node() -> Iterator[None]:
    """Let ``ray.init`` start a local Ray without its dashboard head and autoscaler monitor.

    Nothing in an embedded run talks to them: the dashboard head serves Ray's dashboard, job
    submission and state API (``include_dashboard=False`` only trims it to its usage-stats module,
    and ``ray.init`` still waits for it to come up before it starts the raylet), and the monitor
    runs the autoscaler of a one-machine Ray whose resources are fixed. Without them ``ray.init``
    took 2.0-3.7 s against 4.1-6.3 s on the 2-core box (alternating runs), with two Python
    processes fewer (about 1.3 s of CPU at start-up) and no dashboard HTTP listener. What an embedded
    run loses is Ray's own ``ray status`` and ``ray list`` against it; a run that joins a Ray
    started with ``ray start`` (``cluster.address``) keeps all of it. A Ray whose internals moved
    (the two ``Node`` methods are gone) starts as it always did."""
    from ray._private.node import Node  # Ray's own class; without it the processes start as usual

    methods = {name: getattr(Node, name, None) for name in _SKIPPED_HEAD_PROCESSES}
    if None in methods.values():
        yield
        return
    for name in methods:
        setattr(Node, name, lambda self, **_: None)
    try:
        yield
    finally:
        for name, method in methods.items():
            setattr(Node, name, method)


@contextmanager
def _loopback_node() -> Iterator[None]:
    """Let ``ray.init`` keep ``_node_ip_address="127.0.0.1"``. Ray rewrites a loopback node address
    to the machine's routable one (``services.resolve_ip_for_localhost``), and its processes bind
    every interface unless their node address is loopback: with it, the GCS, the raylet and object
    manager, every worker and the dashboard and runtime-env agents listen on 127.0.0.1 alone, and an
    embedded run, which has one node, needs nothing more. Undone once Ray has started."""
    from ray._private import services  # Ray's own helper; _check_loopback says so if it ever moves

    original = getattr(services, "resolve_ip_for_localhost", None)
    if original is None:
        yield
        return
    services.resolve_ip_for_localhost = lambda host: host if host == LOOPBACK else original(host)
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


def _check_loopback() -> None:
    """Say so when the embedded Ray did not come up on loopback (a Ray that changed its internals):
    the run works, but its ports are open to the network."""
    import ray

    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        print(f"relax run: warning: this Ray ({ray.__version__}) started its node on {address}, not {LOOPBACK}: its "
              "ports listen on every interface without authentication; keep the machine off untrusted networks "
              "(docs/security.md)", file=sys.stderr)


def _runtime_env(hook: str | None) -> dict[str, Any]:
    """The run's ``runtime_env`` where Ray's processes do not inherit this environment (a cluster
    joined by address) or must run a worker setup hook."""
    runtime_env: dict[str, Any] = {"env_vars": dict(QUIET_ENV)}
    if hook:
        runtime_env["worker_process_setup_hook"] = hook
        runtime_env["env_vars"][WORKER_SETUP_ENV] = hook
    return runtime_env


def stop_embedded_ray() -> None:
    """``ray.shutdown()`` of the Ray this run started. ``lean_head_node`` starts it without an
    autoscaler monitor; should one run anyway (a Ray whose internals moved), it is killed first:
    Ray asks it to exit, which it does not do on SIGTERM, and waits a full second before it kills
    it, and it has nothing to save on a one-machine Ray."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # Ray's own handle on the processes it started
    try:
        if node is not None and node.is_head():
            node.kill_monitor(check_alive=False)
    except Exception:  # noqa: BLE001  (a Ray internal; should it change, the shutdown only takes longer)
        pass
    ray.shutdown()


def _session_dir() -> str:
    """The folder of the Ray session this driver started (Ray's own handle on it)."""
    import ray

    return ray._private.worker._global_node.get_session_dir_path()


def write_run_record(output_dir: Path, spec: RunSpec, plan: Plan) -> None:
    """What this run executes, in its folder: ``plan.json`` (the very plan the workers are built
    from, as ``relax plan --format json`` prints it) and ``spec.yaml`` (the spec with every default
    and override resolved: ``relax run spec.yaml`` repeats the run)."""
    from omegaconf import OmegaConf

    from relax.plan import render

    output_dir.mkdir(parents=True, exist_ok=True)
    marker = {"name": spec.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}
    (output_dir / RUN_MARKER).write_text(json.dumps(marker) + "\n")
    from relax.config.redaction import redactions_of, spec_view

    # Neither file holds a secret: values taken from the environment are written as their
    # ${oc.env:...} expressions (which resolve again on `relax run spec.yaml`), credentials named
    # as such as <redacted> (relax.config.redaction, docs/security.md).
    (output_dir / "plan.json").write_text(render(plan, "json", redactions_of(spec)))
    (output_dir / "spec.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(spec_view(spec))))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the run stops exactly as on Ctrl-C."""


def stop_on_sigterm() -> Any:
    """Make SIGTERM stop the run like Ctrl-C (``Terminated``), in the main thread only. ``ray.init``
    installs a handler of its own (``sys.exit``), which skips the run's shutdown and ends in a native
    abort, so this is called after it. A second SIGTERM while the run shuts down is ignored: the
    shutdown is what stops the run's processes. Returns the handler it replaced."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("SIGTERM")

    return signal.signal(signal.SIGTERM, terminated)


def interrupted_hint(exc: KeyboardInterrupt, resume_command: str, output_dir: Path) -> str:
    """The last line of a run stopped by Ctrl-C or SIGTERM: what stopped it and how to go on."""
    what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    found = resume_checkpoint(output_dir)
    if found is None:
        return f"relax run: {what}; no checkpoint was written yet: run `{resume_command}` again to start over"
    return (f"relax run: {what}; the run stopped at its checkpoint of step {found[0]}, which is kept: "
            f"resume with `{resume_command} --resume`")


def _resume_command() -> str:
    """The command line that started this run, for the resume hint (``relax run ...``)."""
    args = [a for a in sys.argv[1:] if a != "--resume"]
    if args[:1] == ["run"]:
        import shlex

        return "relax " + " ".join(shlex.quote(a) for a in args)
    return "relax run SPEC"


def closing_summary(spec: RunSpec, output_dir: Path, start_step: int, wall_s: float) -> str:
    """``run_text.summary`` of this run's rows (the steps after ``start_step``)."""
    from relax.runtime.driver.run_text import summary
    from relax.runtime.metrics import read_metrics

    try:
        rows = [row for row in read_metrics(output_dir) if row.get("step", 0) > start_step]
    except (FileNotFoundError, ValueError):
        rows = []
    return summary(spec, output_dir, rows, wall_s)


def run_spec(spec: RunSpec, plan: Plan, *, base_dir: Path, resume: bool = False, stream: Any = None) -> int:
    """Train ``spec`` as ``plan`` lays it out; 0 on success, 1 when the run fails or cannot start,
    130 (``EXIT_INTERRUPTED``) when Ctrl-C or SIGTERM stopped it. The last line printed names the
    cause; it is printed once the run's Ray is down, so no forwarded worker output follows it."""
    from relax.runtime.startup import InBackground, StartupClock, process_started_at

    clock = StartupClock(process_started_at())
    began = time.time()
    clock.mark("imports")  # the command line until here: imports, validation, the plan
    problems = preflight(spec, base_dir)
    if problems:
        print("relax run: this spec cannot run here:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return EXIT_RUN_FAILED
    try:
        output_dir = output_path(spec)
        start_step, resume_from = resume_point(output_dir, resume)
        if resume_from is not None and (differ := resume_mismatch(output_dir, spec)):
            raise OutputFolderError(
                f"--resume: this spec differs from the one the checkpoints in {output_dir} were trained with, "
                "on fields that give them their meaning:\n" + "\n".join(f"  - {line}" for line in differ)
                + "\nresume with the run's own spec.yaml (changing trainer.steps and the like is fine), or choose "
                "another trainer.output_dir to start a new run")
        steps = plan.settings.steps if plan.settings is not None else spec.trainer.steps
        if start_step >= steps:
            print(f"relax run: the checkpoint is at step {start_step}, the run has {steps} steps: nothing to do")
            return EXIT_OK
        kept = keep_previous_run(output_dir, (Path.cwd().resolve(), base_dir.resolve()),
                                 run_inputs(spec, base_dir)) if resume_from is None else None
        write_run_record(output_dir, spec, plan)
    except OSError as exc:  # an output_dir that cannot be made, renamed or written
        where = exc.filename or output_dir
        print(f"relax run: trainer.output_dir {output_dir} cannot be written ({exc.strerror or exc}: {where}); "
              "choose a trainer.output_dir you can write to, or fix that folder's permissions", file=sys.stderr)
        return EXIT_INVALID
    except OutputFolderError as exc:
        print(f"relax run: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except LaunchError as exc:
        print(f"relax run: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    if kept is not None:
        print(f"relax run: {output_dir} held an earlier run; it is kept as {kept}", file=sys.stderr)
    out = stream or sys.stdout
    from relax.runtime.driver import run_text

    print(run_text.banner(spec, plan, output_dir, start_step=start_step), end="", file=out, flush=True)
    from relax.runtime.model_files import materialize_model

    building = run_text.model_phase(spec)
    if building is not None:  # a built-in model: seconds to minutes the first time, then cached
        print(building, file=out, flush=True)
        os.environ.update(QUIET_ENV)  # the line says what happens: no library progress bar splits it
    model_path = materialize_model(spec, base_dir)  # once, here, before any worker needs it
    clock.mark("model")
    if building is not None:
        print(f"relax run: the model is ready ({clock.phases['model']:.1f} s); starting Ray and the workers...",
              file=out, flush=True)
    # Ray mostly waits for the processes it starts: the driver imports the runtime meanwhile.
    imports = InBackground(lambda: import_runtime(plan), name="runtime-imports", clock=clock, part="runtime_imports")
    from relax.runtime.driver.ray_sessions import (
        clean_orphaned_sessions,
        end_processes,
        forget_session,
        own_processes,
        record_session,
    )

    for session in clean_orphaned_sessions():  # Ray processes of a driver that was killed
        print(f"relax run: stopped the leftover processes of a killed run's Ray ({session})", file=sys.stderr)
    embedded = _init_ray(spec)
    session = record_session(_session_dir()) if embedded else None
    previous_sigterm = stop_on_sigterm()
    code, last_line = EXIT_RUN_FAILED, None
    try:
        imports.result()
        clock.mark("ray")
        from relax.runtime.driver.controller import Controller

        controller = Controller(spec, plan, base_dir, output_dir, model_path, start_step, resume_from, stream,
                                startup=clock)
        code = controller.run()
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        code, last_line = EXIT_INTERRUPTED, interrupted_hint(exc, _resume_command(), output_dir)
    except Exception as exc:  # a role failed: report its cause, not the controller's traceback
        cause = getattr(exc, "cause", None) or exc  # a role's exception arrives wrapped by Ray
        lines = str(cause).strip().splitlines() or [repr(cause)]
        last_line = f"relax run: the run failed: {lines[0]}"
        if os.environ.get("RELAX_DEBUG"):
            print(str(exc), file=sys.stderr)
    finally:
        try:
            if embedded:
                ours = own_processes()
                stop_embedded_ray()
                end_processes(ours, grace_s=0)  # Ray is down and the run over: nothing left to save
                forget_session(session)
        finally:
            if previous_sigterm is not None:
                import signal

                signal.signal(signal.SIGTERM, previous_sigterm)
    if last_line is not None:
        print(last_line, file=sys.stderr, flush=True)
    if code == EXIT_OK:  # the shutdown counts until Ray is down: metrics and checkpoints are written by then
        clock.stopped()
        print(f"relax run: {clock.line()}", file=out, flush=True)
        clock.write(output_dir)
        print(closing_summary(spec, output_dir, start_step, time.time() - began), end="", file=out, flush=True)
    return code
