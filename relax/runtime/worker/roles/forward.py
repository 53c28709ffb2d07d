"""The forward-only model roles: ``reference`` and ``actor_fwd``.

Each reads a step's token columns from the bus, runs a forward pass with its own ``relax.trainer``
backend, and writes one log-prob column back:

- ``reference`` writes ``ref_logprobs`` (the frozen initial policy), read by the actor's loss for
  a KL term and by a token-level estimator that puts the KL into the reward;
- ``actor_fwd`` writes ``old_logprobs``: the proximal policy of decoupled PPO, i.e. the log-probs
  under the policy version the actor is about to update (version ``step``).
"""

from __future__ import annotations

import time
from typing import Any

from relax.algo.batch import TrainBatch
from relax.plan.model import RoleWiring
from relax.roles import Column, Role
from relax.runtime.worker.role_env import RoleEnv
from relax.runtime.worker.rows import token_column
from relax.runtime.worker.weight_channels import WeightChannel
from relax.telemetry import FORWARD, WEIGHT_SYNC


class BaseModelView:
    """The frozen base model behind the actor's LoRA adapter, as the reference's backend: the actor's
    own trainer computes the log-probs with its adapter disabled (``compute_base_logprobs``), so the
    reference holds no model of its own. Its weights never change: it takes no weight syncs."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def compute_logprobs(self, batch: Any) -> Any:
        return self.trainer.compute_base_logprobs(batch)


class ForwardLoop:
    """A forward-only role: one log-prob column per step (``reference`` or ``actor_fwd``)."""

    def __init__(self, env: RoleEnv, wiring: RoleWiring, backend: Any = None,
                 weights: WeightChannel | None = None) -> None:
        self.env, self.role, self.column = env, Role(wiring.role), Column(wiring.writes[0])
        self.after, self.fields = tuple(wiring.waits_for), tuple(wiring.reads)
        self.weights = weights
        self.backend = backend if backend is not None else env.build_trainer(wiring)
        self.shares_actor = backend is not None
        """True when this role reuses the actor's own backend (same process): its weights are the
        actor's current ones, so nothing is synced."""
        self.version = 0

    def step(self, step: int) -> dict[str, Any]:
        env = self.env
        started = time.perf_counter()
        sync_s = 0.0
        if self.weights is not None and not self.shares_actor:
            # Proximal policy of step s = the version the actor trains from at step s.
            version, weights = self.weights.wait(step, self.version)
            if weights is not None:
                t = time.perf_counter()
                with env.telemetry.span(WEIGHT_SYNC, step=step, role=self.role, policy_version=version):
                    self.backend.load_weights(weights, version)
                sync_s = time.perf_counter() - t
            self.version = version
        waited = time.perf_counter()
        batch = env.take(step, self.after, self.fields, self.role)
        got = time.perf_counter()
        packed = TrainBatch.from_bus(batch)
        with env.telemetry.span(FORWARD, step=step, role=self.role, samples=packed.batch_size):
            logprobs = self.backend.compute_logprobs(packed)
        computed = time.perf_counter()
        env.bus.write_fields(batch, {self.column: token_column(packed, logprobs)})
        env.announce(step, self.column)
        done = time.perf_counter()
        return {"forward_s": computed - got, "weight_load_s": sync_s,
                "data_wait_s": waited - started - sync_s, "bus_s": (got - waited) + (done - computed)}
