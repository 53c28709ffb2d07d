"""The reward role: scores a step's responses with every reward plugin (``relax.runtime.worker.scoring``
runs them concurrently within their time limits); the weighted sum is the ``rewards`` column."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from relax.agents.outcomes import linked_rows
from relax.bus.records import BusBatch
from relax.contracts import RewardSample
from relax.plan.model import RoleWiring
from relax.roles import Column, Role
from relax.runtime.samples import choose_rows, due, sample_row
from relax.runtime.worker.components import build_scorer
from relax.runtime.worker.role_env import RoleEnv
from relax.telemetry import REWARD_SCORE

if TYPE_CHECKING:
    from relax.runtime.worker.roles.advantage import AdvantageLoop


class RewardLoop:
    """Scores a step's responses with every reward plugin: the weighted sum becomes ``rewards``.

    Riding in a rollout worker it scores each batch before the batch is put on the bus; otherwise it
    takes responses from the bus, and hands the scored rows to an advantage loop in the same worker
    (``handoff``) or writes ``rewards`` back itself.
    """

    role = Role.reward

    def __init__(self, env: RoleEnv, wiring: RoleWiring) -> None:
        self.env = env
        self.rewards = build_scorer(wiring.rewards)
        self.after = tuple(wiring.waits_for) or (Column.response,)
        self.fields = tuple(wiring.reads)
        self.handoff: AdvantageLoop | None = None
        self._stats: dict[int, dict[str, Any]] = {}

    def score(self, step: int, columns: dict[str, Any], meta: list[Any]) -> torch.Tensor:
        """The weighted reward of every row (``prompt``/``response``/``label`` columns).

        The scorer (``relax.runtime.worker.scoring``) runs the rewards concurrently within their time
        limits. A sample's metadata is its row's (``sample_id``, ``group``, ``response_tokens``,
        ...; not the trace) plus the run's ``max_new_tokens``; ``response_tokens`` falls back to the
        ``lengths`` column when the row does not carry it. With ``data.reward_key`` set, a row's
        ``reward_route`` metadata (that column's value) picks the rewards that score it. A
        trajectory's earlier segments (``relax.agents.outcomes.linked_rows``) are not scored: their
        rows get the reward of the trajectory's last segment, and the figures count each trajectory once.
        """
        started = time.perf_counter()
        max_new_tokens = self.env.settings.max_new_tokens
        lengths = columns.get(Column.lengths)
        samples, routes = [], []
        linked = linked_rows(meta) if self.env.settings.agent is not None else {}
        rows = [i for i in range(len(meta)) if i not in linked]
        for i, (prompt, response, label, row) in enumerate(zip(columns[Column.prompt], columns[Column.response],
                                                                 columns[Column.label], meta)):
            if i in linked:
                continue
            info = dict(row) if isinstance(row, dict) else {
                **row.extra, "sample_id": row.sample_id, "policy_version": row.policy_version}
            info.pop("trace", None)
            info.setdefault("max_new_tokens", max_new_tokens)
            if "response_tokens" not in info and lengths is not None:
                info["response_tokens"] = int(lengths[i][1])
            routes.append(info.pop("reward_route", None))
            samples.append(RewardSample(prompt=prompt, response=response, label=label, metadata=info))
        # Its own piece of work: a reward that never returns (timeout_s: null) is then blamed by name,
        # not as the generation of the rollout it may ride in (fault_tolerance.progress_timeout_s).
        names = ", ".join(f"'{e.key}' ({e.name})" for e in self.rewards.entries)
        with self.env.telemetry.span(REWARD_SCORE, step=step, samples=len(samples), links=meta) as span, \
                self.env.activity.busy(f"reward {names} scoring {len(samples)} samples of step {step}", announce=True):
            report = self.rewards.score(samples, routes if self.env.settings.data.reward_key else None)
            per_reward = report.stats()
            span.set(**{"relax.reward." + k.replace("/", "."): v for k, v in per_reward.items()})
        total = torch.tensor(report.totals, dtype=torch.float32)
        agent = self.env.settings.agent
        if agent is not None:  # trajectories: the agent program's own reward, plus the turn rewards
            total = agent_rewards(total, [s.metadata.get("agent") for s in samples], agent.turn_reward_weight)
        scored = total
        self._stats[step] = {"reward_s": time.perf_counter() - started, "bus_s": 0.0,
                             "reward_mean": float(total.mean()), "rewards": per_reward, **spread(total)}
        if due(step + 1, self.env.settings.log_samples_every):
            self._stats[step]["sample_rows"] = self.samples(step, samples, report.scores, total)
        if linked:  # every row of the step, each earlier segment with its trajectory's reward
            total = torch.zeros(len(meta), dtype=torch.float32)
            total[torch.tensor(rows)] = scored
            for i, last in linked.items():
                total[i] = total[last]
        return total

    def samples(self, step: int, samples: list[RewardSample], scores: dict[str, list[float | None]],
                total: torch.Tensor) -> list[dict[str, Any]]:
        """The rows of a sampled step the run shows (``relax.runtime.samples``): a few, chosen by
        reward, each with every reward entry's own score."""
        totals = total.tolist()
        return [sample_row(step + 1, s.prompt, s.response, s.label, totals[i],
                           {key: column[i] for key, column in scores.items()}, s.metadata)
                for i in choose_rows(totals, self.env.settings.log_samples) for s in (samples[i],)]

    def record(self, step: int, rewards: torch.Tensor, reward_s: float) -> None:
        """Replace a step's reward figures and time after several scoring rounds (dynamic
        sampling): over every sample drawn, not only the kept ones."""
        self._stats[step].update(reward_mean=float(rewards.mean()), reward_s=reward_s, **spread(rewards))

    def step(self, step: int) -> dict[str, Any]:
        # A co-hosted advantage loop gets these rows in memory: read the token columns it needs too.
        extra = tuple(f for f in self.handoff.fields if f != Column.rewards) if self.handoff is not None else ()
        return self.env.bus_task(step, self._stats, self.after, (*self.fields, *extra), Role.reward, self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        total = self.score(step, batch.fields, batch.meta)
        if self.handoff is not None:
            self.handoff.accept(step, batch, total)
        else:
            self.env.bus.write_fields(batch, {Column.rewards: total})
            self.env.announce(step, Column.rewards)



def spread(rewards: torch.Tensor) -> dict[str, float]:
    """How a step's rewards spread (``reward/std``, ``reward/min``, ``reward/max``): all equal
    (std 0) means the group estimators see no signal."""
    if rewards.numel() == 0:
        return {"reward_std": 0.0, "reward_min": 0.0, "reward_max": 0.0}
    values = rewards.float()
    std = float(values.std(unbiased=False))
    return {"reward_std": std, "reward_min": float(values.min()), "reward_max": float(values.max())}


def agent_rewards(scores: torch.Tensor, summaries: list[dict[str, Any] | None], turn_weight: float) -> torch.Tensor:
    """Trajectory rewards: the reward plugins' score, replaced by the agent program's reward when it
    gave one (the gateway), plus ``turn_weight`` times the environment's turn rewards."""
    out = scores.clone()
    for i, summary in enumerate(summaries):
        if not summary:
            continue
        if summary.get("reward") is not None:
            out[i] = float(summary["reward"])
        out[i] += turn_weight * float(summary.get("turn_reward", 0.0))
    return out
