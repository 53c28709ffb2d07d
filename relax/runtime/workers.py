"""Role workers: Ray actors that host one or more role loops and run them step after step.

Separate and hybrid modes give each role its own worker; colocate puts the rollout and the actor
loops in one worker, which alternates generating and training and hands weights over in memory.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from relax.bus import Bus
from relax.roles import Role
from relax.runtime.checkpoint import restore_rng
from relax.runtime.health import Heartbeat
from relax.runtime.ranks import RankedTrainer, RankPlacement
from relax.runtime.records import StepReport
from relax.runtime.role_env import RoleEnv, RunStopped
from relax.runtime.roles.actor import ActorLoop
from relax.runtime.roles.advantage import AdvantageLoop
from relax.runtime.roles.critic import CriticTrainLoop, CriticValueLoop
from relax.runtime.roles.forward import ForwardLoop
from relax.runtime.roles.reward import RewardLoop
from relax.runtime.roles.rollout import RolloutLoop
from relax.runtime.run_state import partition_of
from relax.runtime.weight_channels import CollectiveWeights, InProcessWeights, ObjectStoreWeights
from relax.spec.models import RunSpec
from relax.spec.rules import weight_sync
from relax.telemetry import Telemetry


@dataclass
class WorkerLaunch:
    """Everything one worker is built from (with the ``RunState`` handle, passed beside it)."""

    spec: RunSpec
    """The run's spec (its ``trainer.output_dir`` already resolved by the controller)."""
    base_dir: str
    """Where relative paths of the spec resolve (the spec file's folder)."""
    model_path: str
    """The model as a local folder (built-in models are materialized by the driver first)."""
    roles: list[Role]
    """The roles it hosts, in data order."""
    holder: str
    """Its name in the run (heartbeats, rollout leases, reports)."""
    threads: int | None
    """Torch threads of this process."""
    start_step: int = 0
    """The step this attempt of the run starts from (a checkpoint's after a resume)."""
    resume_from: str | None = None
    """The checkpoint folder it loads its state from, if any."""
    run_carrier: dict[str, str] = field(default_factory=dict)
    """The run span's trace context: this process's spans join the run's trace."""
    spec_hash: str = ""
    """The spec's hash, on every span and metric."""
    ranks: dict[Role, list[RankPlacement]] = field(default_factory=dict)
    """The ranks of each multi-process model role it hosts, with their bundles (rank 0 first)."""


def role_failure(what: str, exc: BaseException) -> RuntimeError:
    """A role's failure for the controller, which decides what it does (restart this worker,
    resume the run from its checkpoint, or stop it: fault_tolerance.roles): the cause on the
    first line, the traceback after it."""
    detail = "".join(traceback.format_exception(exc))
    return RuntimeError(f"{what}: {type(exc).__name__}: {exc}\n{detail}")


