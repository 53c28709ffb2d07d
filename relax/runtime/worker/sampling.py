"""How the rollout draws a unit's samples: the ``Sampler`` seam of ``RolloutLoop``.

The rollout loop leases a unit, waits for admissible weights, and asks its sampler for the unit's
samples; the sampler the plan names (``RunSettings.sampler``, shown by ``relax plan``) does the
drawing:

- ``plain``: one response per sample from the backend's ``generate``;
- ``agent``: multi-turn trajectories (``roles.rollout.agent``, ``relax.runtime.worker.agent``);
- ``partial``: generation that pauses for new weights and starts the next step beside this step's
  tail (``roles.rollout.partial``, ``relax.runtime.worker.partial``);
- ``dynamic(...)``: DAPO's dynamic sampling around any of them (``algorithm.dynamic_sampling``):
  it scores each round and draws more prompts until enough groups have rewards that differ.

Each sample gets a typed identity (``SampleId``), written into its row's metadata. Seeds are a
function of the step, the round and the unit only, so a unit generated again after a failure, on
any replica, draws the same samples from the same weights.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from relax.contracts import Generation
from relax.media import loads_context
from relax.runtime.samples import due
from relax.runtime.worker.data import PromptSchedule, prompt_rows, sampling_seed
from relax.runtime.worker.rows import rollout_columns

if TYPE_CHECKING:
    from relax.plan.model import RunSettings
    from relax.runtime.worker.agent import AgentSampler
    from relax.runtime.worker.partial import PartialRollouts
    from relax.runtime.worker.roles.reward import RewardLoop

#: Seed strides of a draw: its seed is the step's (``sampling_seed``) plus ``round x
#: ROUND_SEED_STRIDE`` plus ``unit x UNIT_SEED_STRIDE``. Both are primes (the 10,000th and the
#: 1,000th), so no (round, unit) pair shares a seed with another while a step has fewer than
#: 104,729 units: ``r x 104,729 + u x 7,919 = r' x 104,729 + u' x 7,919`` needs 104,729 to divide
#: ``u' - u``, as the two primes have no factor in common.
ROUND_SEED_STRIDE = 104_729
UNIT_SEED_STRIDE = 7_919


def draw_seed(run_seed: int, step: int, round_: int, unit: int) -> int:
    """The generation seed of one round of one unit of ``step``."""
    return sampling_seed(run_seed, step) + round_ * ROUND_SEED_STRIDE + unit * UNIT_SEED_STRIDE


_SAMPLE_ID = re.compile(r"(?P<step>\d+)(?:r(?P<round>\d+))?:(?P<prompt>\d+):(?P<sample>\d+)")


@dataclass(frozen=True)
class SampleId:
    """Which sample a row is: written into its metadata as ``sample_id`` (the text ``<step>[r<round>]:
    <prompt>:<sample>``, also an agent trajectory's id) beside ``sample``, ``unit`` and ``attempt``.

    ``prompt`` is the prompt's place among the step's prompts of its round (the unit's first
    prompt plus its index in the unit). The row's ``group`` starts as ``prompt`` and is what the
    group estimators group by; dynamic sampling renumbers it when it merges rounds, the identity
    stays."""

    step: int
    round: int
    """0 for the step's own prompts; dynamic sampling's extra rounds count from 1."""
    prompt: int
    sample: int
    """Which of the prompt's ``samples_per_prompt`` samples."""
    unit: int
    attempt: int
    """The unit's lease attempt: 0, one more each time the unit is generated again."""

    @property
    def tag(self) -> str:
        """The round's tag: the step, with ``r<round>`` for dynamic sampling's extra rounds."""
        return f"{self.step}" if self.round == 0 else f"{self.step}r{self.round}"

    def __str__(self) -> str:
        return f"{self.tag}:{self.prompt}:{self.sample}"

    @classmethod
    def of(cls, meta: dict[str, Any]) -> SampleId:
        """The identity written into a row's metadata."""
        found = _SAMPLE_ID.fullmatch(str(meta["sample_id"]))
        if found is None:
            raise ValueError(f"sample_id {meta['sample_id']!r} is not <step>[r<round>]:<prompt>:<sample>")
        return cls(int(found["step"]), int(found["round"] or 0), int(found["prompt"]), int(found["sample"]),
                   int(meta["unit"]), int(meta["attempt"]))


@dataclass(frozen=True)
class Draw:
    """One round of one leased unit to sample."""

    step: int
    round: int
    indices: list[int]
    """Data-set indices of its prompts."""
    unit: dict[str, Any]
    """The lease's unit (``step``, ``unit``, ``start``, ``stop``, ``attempt``: ``relax.runtime.state.ledger``)."""
    carrier: dict[str, str]
    """The trace context of the batch span: each row carries it."""

    def identity(self, prompt: int, sample: int) -> SampleId:
        return SampleId(self.step, self.round, self.unit["start"] + prompt, sample, self.unit["unit"],
                        self.unit["attempt"])


@dataclass
class SampledBatch:
    """Prompts and generations of one sampling round (or the groups picked from several)."""

    rows: list[dict[str, Any]]
    gens: list[Generation]
    meta: list[dict[str, Any]]
    order: list[int]
    """Data-set indices of the prompts, in order (what ``data/order`` hashes)."""
    generate_s: float
    rewards: torch.Tensor | None = None
    """The weighted rewards of ``gens``, once scored."""
    contexts: list[str] | None = None
    """Agentic multimodal runs: each trajectory's media context (all its media, in token order)."""
    stats: dict[str, float] = field(default_factory=dict)
    """The unit's agentic trajectory stats (``relax.agents.runner.run_trajectories``) or partial
    rollout stats (``relax.runtime.worker.partial.PartialStats``)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Dynamic sampling's figures of the unit (``sampling_rounds``, ``sampling_filter_rate``,
    ``sampling_topped_up``); empty without it."""

    @property
    def tokens(self) -> int:
        return sum(len(g.response_ids) for g in self.gens)

    @classmethod
    def merge(cls, groups: list[tuple[SampledBatch, int]], generate_s: float) -> SampledBatch:
        """One batch of the chosen groups (a source batch and a prompt index each), renumbered."""
        rows, gens, meta, rewards, contexts = [], [], [], [], []
        for new_index, (source, group) in enumerate(groups):
            rows.append(source.rows[group])
            for i, g in enumerate(source.gens):
                if g.prompt_index == group:
                    gens.append(replace(g, prompt_index=new_index))
                    meta.append({**source.meta[i], "group": new_index})
                    rewards.append(source.rewards[i])
                    if source.contexts is not None:
                        contexts.append(source.contexts[i])
        stats = groups[0][0].stats if groups else {}
        return cls(rows=rows, gens=gens, meta=meta, order=[r["index"] for r in rows], generate_s=generate_s,
                   rewards=torch.stack(rewards), contexts=contexts or None, stats=stats)


class Sampler(Protocol):
    """Draws one round of a unit's samples: ``samples_per_prompt`` per prompt, prompt-major."""

    name: str
    """What the plan calls it (``plain``, ``agent``, ``partial``, ``dynamic(<inner>)``)."""

    def sample(self, draw: Draw) -> SampledBatch: ...


@dataclass(frozen=True)
class SamplerKit:
    """What every sampler of a rollout draws with."""

    settings: RunSettings
    backend: Any
    dataset: Any
    sampling: Any
    """The rollout's sampling parameters (``RolloutContext.sampling``)."""
    media: Any = None
    """The modality plugins (multimodal runs), else None."""


class RoundSampler:
    """What every sampler does around its own generation: read the prompts' rows, seed the draw,
    and write each sample's metadata (its ``SampleId``, the policy version it counts from)."""

    name = ""

    def __init__(self, kit: SamplerKit) -> None:
        self.kit = kit

    def sample(self, draw: Draw) -> SampledBatch:
        kit = self.kit
        settings, n = kit.settings, kit.settings.samples_per_prompt
        data = settings.data
        rows = prompt_rows(kit.dataset, draw.indices, data.prompt_key, data.label_key, data.reward_key, kit.media)
        started = time.perf_counter()
        seed = draw_seed(settings.seed, draw.step, draw.round, draw.unit["unit"])
        gens, extra, contexts, stats = self.generate(draw, rows, n, seed)
        generate_s = time.perf_counter() - started
        versions = [oldest_version(g, kit.backend.version) for g in gens]
        meta = []
        for i, g in enumerate(gens):
            # A sample of several rows (a trajectory's segments) names its sample in its metadata.
            identity = draw.identity(g.prompt_index, int(extra[i].get("sample", i % n)) if extra else i % n)
            row = rows[g.prompt_index]
            meta.append({"policy_version": versions[i], "sample_id": str(identity), "index": row["index"],
                         "group": identity.prompt, "sample": identity.sample, "unit": identity.unit,
                         "attempt": identity.attempt, "trace": draw.carrier, "response_tokens": len(g.response_ids),
                         **({"reward_route": row["route"]} if "route" in row else {}),
                         **(extra[i] if extra is not None else {})})
        return SampledBatch(rows=rows, gens=gens, meta=meta, order=list(draw.indices), generate_s=generate_s,
                            contexts=contexts, stats=stats)

    def generate(self, draw: Draw, rows: list[dict[str, Any]], n: int, seed: int
                 ) -> tuple[list[Generation], list[dict[str, Any]] | None, list[str] | None, dict[str, float]]:
        """The generations of ``rows`` (``n`` each, prompt-major), with each sample's extra
        metadata, the trajectories' media contexts, and the unit's stats."""
        raise NotImplementedError


class PlainSampler(RoundSampler):
    """One response per sample from the backend's ``generate``, with each prompt's media
    references (never the decoded media)."""

    name = "plain"

    def generate(self, draw: Draw, rows: list[dict[str, Any]], n: int, seed: int
                 ) -> tuple[list[Generation], list[dict[str, Any]] | None, list[str] | None, dict[str, float]]:
        kit = self.kit
        media = {}
        if kit.media is not None:
            media = {"media": [loads_context(r["media"])[1] for r in rows]}
        return kit.backend.generate([r["prompt"] for r in rows], n, kit.sampling, seed, **media), None, None, {}


class AgentTrajectorySampler(RoundSampler):
    """Multi-turn trajectories (``roles.rollout.agent``): each sample is one trajectory."""

    name = "agent"

    def __init__(self, kit: SamplerKit, agent: AgentSampler) -> None:
        super().__init__(kit)
        self.agent = agent

    def generate(self, draw: Draw, rows: list[dict[str, Any]], n: int, seed: int
                 ) -> tuple[list[Generation], list[dict[str, Any]] | None, list[str] | None, dict[str, float]]:
        detail = due(draw.step + 1, self.kit.settings.log_samples_every)  # the samples show calls and observations
        tag = draw.identity(0, 0).tag
        gens, agent_meta, contexts, done = self.agent.sample(rows, n, self.kit.sampling, seed, tag,
                                                             draw.unit["start"], detail)
        return gens, agent_meta, contexts, done.stats


class PartialSampler(RoundSampler):
    """Partial rollouts (``roles.rollout.partial``): generation pauses for new weights, and the next
    step's samples start beside this one's tail."""

    name = "partial"

    def __init__(self, kit: SamplerKit, partial: PartialRollouts, schedule: PromptSchedule) -> None:
        super().__init__(kit)
        self.partial, self.schedule = partial, schedule

    def generate(self, draw: Draw, rows: list[dict[str, Any]], n: int, seed: int
                 ) -> tuple[list[Generation], list[dict[str, Any]] | None, list[str] | None, dict[str, float]]:
        encode = self.kit.backend.encode_prompt
        gens, partial = self.partial.sample(draw.step, encode_distinct(encode, [r["prompt"] for r in rows]), n,
                                            self.kit.sampling, seed, self._next_prompts(draw))
        return gens, None, None, asdict(partial)

    def _next_prompts(self, draw: Draw) -> Callable[[], list[list[int]]] | None:
        """The token ids of the next step's prompts for this unit, read when the rollout may start
        them; None after the last step."""
        settings, step, unit = self.kit.settings, draw.step, draw.unit
        if step + 1 >= settings.steps:
            return None
        data = settings.data

        def prompts() -> list[list[int]]:
            indices = self.schedule.indices(step + 1)[unit["start"]:unit["stop"]]
            rows = prompt_rows(self.kit.dataset, indices, data.prompt_key, data.label_key, data.reward_key, None)
            return encode_distinct(self.kit.backend.encode_prompt, [r["prompt"] for r in rows])

        return prompts


class DynamicSampling:
    """DAPO's dynamic sampling around ``inner``: score each round, keep the groups whose rewards
    differ, and sample more prompts (``PromptSchedule.extra``) until ``prompts_per_step`` groups are
    kept or ``dynamic_sampling.max_rounds`` rounds are spent. A short batch is topped up with
    dropped groups (zero advantage for the group estimators) so every step has the same size. It
    needs the rewards before the put: the scorer riding in the rollout worker."""

    def __init__(self, inner: Sampler, scorer: RewardLoop, schedule: PromptSchedule, settings: RunSettings,
                 pad_token_id: int) -> None:
        self.inner, self.scorer, self.schedule, self.settings = inner, scorer, schedule, settings
        self.pad_token_id = pad_token_id
        self.name = f"dynamic({inner.name})"

    def sample(self, draw: Draw) -> SampledBatch:
        from relax.algo.dynamic_sampling import filter_groups

        want = self.settings.prompts_per_step
        kept: list[tuple[SampledBatch, int]] = []
        dropped: list[tuple[SampledBatch, int]] = []
        rounds, groups_seen, all_rewards = 0, 0, []
        generate_s = score_s = 0.0
        batch = self.inner.sample(draw)
        while True:
            columns = rollout_columns(batch.gens, [r["prompt"] for r in batch.rows], [r["label"] for r in batch.rows],
                                      self.pad_token_id)
            started = time.perf_counter()
            batch.rewards = self.scorer.score(draw.step, columns, batch.meta)
            score_s += time.perf_counter() - started
            generate_s += batch.generate_s
            all_rewards.append(batch.rewards)
            groups = torch.tensor([g.prompt_index for g in batch.gens], dtype=torch.long)
            verdict = filter_groups(batch.rewards, groups)
            kept += [(batch, int(g)) for g in verdict.kept_groups]
            dropped += [(batch, int(g)) for g in verdict.dropped_groups]
            groups_seen += len(batch.rows)
            rounds += 1
            if len(kept) >= want or rounds >= self.settings.dynamic_sampling_rounds:
                break
            batch = self.inner.sample(replace(draw, round=rounds, indices=self.schedule.extra(draw.step, rounds)))
        merged = SampledBatch.merge((kept + dropped)[:want], generate_s=generate_s)
        # The reward the policy earns is the mean over every sample drawn, not over the kept ones.
        self.scorer.record(draw.step, torch.cat(all_rewards), reward_s=score_s)
        merged.sampling = {"sampling_rounds": rounds, "sampling_filter_rate": len(dropped) / max(groups_seen, 1),
                           "sampling_topped_up": max(0, want - len(kept))}
        return merged


def sampler_name(*, agent: bool, partial: bool, dynamic: bool) -> str:
    """The name of the sampler a rollout draws with (``RunSettings.sampler``, shown by ``relax plan``)."""
    inner = "agent" if agent else "partial" if partial else "plain"
    return f"dynamic({inner})" if dynamic else inner


def encode_distinct(encode: Callable[[str], list[int]], prompts: list[str]) -> list[list[int]]:
    """``encode`` of each prompt, called once per distinct prompt: a prompt drawn twice in a step
    (a small data set, dynamic sampling's extra draws) is tokenized once."""
    seen: dict[str, list[int]] = {}
    for prompt in prompts:
        if prompt not in seen:
            seen[prompt] = list(encode(prompt))
    return [list(seen[p]) for p in prompts]


def oldest_version(generation: Generation, held: int) -> int:
    """The policy version a sample's staleness counts from: that of its oldest token the policy
    chose (a partial rollout's or a trajectory's tokens may come from several), else ``held``."""
    versions = generation.token_versions
    if not versions:
        return held
    mask = generation.loss_mask
    chosen = [v for i, v in enumerate(versions) if mask is None or mask[i]]
    return min(chosen, default=held)
