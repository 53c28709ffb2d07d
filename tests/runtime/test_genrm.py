"""The genrm reward end to end: a tiny judge model, built locally, grades a tiny run's responses.

The judge is ``builtin:tiny-lm`` with ``task: judge`` (it answers yes/no to ``3+5=8?``). It runs
in reward workers of their own (``roles.reward.host: own``); exact_match rides along with weight 0,
so each step's trace says how both scored the same responses.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import ray

from relax.config import load_spec_dict
from relax.contracts import RewardSample
from relax.plan import make_plan
from relax.runtime.driver.launch import run_spec
from relax.spec import validate_spec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: The judge: trained long enough to catch most wrong numbers, not only rambling tails.
JUDGE_OPTIONS = {"model": "builtin:tiny-lm", "model_options": {"task": "judge", "warmup_steps": 2000},
                 "template": "{prompt}{response}?", "sampling": {"max_new_tokens": 4}}


def judge_run(tmp_path: Path) -> tuple[int, list[dict], list[dict]]:
    raw, base = load_spec_dict("tiny-cpu", ["name=genrm", f"trainer.output_dir={tmp_path / 'genrm'}",
                                            "trainer.steps=3", "tracing.exporter=jsonl", "roles.reward.host=own"])
    raw["rewards"] = [{"name": "genrm", "options": JUDGE_OPTIONS, "timeout_s": 120},
                      {"name": "exact_match", "weight": 0.0}]
    spec = validate_spec(raw, base_dir=base)
    code = run_spec(spec, make_plan(spec, base_dir=base), base_dir=base, stream=io.StringIO())
    out = tmp_path / "genrm"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    return code, metrics, [s for s in spans if s["name"] == "relax.reward.score"]


def test_a_run_scored_by_a_judge_agrees_with_exact_match(tmp_path: Path) -> None:
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        code, metrics, spans = judge_run(tmp_path)
    finally:
        ray.shutdown()
    assert code == 0 and [r["step"] for r in metrics] == [1, 2, 3]
    assert len(spans) == 3
    by_step = {s["attributes"]["relax.step"]: s["attributes"] for s in spans}
    for step, attrs in by_step.items():
        judged, exact = attrs["relax.reward.genrm.mean"], attrs["relax.reward.exact_match.mean"]
        assert attrs["relax.reward.genrm.count"] == 128 and attrs["relax.reward.genrm.errors"] == 0
        assert abs(judged - exact) <= 0.15, (step, judged, exact)
    # exact_match has weight 0: the run's reward is the judge's.
    for row in metrics:
        assert row["reward/mean"] == pytest.approx(by_step[row["step"] - 1]["relax.reward.genrm.mean"], abs=1e-6)


def test_the_judge_is_right_about_most_single_answers() -> None:
    from relax.registry import get_registry
    from relax.runtime.worker.components import build_reward
    from relax_plugins.datasets.arithmetic import arithmetic_problem

    registry = get_registry()
    judge = build_reward("genrm", JUDGE_OPTIONS)  # with the runtime's RewardContext, as a reward worker
    exact = registry.load("rewards", "exact_match")(registry.build_config("rewards", "exact_match", {}))
    rng = random.Random("genrm-test")
    samples = []
    for i in range(120):
        item = arithmetic_problem(rng, 9, ["+"])
        answer = int(item["answer"])
        response = [item["answer"], f"{answer} {rng.randint(0, 9)}+", str(answer + rng.choice((-2, -1, 1, 3)))][i % 3]
        samples.append(RewardSample(item["prompt"], response, item["answer"]))
    judged, truth = judge.score(samples), exact.score(samples)
    agreement = sum(j == t for j, t in zip(judged, truth)) / len(samples)
    assert agreement >= 0.8, agreement
    mean_j, mean_t = sum(judged) / len(judged), sum(truth) / len(truth)
    cov = sum((j - mean_j) * (t - mean_t) for j, t in zip(judged, truth))
    var = (sum((j - mean_j) ** 2 for j in judged) * sum((t - mean_t) ** 2 for t in truth)) ** 0.5
    assert cov / var >= 0.6  # Pearson correlation of the judge's verdicts with exact match
