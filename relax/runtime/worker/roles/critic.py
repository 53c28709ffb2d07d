"""The critic role, in two loops per step: its values of every response token (``values``, read by
``gae``), and, once the advantage role has written ``returns``, a value-loss update on them."""

from __future__ import annotations

import time
from typing import Any

from relax.algo.batch import TrainBatch
from relax.plan.model import RoleWiring
from relax.roles import CRITIC_VALUES, Column, Role
from relax.runtime.worker.role_env import RoleEnv
from relax.runtime.worker.rows import token_column
from relax.telemetry import TRAIN_STEP


class CriticValueLoop:
    """The critic's first half of a step: values of every response token, written as ``values``."""

    role = CRITIC_VALUES

    def __init__(self, env: RoleEnv, wiring: RoleWiring) -> None:
        self.env = env
        self.after, self.fields = tuple(wiring.waits_for), tuple(wiring.reads)
        self.backend = env.build_trainer(wiring)

    def step(self, step: int) -> dict[str, Any]:
        env = self.env
        started = time.perf_counter()
        batch = env.take(step, self.after, self.fields, CRITIC_VALUES)
        got = time.perf_counter()
        packed = TrainBatch.from_bus(batch)
        values = self.backend.compute_values(packed)
        computed = time.perf_counter()
        env.bus.write_fields(batch, {Column.values: token_column(packed, values)})
        env.announce(step, Column.values)
        return {"forward_s": computed - got, "bus_s": (got - started) + (time.perf_counter() - computed)}


class CriticTrainLoop:
    """The critic's second half: a value-loss update on the step's ``returns``."""

    role = Role.critic

    def __init__(self, env: RoleEnv, wiring: RoleWiring, values: CriticValueLoop) -> None:
        self.env = env
        self.after, self.fields = tuple(wiring.waits_for), tuple(wiring.reads)
        self.backend = values.backend

    def step(self, step: int) -> dict[str, Any]:
        env = self.env
        started = time.perf_counter()
        batch = env.take(step, self.after, self.fields, Role.critic)
        got = time.perf_counter()
        packed = TrainBatch.from_bus(batch)
        with env.telemetry.span(TRAIN_STEP, step=step, role=Role.critic, samples=packed.batch_size):
            metrics = self.backend.train_step(packed)
        trained = time.perf_counter()
        return {"train_s": trained - got, "data_wait_s": got - started,
                "train": {k: float(v) for k, v in metrics.items()}}
