"""The advantage role: turns a step's rewards into advantages (and the critic's returns)."""

from __future__ import annotations

import time
from typing import Any

import torch

from relax.algo.batch import TrainBatch
from relax.bus.records import BusBatch
from relax.roles import Column, Role
from relax.contracts import PluginKind
from relax.plan.model import RoleWiring
from relax.registry import trait
from relax.runtime.components import build_planned
from relax.runtime.role_env import RoleEnv, group_ids
from relax.runtime.rows import token_column
from relax.telemetry import ADVANTAGE_COMPUTE


class AdvantageLoop:
    """Turns a step's rewards into advantages (a row's group is the prompt it answers).

    An outcome-level estimator maps ``rewards[B]`` to ``advantages[B]``. A token-level one
    (``token_level = True``) also reads the step's tokens and, per its ``needs``, the critic's
    ``values`` or the reference's ``ref_logprobs``, and writes ``[B, T]`` advantages (and
    ``returns`` for the critic). With a critic and an estimator that gives no returns, the
    critic's target is the outcome reward on every response token (Monte Carlo, no discount).
    """

    role = Role.advantage

    def __init__(self, env: RoleEnv, wiring: RoleWiring) -> None:
        self.env = env
        self.estimator = build_planned(wiring.plugins[0])
        self.token_level = bool(trait(self.estimator, PluginKind.advantages, "token_level"))
        self.after = tuple(wiring.waits_for)
        """What it waits for on the bus: the rewards, and the columns of other roles it reads."""
        self.fields = tuple(wiring.reads)
        """What it reads: rewards, and the tokens (and other roles' columns) when it needs them."""
        self.writes_returns = Column.returns in wiring.writes
        self._stats: dict[int, dict[str, Any]] = {}

    def estimate(self, step: int, rewards: torch.Tensor, groups: torch.Tensor,
                 columns: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """``advantages`` (and ``returns`` when a critic trains) for a step's rows; ``columns``
        holds the token columns a token-level estimator or the critic's target needs."""
        started = time.perf_counter()
        rewards = rewards.float()
        with self.env.telemetry.span(ADVANTAGE_COMPUTE, step=step, samples=len(rewards)):
            packed = (TrainBatch.from_columns(columns, [0] * len(rewards))
                      if columns is not None and Column.input_ids in columns else None)
            returns = None
            if self.token_level:
                from relax.algo.advantages import TokenAdvantageInputs

                out = self.estimator.compute_tokens(TokenAdvantageInputs(
                    rewards=rewards, group_ids=groups, response_mask=packed.response_mask,
                    logprobs=packed.rollout_logprobs, ref_logprobs=getattr(packed, "ref_logprobs", None),
                    values=getattr(packed, "values", None)))
                advantages = token_column(packed, out.advantages)
                if out.returns is not None:
                    returns = token_column(packed, out.returns)
            else:
                advantages = self.estimator.compute(rewards, groups).float()
            produced = {Column.advantages: advantages}
            if self.writes_returns:
                produced[Column.returns] = returns if returns is not None else rewards[:, None] * packed.response_mask
        self._stats[step] = {"advantage_s": time.perf_counter() - started, "bus_s": 0.0}
        return produced

    def accept(self, step: int, batch: BusBatch, rewards: torch.Tensor) -> None:
        """Rows a reward loop in this worker took from the bus and scored: estimate, write both."""
        produced = self.estimate(step, rewards, group_ids(batch.meta), batch.fields)
        self.env.bus.write_fields(batch, {Column.rewards: rewards, **produced})
        self.env.announce(step, Column.rewards, *produced)

    def step(self, step: int) -> dict[str, Any]:
        return self.env.bus_task(step, self._stats, self.after, self.fields, Role.advantage,
                                 self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        produced = self.estimate(step, batch[Column.rewards].float(), group_ids(batch.meta), batch.fields)
        self.env.bus.write_fields(batch, produced)
        self.env.announce(step, *produced)

