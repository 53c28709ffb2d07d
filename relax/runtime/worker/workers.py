"""Role workers: Ray actors that host one or more role loops and run them step after step.

Separate and hybrid modes give each role its own worker; colocate puts the rollout and the actor
loops in one worker, which alternates generating and training and hands weights over in memory.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from relax.plan.model import PluginUse
from relax.roles import CRITIC_VALUES, EVALUATION, Role
from relax.runtime.checkpoint import restore_rng
from relax.runtime.failure_class import DiskFull, disk_full, repeats_on_retry
from relax.runtime.startup import InBackground
from relax.runtime.state.health import Heartbeat
from relax.runtime.state.records import RoleFailure, StepReport
from relax.runtime.state.run_state import partition_of
from relax.runtime.worker.ranks import RankedTrainer, RankEngines
from relax.runtime.worker.role_env import RoleEnv, RunStopped
from relax.runtime.worker.roles.actor import ActorLoop
from relax.runtime.worker.roles.advantage import AdvantageLoop
from relax.runtime.worker.roles.critic import CriticTrainLoop, CriticValueLoop
from relax.runtime.worker.roles.evaluation import EvaluationLoop
from relax.runtime.worker.roles.forward import BaseModelView, ForwardLoop
from relax.runtime.worker.roles.reward import RewardLoop
from relax.runtime.worker.roles.rollout import RolloutLoop
from relax.runtime.worker.scoring import RewardError
from relax.runtime.worker.weight_channels import (
    CollectiveWeights,
    InProcessWeights,
    ObjectStoreWeights,
    share_policy_model,
)
from relax.runtime.worker_launch import WorkerLaunch
from relax.telemetry import Telemetry


def attach_bus(timeout_s: float) -> Any:
    """This process's handle on the run's bus (imported here: a worker without a bus never loads
    TransferQueue)."""
    from relax.bus import Bus

    return Bus.attach(timeout_s)


def role_failure(what: str, exc: BaseException, *, stops_run: bool = False) -> RoleFailure:
    """A role's failure for the controller, which decides what it does (restart this worker,
    resume the run from its checkpoint, or stop it: fault_tolerance.roles): the cause on the
    first line, the traceback after it. A failure that repeats on any retry stops the run whatever
    the policy, as does ``stops_run``: a reward's failure (``RewardError``: a broken contract, a
    sample failing under ``on_error: fail``, too many failing under ``zero``) and a mistake in the
    role's code or data (``relax.runtime.failure_class``: a bad column, a bad value, a plugin's bug)."""
    detail = "".join(traceback.format_exception(exc))
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    full = disk_full(exc)
    if full is not None and not isinstance(exc, DiskFull):  # written by code that did not name the file
        where = f" writing {full.filename}" if full.filename else ""
        message = (f"{message} (disk full{where}; free space on that disk, or give trainer.output_dir on another "
                   "one, then relax run --resume)")
    return RoleFailure(f"{what}: {type(exc).__name__}: {message}\n{detail}",
                       stops_run=stops_run or isinstance(exc, RewardError) or repeats_on_retry(exc))


class RoleWorker:
    """Hosts the loops of some roles (use as ``ray.remote(RoleWorker)``)."""

    def __init__(self, launch: WorkerLaunch, state: Any) -> None:
        # A constructor that raises kills the actor: Ray then prints the traceback from the worker
        # and hands the driver only its text. Kept here instead, the failure reaches the controller
        # from ``ready`` as the exception itself, and the worker is killed without a word.
        self.start_error: RoleFailure | None = None
        self.heartbeat: Heartbeat | None = None
        try:
            self._build(launch, state)
        except Exception as exc:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            self.start_error = role_failure(f"worker {launch.name} failed while starting", exc, stops_run=True)

    def _build(self, launch: WorkerLaunch, state: Any) -> None:
        """Build the hosted role loops (their plugins, models and weight channels)."""
        from transformers.utils import logging as hf_logging

        plan, settings, holder = launch.worker, launch.settings, launch.name
        self.shares_policy_model = False
        """The rollout here generates with the actor's own model (``share_policy_model``)."""
        self.engines: RankEngines | None = None
        """Colocation across ranks: the rollout engine in each of the actor's rank processes."""
        hf_logging.disable_progress_bar()
        self.roles = [Role(r) for r in plan.role_names]
        self.state = state
        self.settings = settings
        self.start_step = launch.start_step
        torch.set_num_threads(plan.threads)
        output_dir = Path(launch.output_dir)
        telemetry = Telemetry.from_spec(settings, output_dir, role="/".join(self.roles), spec_hash=launch.spec_hash,
                                        run_carrier=launch.run_carrier)
        faults = settings.fault_tolerance
        # The driver may still be starting the bus: attach in the background while the plugins build
        # (their constructors never touch the bus), and join before the worker says it is ready.
        attaching = InBackground(lambda: attach_bus(faults.wait_timeout_s), name="bus-attach") if launch.bus else None
        self.env = RoleEnv(settings=settings, worker=plan, work=launch.work, output_dir=output_dir, bus=None,
                           state=state, timeout_s=faults.wait_timeout_s, threads=plan.threads,
                           model_path=launch.model_path, telemetry=telemetry, holder=holder, ranks=launch.ranks)
        # Beats from the start: building a model can take long, and a frozen build is a hang too.
        self.heartbeat = Heartbeat(state, holder, self.env.activity, faults.heartbeat_s)
        resume = Path(launch.resume_from) if launch.resume_from else None
        if resume is not None:
            restore_rng(resume)
        loops = {loop.task: loop for loop in plan.roles}
        # The weight channels the plan names: in memory to a rollout in the actor's own process;
        # over a weight group (collective), where the actor's channel keeps the snapshot that
        # send_weights broadcasts (and still uses the object store for an actor_fwd elsewhere);
        # else through the object store.
        actor_wiring, rollout_wiring = loops.get(Role.actor), loops.get(Role.rollout)
        shared = InProcessWeights() if actor_wiring and "in-process" in actor_wiring.weights_out else None
        if shared is not None and plan.engine_per_rank:
            shared.shares_model = True  # every rank's engine takes the weights from its trainer (RankEngines)
        self.weight_sender = None
        if actor_wiring is not None and "collective" in actor_wiring.weights_out:
            self.weight_sender = CollectiveWeights(self.env, object_store="object-store" in actor_wiring.weights_out)
            state.register_weight_sender.remote(ray.get_runtime_context().current_actor)  # before the first publish
        # The actor is built first so it publishes the starting weights before anyone waits.
        actor = (ActorLoop(self.env, actor_wiring, shared or self.weight_sender or ObjectStoreWeights(self.env),
                           launch.start_step, resume) if actor_wiring else None)
        rollout = None
        if rollout_wiring is not None:
            channel = rollout_wiring.weights_in
            incoming = (shared if channel == "in-process" else
                        CollectiveWeights(self.env) if channel == "collective" else ObjectStoreWeights(self.env))
            rollout = RolloutLoop(self.env, rollout_wiring, incoming)
            if plan.engine_per_rank and actor is not None:  # colocate across ranks: an engine in every rank
                self.engines = self._rank_engines(actor, rollout, rollout_wiring.plugins[0], launch.model_path)
            elif shared is not None and actor is not None:  # colocate: one model for both, when they can
                self.shares_policy_model = share_policy_model(shared, actor.trainer, rollout.backend)
        reward = RewardLoop(self.env, loops[Role.reward]) if Role.reward in loops else None
        advantage = AdvantageLoop(self.env, loops[Role.advantage]) if Role.advantage in loops else None
        reference = None
        if Role.reference in loops:  # beside a LoRA actor: its base model, adapter disabled (BaseModelView)
            ref = loops[Role.reference]
            reference = (ForwardLoop(self.env, ref, backend=BaseModelView(actor.trainer)) if ref.weights_in == "shared"
                         else ForwardLoop(self.env, ref))
        # actor_fwd beside the actor reuses its backend ("shared"): the actor's current weights *are*
        # the proximal policy of the step about to be trained. Elsewhere it receives the weights.
        actor_fwd = None
        if Role.actor_fwd in loops:
            fwd = loops[Role.actor_fwd]
            actor_fwd = (ForwardLoop(self.env, fwd, backend=actor.trainer) if fwd.weights_in == "shared"
                         else ForwardLoop(self.env, fwd, weights=ObjectStoreWeights(self.env)))
        critic_values = CriticValueLoop(self.env, loops[CRITIC_VALUES]) if CRITIC_VALUES in loops else None
        critic = CriticTrainLoop(self.env, loops[Role.critic], critic_values) if critic_values is not None else None
        evaluation = EvaluationLoop(self.env, loops[EVALUATION]) if EVALUATION in loops else None
        # Co-hosted roles pass a step's rows along in memory, as the plan says (``hands_to``): the
        # rollout to the scorer riding on it, the scorer to the advantage estimator beside it; the
        # last of them writes to the bus.
        if rollout is not None and rollout_wiring.hands_to == Role.reward:
            rollout.scorer = reward
            rollout.estimator = advantage if loops[Role.reward].hands_to == Role.advantage else None
            if rollout.estimator is not None and loops[Role.advantage].hands_to == Role.actor:
                rollout.learner = actor
        elif reward is not None and loops[Role.reward].hands_to == Role.advantage:
            reward.handoff = advantage
        by_task = {Role.rollout: rollout, Role.reward: reward, Role.reference: reference, CRITIC_VALUES: critic_values,
                   Role.advantage: advantage, Role.actor_fwd: actor_fwd, Role.actor: actor, Role.critic: critic,
                   EVALUATION: evaluation}
        # One step of every hosted loop, in the plan's (data) order.
        self.loops: list[Any] = [by_task[loop.task] for loop in plan.roles]
        self.env.bus = attaching.result() if attaching is not None else None
        # What exists now (torch, transformers, Ray, the models' modules) lives as long as the worker:
        # out of the collector's sight, a full collection no longer walks it (on the tiny preset,
        # 0.2 s once every ~1,000 steps, mid-step). Whatever garbage it holds now is simply kept.
        gc.freeze()
        # Built: idle until the controller starts its task. Left as "starting", the build's time would
        # count against progress_timeout_s until the first step's work began.
        self.env.activity.label, self.env.activity.busy_since = "ready", None

    @staticmethod
    def _rank_engines(actor: ActorLoop, rollout: RolloutLoop, engine: PluginUse, model_path: str) -> RankEngines:
        """Colocation across ranks: a rollout engine in every other rank of the actor, the rollout
        built here being rank 0's; the rollout then generates through all of them, and the actor
        hands each its weights in its own process from the held version on."""
        if not isinstance(actor.trainer, RankedTrainer):
            raise RuntimeError("the plan hosts a rollout engine in every actor rank, but the actor runs in one "
                               "process; plan the run again (relax plan) with this version of relax")
        engines = RankEngines(actor.trainer, rollout.backend, engine, model_path)
        rollout.backend = engines
        actor.engines = engines
        actor.publish()  # a resumed actor's weights, or the starting ones, into every engine
        return engines

    def ready(self) -> dict[str, Any]:
        """Where this worker runs (for placement checks) once its loops are built; why it could not
        build them (``RoleFailure``) otherwise."""
        if self.start_error is not None:
            raise self.start_error
        context = ray.get_runtime_context()
        return {"roles": self.roles, "pid": os.getpid(), "node": context.get_node_id(),
                "placement_group": context.get_placement_group_id(),
                "gpus": ray.get_gpu_ids(), "threads": torch.get_num_threads(),
                "ranks": {role: backend.placed for role, backend in self._ranked().items()},
                "shares_policy_model": self.shares_policy_model,
                "rollout_engines": self.engines.placed if self.engines is not None else []}

    def _ranked(self) -> dict[str, RankedTrainer]:
        """The model roles hosted here that span several processes, by role."""
        found = {}
        for loop in self.loops:
            backend = getattr(loop, "trainer", None) or getattr(loop, "backend", None)
            if isinstance(backend, RankedTrainer):
                found[backend.role] = backend
        return found

    def run(self, start_step: int, resumed: dict[str, int] | None = None) -> dict[str, Any]:
        """Run every step from ``start_step``; stop quietly when the run is stopped.

        ``resumed`` (a worker restarted in place): per report name, the last step it reported
        before the failure; each loop picks up after it, and first gets back the rows of its
        next step that the failed process may have taken without finishing them."""
        steps = self.settings.steps
        starts = {loop.role: start_step for loop in self.loops}
        if resumed:
            starts = {role: max(start_step, resumed.get(role, start_step - 1) + 1) for role in starts}
            for loop in self.loops:
                if loop.role != Role.rollout and starts[loop.role] < steps and self.env.bus is not None:
                    self.env.bus.reset_consumption(partition_of(starts[loop.role]), loop.role)
        done = start_step
        role = "/".join(self.roles)
        # The loops' reports of a step go in one call once every loop did it (each call to RunState
        # costs both processes CPU); a loop that finished before another failed is still reported.
        # Where the next step makes a call that can take them (``reports_ride``), they ride on it.
        pending: list[StepReport] = []
        try:
            for step in range(min(starts.values(), default=steps), steps):
                for loop in self.loops:
                    if step < starts[loop.role]:
                        continue
                    role = loop.role
                    started, wall = time.perf_counter(), time.time()
                    with self.env.activity.busy(f"{loop.role} step {step}"):
                        stats = loop.step(step)
                    stats["busy_s"] = time.perf_counter() - started
                    stats["started_at"] = wall
                    pending.append(StepReport(step, str(loop.role), stats))
                # reports carried since the last step found no call to ride on: they go now
                pending = (self.env.take_carried_reports() or []) + pending
                if self.reports_ride(step):
                    self.env.carried_reports = pending
                else:
                    self.state.report.remote(pending)
                pending = []
                done = step + 1
            role = "rollout"
            for loop in self.loops:  # after the last step: the rollout's final evaluation
                if isinstance(loop, RolloutLoop):
                    role = loop.role
                    loop.finish()
        except RunStopped:
            return {"roles": self.roles, "steps_done": done, "stopped": True}
        except Exception as exc:
            pending = (self.env.take_carried_reports() or []) + pending
            if pending:
                self.state.report.remote(pending)
            raise role_failure(f"role {role} failed at step {done}", exc) from None
        finally:
            self.env.telemetry.flush()
        return {"roles": self.roles, "steps_done": done, "stopped": False}

    def reports_ride(self, step: int) -> bool:
        """Whether a call to ``RunState`` that this worker makes during a later step takes the
        reports of ``step`` (``RoleEnv.carried_reports``), one call a step fewer: the lease a sole
        rollout producer asks ahead (every step, or every few short steps in colocate mode:
        ``LEASE_WINDOW_S``; reports carried meanwhile wait for it), or the actor's publish of its
        next version (separate and hybrid modes). The last steps report by themselves."""
        steps = self.settings.steps
        for loop in self.loops:
            if isinstance(loop, RolloutLoop) and loop.sole_producer and step + 2 < steps:
                return True
            if isinstance(loop, ActorLoop) and isinstance(loop.weights, (ObjectStoreWeights, CollectiveWeights)) \
                    and step + 1 < steps:
                return True
        return False

    def serve(self) -> dict[str, Any]:
        """An extra rollout replica: produce units until the run needs no more or it is drained."""
        def units() -> int:
            with self.env.activity.waiting("rollout replica leases units"):
                return self.loops[0].serve()

        return self._task(units, "units", f"rollout replica {self.env.holder} failed")

    def evaluate(self) -> dict[str, Any]:
        """The evaluation worker (``trainer.eval.host: own``): evaluate every due policy version,
        through the final one."""
        return self._task(lambda: self.loops[0].run(self.start_step), "evaluations",
                          f"the evaluation worker {self.env.holder} failed")

    def _task(self, work: Callable[[], int], counted: str, failed: str) -> dict[str, Any]:
        """A task other than the step loop (an extra replica's units, the evaluations): how many it
        made under ``counted``, or that the run stopped it; its failure as a ``RoleFailure``."""
        try:
            made = work()
        except RunStopped:
            return {"roles": self.roles, counted: 0, "stopped": True}
        except Exception as exc:
            raise role_failure(failed, exc) from None
        finally:
            self.env.telemetry.flush()
        return {"roles": self.roles, counted: made, "stopped": False}

    def close(self) -> None:
        """Flush this process's spans, stop the other ranks of its model roles and let go of the bus
        (called before the actor is killed)."""
        if self.start_error is not None:  # nothing was built
            return
        self.heartbeat.stop()
        for backend in self._ranked().values():
            backend.close()
        for loop in self.loops:
            close = getattr(loop, "close", None)
            if close is not None:  # a rollout's agent gateway endpoint and version watch
                close()
        self.env.telemetry.shutdown()
        if self.env.bus is not None:
            self.env.bus.close()

    def open_weight_group(self, holder: str, receivers: int) -> dict[str, Any]:
        """A new weight group for rollout replica ``holder`` with ``receivers`` ranks (collective
        weight sync; the actor's worker only): the address its backend joins."""
        if self.weight_sender is None:
            raise RuntimeError(f"worker {self.env.holder} ({'/'.join(self.roles)}) sends no weights; "
                               "only the actor's worker does, with roles.rollout.weight_sync collective")
        return self.weight_sender.open(holder, receivers)

    def send_weights(self, holder: str) -> dict[str, Any]:
        """Broadcast the actor's newest weights over ``holder``'s weight group (runs on a free
        thread of this worker while its loops go on): the version sent, its bytes and times."""
        if self.weight_sender is None:
            raise RuntimeError(f"worker {self.env.holder} ({'/'.join(self.roles)}) sends no weights")
        return self.weight_sender.send(holder)
