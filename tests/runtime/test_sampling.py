"""The rollout's ``Sampler`` seam: the typed sample identity, the seeds, the sampler the plan
names, and dynamic sampling as a wrapper around any sampler.

The backend and the scorer here are small fakes (pure logic: what the samplers do with what they
return); the real rollouts run in ``tests/runtime/test_run.py``, ``test_agent_run.py``,
``test_partial_run.py`` and ``test_algorithms.py`` (DAPO).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax.config import load_spec_dict
from relax.contracts import Generation
from relax.plan import make_plan, render
from relax.runtime.worker.data import PromptSchedule, sampling_seed
from relax.runtime.worker.sampling import (
    ROUND_SEED_STRIDE,
    UNIT_SEED_STRIDE,
    Draw,
    DynamicSampling,
    PlainSampler,
    SampledBatch,
    SampleId,
    SamplerKit,
    draw_seed,
)
from relax.spec import validate_spec

N = 2  # samples per prompt


def settings(**changed):
    base = dict(seed=7, samples_per_prompt=N, prompts_per_step=3, dynamic_sampling_rounds=3, steps=10,
                log_samples_every=0, data=SimpleNamespace(prompt_key="q", label_key="a", reward_key=None))
    return SimpleNamespace(**{**base, **changed})


class Backend:
    """Answers each prompt with its own text's length as the single response token; records the seeds."""

    version = 4

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def generate(self, prompts, n, sampling, seed):
        self.seeds.append(seed)
        return [Generation(prompt_index=i, prompt_ids=[1], response_ids=[len(p)], logprobs=[0.0], text=p)
                for i, p in enumerate(prompts) for _ in range(n)]


DATASET = [{"q": f"question {'x' * i}", "a": str(i)} for i in range(12)]
UNIT = {"step": 5, "unit": 3, "start": 8, "stop": 11, "attempt": 1}


def test_a_sample_s_identity_is_written_into_its_metadata_and_read_back() -> None:
    backend = Backend()
    sampler = PlainSampler(SamplerKit(settings(), backend, DATASET, sampling=None))
    batch = sampler.sample(Draw(5, 0, [2, 4, 6], UNIT, {"traceparent": "t"}))
    assert [m["sample_id"] for m in batch.meta] == ["5:8:0", "5:8:1", "5:9:0", "5:9:1", "5:10:0", "5:10:1"]
    assert [SampleId.of(m) for m in batch.meta][3] == SampleId(step=5, round=0, prompt=9, sample=1, unit=3, attempt=1)
    assert all(m["group"] == SampleId.of(m).prompt and m["policy_version"] == 4 for m in batch.meta)
    assert [m["index"] for m in batch.meta] == [2, 2, 4, 4, 6, 6] and batch.order == [2, 4, 6]
    assert backend.seeds == [sampling_seed(7, 5) + 3 * 7_919]


def test_an_extra_round_is_tagged_and_parsed() -> None:
    identity = SampleId(step=12, round=2, prompt=0, sample=3, unit=0, attempt=0)
    assert str(identity) == "12r2:0:3" and identity.tag == "12r2"
    assert SampleId.of({"sample_id": "12r2:0:3", "unit": 0, "attempt": 0}) == identity
    with pytest.raises(ValueError, match="not <step>"):
        SampleId.of({"sample_id": "eval3:1:0", "unit": 0, "attempt": 0})


def test_seeds_of_rounds_and_units_never_collide_and_keep_their_values() -> None:
    assert (ROUND_SEED_STRIDE, UNIT_SEED_STRIDE) == (104_729, 7_919)  # a changed stride changes every run's samples
    seeds = {draw_seed(1, 3, r, u) for r in range(8) for u in range(1000)}
    assert len(seeds) == 8 * 1000
    assert draw_seed(1, 3, 2, 5) == sampling_seed(1, 3) + 2 * 104_729 + 5 * 7_919


class Scorer:
    """Rewards: 1 for a prompt whose data-set index is even and sample 0, else 0 (so a group of an odd
    prompt has equal rewards and is dropped); records what was scored and the recorded mean."""

    def __init__(self) -> None:
        self.recorded: list[torch.Tensor] = []

    def score(self, step, columns, meta):
        return torch.tensor([float(m["index"] % 2 == 0 and m["sample"] == 0) for m in meta])

    def record(self, step, rewards, reward_s):
        self.recorded.append(rewards)


def test_dynamic_sampling_wraps_a_sampler_and_refills_dropped_groups_from_extra_rounds() -> None:
    backend, scorer = Backend(), Scorer()
    schedule = PromptSchedule(len(DATASET), 3, 7, True)
    inner = PlainSampler(SamplerKit(settings(), backend, DATASET, sampling=None))
    dynamic = DynamicSampling(inner, scorer, schedule, settings(), pad_token_id=0)
    assert dynamic.name == "dynamic(plain)"
    batch = dynamic.sample(Draw(5, 0, [1, 2, 3], {**UNIT, "start": 0}, {}))
    rounds = batch.sampling["sampling_rounds"]
    assert rounds >= 2 and len(backend.seeds) == rounds  # prompts 1 and 3 dropped: another round was drawn
    assert backend.seeds[1] == draw_seed(7, 5, 1, 3)
    assert len(batch.rows) == 3 and len(batch.gens) == 3 * N
    assert [g.prompt_index for g in batch.gens] == [0, 0, 1, 1, 2, 2]  # renumbered groups
    kept = [m for m in batch.meta if m["index"] % 2 == 0]
    assert kept[0]["index"] == 2 and kept[0]["sample_id"] == "5:1:0"  # the first round's kept group comes first
    assert any(SampleId.of(m).round >= 1 for m in batch.meta)  # the rest from extra rounds, their identity kept
    assert len(scorer.recorded) == 1 and scorer.recorded[0].numel() == rounds * 3 * N  # the mean over every draw
    assert batch.sampling["sampling_topped_up"] == 3 - sum(
        1 for r in batch.rows if r["index"] % 2 == 0)


@pytest.mark.parametrize("overrides, name", [
    ((), "plain"),
    (("algorithm.name=dapo",), "dynamic(plain)"),
    (("roles.rollout.partial=true",), "partial"),
])
def test_the_plan_names_the_sampler(overrides: tuple[str, ...], name: str) -> None:
    raw, base = load_spec_dict("tiny-cpu", list(overrides))
    plan = make_plan(validate_spec(raw, base_dir=base), base_dir=base)
    assert plan.settings.sampler == name
    assert f"\nRollout sampler: {name}\n" in render(plan)  # relax plan shows it


def test_the_agent_preset_samples_trajectories() -> None:
    raw, base = load_spec_dict("tiny-agent-cpu", [])
    assert make_plan(validate_spec(raw, base_dir=base), base_dir=base).settings.sampler == "agent"


def test_a_merged_batch_keeps_each_sample_s_identity() -> None:
    gens = [Generation(prompt_index=i // N, prompt_ids=[1], response_ids=[2], logprobs=[0.0], text="")
            for i in range(2 * N)]
    meta = [{"sample_id": f"4r1:{6 + i // N}:{i % N}", "group": 6 + i // N, "unit": 0, "attempt": 0}
            for i in range(2 * N)]
    source = SampledBatch(rows=[{"index": 0}, {"index": 1}], gens=gens, meta=meta, order=[0, 1], generate_s=0.0,
                          rewards=torch.zeros(2 * N))
    merged = SampledBatch.merge([(source, 1)], generate_s=0.0)
    assert [m["group"] for m in merged.meta] == [0, 0]
    assert {SampleId.of(m).prompt for m in merged.meta} == {7}