class RoleWorker:
    """Hosts the loops of some roles (use as ``ray.remote(RoleWorker)``)."""

    def __init__(self, launch: WorkerLaunch, state: Any) -> None:
        from transformers.utils import logging as hf_logging

        spec, roles, threads, holder = launch.spec, launch.roles, launch.threads, launch.holder

        hf_logging.disable_progress_bar()
        self.roles = roles
        self.state = state
        self.spec = spec
        if threads:
            torch.set_num_threads(threads)
        output_dir = Path(spec.trainer.output_dir)
        output_dir = output_dir if output_dir.is_absolute() else Path(launch.base_dir) / output_dir
        telemetry = Telemetry.from_spec(spec, output_dir, role="/".join(roles), spec_hash=launch.spec_hash,
                                        run_carrier=launch.run_carrier)
        faults = spec.fault_tolerance
        self.env = RoleEnv(spec=spec, base_dir=Path(launch.base_dir), output_dir=output_dir, bus=Bus.attach(),
                           state=state, timeout_s=faults.wait_timeout_s, threads=threads,
                           model_path=launch.model_path, telemetry=telemetry, holder=holder, ranks=launch.ranks)
        # Beats from the start: building a model can take long, and a frozen build is a hang too.
        self.heartbeat = Heartbeat(state, holder, self.env.activity, faults.heartbeat_s)
        resume = Path(launch.resume_from) if launch.resume_from else None
        if resume is not None:
            restore_rng(resume)
        # Weights go in memory only to a rollout in the actor's own process; everyone else (a
        # rollout or an actor_fwd elsewhere) gets them through the object store.
        shared = InProcessWeights() if {Role.rollout, Role.actor} <= set(roles) else None
        # roles.rollout.weight_sync collective: the actor's channel keeps the snapshot that
        # send_weights broadcasts (and still uses the object store for an actor_fwd elsewhere).
        collective = shared is None and weight_sync(spec) == "collective"
        self.weight_sender = (CollectiveWeights(self.env, object_store=spec.roles.actor_fwd is not None
                                                and Role.actor_fwd not in roles)
                              if collective and Role.actor in roles else None)
        if self.weight_sender is not None:  # registered before the first publish
            state.register_weight_sender.remote(ray.get_runtime_context().current_actor)
        # The actor is built first so it publishes the starting weights before anyone waits.
        actor = (ActorLoop(self.env, shared or self.weight_sender or ObjectStoreWeights(self.env), launch.start_step,
                           resume) if Role.actor in roles else None)
        incoming = shared or (CollectiveWeights(self.env) if collective else ObjectStoreWeights(self.env))
        rollout = RolloutLoop(self.env, incoming) if Role.rollout in roles else None
        reward = RewardLoop(self.env) if Role.reward in roles else None
        advantage = AdvantageLoop(self.env) if Role.advantage in roles else None
        reference = ForwardLoop(self.env, Role.reference) if Role.reference in roles else None
        # actor_fwd beside the actor reuses its backend: the actor's current weights *are* the
        # proximal policy of the step about to be trained. Elsewhere it receives the weights.
        actor_fwd = None
        if Role.actor_fwd in roles:
            actor_fwd = (ForwardLoop(self.env, Role.actor_fwd, backend=actor.trainer) if actor is not None
                         else ForwardLoop(self.env, Role.actor_fwd, weights=ObjectStoreWeights(self.env)))
        critic_values = CriticValueLoop(self.env) if Role.critic in roles else None
        critic = CriticTrainLoop(self.env, critic_values) if critic_values is not None else None
        # Co-hosted roles pass a step's rows along in memory: the rollout to the scorer riding on
        # it, the scorer to the advantage estimator; the last of them writes to the bus. An
        # estimator that reads the critic's or the reference's columns waits for them on the bus.
        # The scorer rides on the rollout only when one replica makes whole steps: with several,
        # a step's units come from different processes and are scored from the bus.
        inline = advantage if advantage is not None and not advantage.reads else None
        if rollout is not None and spec.roles.rollout.replica_limit == 1:
            rollout.scorer, rollout.estimator = reward, inline
        elif reward is not None:
            reward.handoff = inline
        # One step of every hosted role, in data order.
        self.loops: list[Any] = [loop for loop in (rollout, reward, reference, critic_values, advantage, actor_fwd,
                                                   actor, critic) if loop is not None]

    def ready(self) -> dict[str, Any]:
        """Where this worker runs (for placement checks) once its loops are built."""
        return {"roles": self.roles, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "gpus": ray.get_gpu_ids(), "threads": torch.get_num_threads(),
                "ranks": {role: backend.placed for role, backend in self._ranked().items()}}

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
        steps = self.spec.trainer.steps
        starts = {loop.role: start_step for loop in self.loops}
        if resumed:
            starts = {role: max(start_step, resumed.get(role, start_step - 1) + 1) for role in starts}
            for loop in self.loops:
                if loop.role != Role.rollout and starts[loop.role] < steps:
                    self.env.bus.reset_consumption(partition_of(starts[loop.role]), loop.role)
        done = start_step
        role = "/".join(self.roles)
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
                    self.state.report.remote(StepReport(step, str(loop.role), stats))
                done = step + 1
        except RunStopped:
            return {"roles": self.roles, "steps_done": done, "stopped": True}
        except Exception as exc:
            raise role_failure(f"role {role} failed at step {done}", exc) from None
        finally:
            self.env.telemetry.flush()
        return {"roles": self.roles, "steps_done": done, "stopped": False}

    def serve(self) -> dict[str, Any]:
        """An extra rollout replica: produce units until the run needs no more or it is drained."""
        try:
            with self.env.activity.waiting("rollout replica leases units"):
                units = self.loops[0].serve()
        except RunStopped:
            return {"roles": self.roles, "units": 0, "stopped": True}
        except Exception as exc:
            raise role_failure(f"rollout replica {self.env.holder} failed", exc) from None
        finally:
            self.env.telemetry.flush()
        return {"roles": self.roles, "units": units, "stopped": False}

    def close(self) -> None:
        """Flush this process's spans, stop the other ranks of its model roles and let go of the bus
        (called before the actor is killed)."""
        self.heartbeat.stop()
        for backend in self._ranked().values():
            backend.close()
        self.env.telemetry.shutdown()
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
