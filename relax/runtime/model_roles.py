"""The loops of the optional model roles: reference, actor_fwd and critic.

Each reads a step's token columns from the bus, runs a forward (and the critic a training) pass
with its own ``relax.trainer`` backend, and writes one token column back:

- ``reference`` writes ``ref_logprobs`` (the frozen initial policy), read by the actor's loss for
  a KL term and by a token-level estimator that puts the KL into the reward;
- ``actor_fwd`` writes ``old_logprobs``: the proximal policy of decoupled PPO, i.e. the log-probs
  under the policy version the actor is about to update (version ``step``);
- ``critic`` writes ``values`` (read by ``gae``) and, once the advantage role has written
  ``returns``, trains its value head on them.
"""

from __future__ import annotations

import time
from typing import Any

from relax.runtime.loops import RoleEnv, WeightChannel, partition_of
from relax.runtime.rows import TOKEN_COLUMNS, token_column, token_columns, train_batch
from relax.telemetry import TRAIN_STEP, WEIGHT_SYNC


class ForwardLoop:
    """A forward-only role: one log-prob column per step (``reference`` or ``actor_fwd``)."""

    def __init__(self, env: RoleEnv, role: str, column: str, backend: Any = None,
                 weights: WeightChannel | None = None) -> None:
        self.env, self.role, self.column = env, role, column
        self.weights = weights
        self.backend = backend if backend is not None else env.build_trainer(role)
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
        batch = env.take(step, "response", token_columns(env.spec), self.role)
        got = time.perf_counter()
        packed = train_batch(batch.fields, [m.policy_version for m in batch.meta])
        logprobs = self.backend.compute_logprobs(packed)
        computed = time.perf_counter()
        env.bus.write_fields(batch, {self.column: token_column(packed, logprobs)})
        env.state.announce.remote(partition_of(step), self.column)
        done = time.perf_counter()
        return {"forward_s": computed - got, "weight_load_s": sync_s,
                "data_wait_s": waited - started - sync_s, "bus_s": (got - waited) + (done - computed)}


class CriticValueLoop:
    """The critic's first half of a step: values of every response token, written as ``values``."""

    role = "critic_values"

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self.backend = env.build_trainer("critic")

    def step(self, step: int) -> dict[str, Any]:
        env = self.env
        started = time.perf_counter()
        batch = env.take(step, "response", TOKEN_COLUMNS, "critic_values")
        got = time.perf_counter()
        packed = train_batch(batch.fields, [m.policy_version for m in batch.meta])
        values = self.backend.compute_values(packed)
        computed = time.perf_counter()
        env.bus.write_fields(batch, {"values": token_column(packed, values)})
        env.state.announce.remote(partition_of(step), "values")
        return {"forward_s": computed - got, "bus_s": (got - started) + (time.perf_counter() - computed)}


class CriticTrainLoop:
    """The critic's second half: a value-loss update on the step's ``returns``."""

    role = "critic"

    def __init__(self, env: RoleEnv, values: CriticValueLoop) -> None:
        self.env = env
        self.backend = values.backend

    def step(self, step: int) -> dict[str, Any]:
        env = self.env
        started = time.perf_counter()
        batch = env.take(step, "returns", (*TOKEN_COLUMNS, "values", "returns"), "critic")
        got = time.perf_counter()
        packed = train_batch(batch.fields, [m.policy_version for m in batch.meta])
        with env.telemetry.span(TRAIN_STEP, step=step, role="critic", samples=packed.batch_size):
            metrics = self.backend.train_step(packed)
        trained = time.perf_counter()
        return {"train_s": trained - got, "data_wait_s": got - started,
                "train": {k: float(v) for k, v in metrics.items()}}
