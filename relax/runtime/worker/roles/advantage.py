"""The advantage role: turns a step's rewards into advantages (and the critic's returns)."""

from __future__ import annotations

import time
from typing import Any

import torch

from relax.algo.batch import TrainBatch
from relax.bus.records import BusBatch
from relax.contracts import PluginKind
from relax.plan.model import RoleWiring
from relax.registry import trait
from relax.roles import Column, Role
from relax.runtime.worker.components import build_planned
from relax.runtime.worker.role_env import RoleEnv, group_ids
from relax.runtime.worker.rows import token_column
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
                 columns: dict[str, Any] | None = None, keep: list[bool] | None = None,
                 linked: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
        """``advantages`` (and ``returns`` when a critic trains) for a step's rows; ``columns``
        holds the token columns a token-level estimator or the critic's target needs.

        ``keep``: the rows that enter the estimate (``relax.agents.outcomes.healthy``: trajectories
        not ended by an infrastructure failure). The others are not part of the batch the estimator
        sees (no group mean, std or whitening counts them) and get advantage and return 0; their
        loss mask is already 0.

        ``linked``: the rows of trajectories' earlier segments, each mapped to its trajectory's last
        segment row (``relax.agents.outcomes.linked_rows``; they are not in ``keep``): the group
        statistics count a trajectory once, by that row, and an outcome-level estimator's advantage
        (and the critic's Monte Carlo return) of that row is the linked rows' too, so every segment
        trains with the advantage a one-segment trajectory of that reward gets. A token-level
        estimator's advantages are per token of one sequence: linked rows get 0 there (only the last
        segment trains, docs/agents.md)."""
        from relax.algo.advantages import TokenAdvantageInputs, put_rows, take_rows

        started = time.perf_counter()
        rewards = rewards.float()
        size = len(rewards)
        index = None if keep is None or all(keep) else torch.nonzero(torch.tensor(keep, dtype=torch.bool)).flatten()
        with self.env.telemetry.span(ADVANTAGE_COMPUTE, step=step, samples=size):
            packed = (TrainBatch.from_columns(columns, [0] * len(rewards))
                      if columns is not None and Column.input_ids in columns else None)
            returns = None
            if self.token_level:
                inputs = TokenAdvantageInputs(
                    rewards=rewards, group_ids=groups, response_mask=packed.response_mask,
                    logprobs=packed.rollout_logprobs, ref_logprobs=getattr(packed, "ref_logprobs", None),
                    values=getattr(packed, "values", None))
                out = self.estimator.compute_tokens(inputs if index is None else take_rows(inputs, index))
                token_advantages, token_returns = out.advantages, out.returns
                if index is not None:
                    token_advantages = put_rows(token_advantages, index, size)
                    token_returns = None if token_returns is None else put_rows(token_returns, index, size)
                advantages = token_column(packed, token_advantages)
                if token_returns is not None:
                    returns = token_column(packed, token_returns)
            elif index is None:
                advantages = self.estimator.compute(rewards, groups).float()
            else:
                advantages = put_rows(torch.as_tensor(self.estimator.compute(rewards[index], groups[index])).float(),
                                      index, size)
            if linked and not self.token_level:  # earlier segments: their trajectory's advantage
                advantages = advantages.clone()
                for row, last in linked.items():
                    advantages[row] = advantages[last]
            produced = {Column.advantages: advantages}
            if self.writes_returns:
                if returns is None:  # Monte Carlo target; none for rows kept out
                    kept = torch.ones(size) if index is None else put_rows(torch.ones(len(index)), index, size)
                    for row, last in (linked or {}).items():
                        kept[row] = kept[last]
                    returns = (rewards * kept)[:, None] * packed.response_mask
                produced[Column.returns] = returns
        self._stats[step] = {"advantage_s": time.perf_counter() - started, "bus_s": 0.0}
        return produced

    def accept(self, step: int, batch: BusBatch, rewards: torch.Tensor) -> None:
        """Rows a reward loop in this worker took from the bus and scored: estimate, write both."""
        produced = self.estimate(step, rewards, group_ids(batch.meta), batch.fields, *kept_rows(batch.meta))
        self.env.bus.write_fields(batch, {Column.rewards: rewards, **produced})
        self.env.announce(step, Column.rewards, *produced)

    def step(self, step: int) -> dict[str, Any]:
        return self.env.bus_task(step, self._stats, self.after, self.fields, Role.advantage,
                                 self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        produced = self.estimate(step, batch[Column.rewards].float(), group_ids(batch.meta), batch.fields,
                                 *kept_rows(batch.meta))
        self.env.bus.write_fields(batch, produced)
        self.env.announce(step, *produced)



def kept_rows(meta: list[Any]) -> tuple[list[bool], dict[int, int]]:
    """Per row: whether it enters the advantage's statistics (its ``agent.outcome``, if any, is not
    an infrastructure failure, and it is not an earlier segment of a trajectory); and the earlier
    segments' rows, each mapped to its trajectory's last segment row."""
    from relax.agents.outcomes import healthy, linked_rows

    linked = linked_rows(meta)
    keep = healthy([getattr(m, "extra", m) or {} for m in meta])
    return [k and i not in linked for i, k in enumerate(keep)], linked
