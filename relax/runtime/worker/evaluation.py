"""Evaluation during training: the held-out prompts (``data.eval``) sampled and scored with one
policy version (``trainer.eval_every``, ``trainer.eval``).

Versions evaluated: 0 (before training), the first version held at or after each multiple of
``eval_every``, and the final version after the last step. Who evaluates (``trainer.eval.host``):

- an evaluation worker of its own (``own``; ``auto`` outside colocate mode), a copy of the rollout
  engine that loads each due version from the object store (``relax.runtime.worker.roles.evaluation``).
  Training never waits for it: on GPUs it has devices of its own; on CPU it runs at a lower
  priority (``yield_cpu_to_training``), in the CPU time the rollout and the actor leave idle.
- the rollout that hosts the run's step loop (``rollout``; ``auto`` in colocate mode), with the
  backend it generates with, right after it produced a step. In separate mode that overlaps the
  actor's training of the step, but the next step's generation starts only when the evaluation
  ends: with ``max_staleness: 1`` the rollout usually sets the pace, so training is delayed by about
  the evaluation's length. In colocate mode the evaluation adds its time to the step it follows.

Each evaluation generates ``samples_per_prompt`` responses per prompt from a seed of its own that
is the same for every version, so two evaluations differ by the weights only. A response passes
when its reward is at least ``pass_threshold``; ``eval/pass@k`` is the unbiased estimator of
Chen et al. (2021) averaged over prompts. The figures travel to the controller through
``RunState`` and are written into the next metrics row (``eval/version`` names the weights).
"""

from __future__ import annotations

import math
import time
from typing import Any

from relax.contracts import RewardSample
from relax.runtime.worker.data import prompt_rows

#: The evaluation's sampling seed: fixed, so every version answers the same draws.
EVAL_SEED_OFFSET = 7_777_777


def yield_cpu_to_training() -> None:
    """Lower the calling thread to the lowest CPU priority there is, so an evaluation worker on CPU
    runs in the time the rollout and the actor leave idle and yields the rest: Linux's
    ``SCHED_IDLE`` (per thread), else ``nice`` 19. On a cluster whose Ray starts its workers at nice
    15 (Ray's default; an embedded Ray starts them at the driver's priority), nice alone would leave
    the evaluation about a third of a core it shares with training; ``SCHED_IDLE`` leaves it a few
    percent either way."""
    import os

    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    os.nice(19 - os.nice(0))


def pass_at_k(n: int, passed: int, k: int) -> float:
    """The chance that at least one of ``k`` responses drawn without replacement from ``n``, of
    which ``passed`` pass, passes: ``1 - C(n - passed, k) / C(n, k)`` (unbiased for pass@k)."""
    if not 0 <= passed <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= passed <= n and 1 <= k <= n, got n={n}, passed={passed}, k={k}")
    if n - passed < k:
        return 1.0
    return 1.0 - math.comb(n - passed, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: 1, 2, 4, ... and ``n`` itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def eval_metrics(rewards: list[list[float]], lengths: list[int], threshold: float) -> dict[str, float]:
    """The ``eval/*`` figures of one evaluation: ``rewards[p]`` holds the rewards of prompt ``p``'s
    responses (the same count for every prompt), ``lengths`` every response's token count."""
    n = len(rewards[0])
    flat = [r for group in rewards for r in group]
    out = {"eval/prompts": float(len(rewards)), "eval/samples": float(len(flat)),
           "eval/reward_mean": sum(flat) / len(flat),
           "eval/response_tokens_mean": sum(lengths) / len(lengths)}
    passed = [sum(r >= threshold for r in group) for group in rewards]
    for k in k_values(n):
        out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed) / len(passed)
    return out


class Evaluator:
    """Decides when the rollout evaluates and runs one evaluation (see the module docstring).

    ``backend`` generates (the rollout's own), ``dataset`` holds the held-out prompts, ``scorer`` is
    a ``relax.runtime.worker.scoring.RewardScorer``; ``settings`` the run's ``RunSettings``."""

    def __init__(self, settings: Any, backend: Any, dataset: Any, scorer: Any, sampling: Any) -> None:
        self.every, self.steps = settings.eval_every, settings.steps
        self.spec = settings.evaluation
        self.data = settings.data
        self.backend, self.dataset, self.scorer = backend, dataset, scorer
        self.sampling = sampling if self.spec.temperature is None else sampling.model_copy(
            update={"temperature": self.spec.temperature})
        self.seed = settings.seed + EVAL_SEED_OFFSET
        prompts = len(dataset) if self.spec.max_prompts is None else min(self.spec.max_prompts, len(dataset))
        self.indices = list(range(prompts))
        self.done: set[int] = set()
        """Versions evaluated: by this process, and before it (``RunState.evaluated``, which the
        evaluating loops seed it from: a worker restarted in place, a resumed run)."""

    def skip_evaluated(self, env: Any) -> None:
        """Count the versions ``RunState`` says were evaluated as done (by a worker before it was
        restarted in place, or before a resume from a checkpoint: eval.jsonl), so none is evaluated
        twice."""
        self.done.update(env.call(env.state.evaluated.remote()))

    def next_due(self, version: int) -> int:
        """The lowest version after ``version`` that can be due: the next multiple of ``eval_every``
        (none: the final version)."""
        if not self.every:
            return self.steps
        return min(self.steps, (version // self.every + 1) * self.every)

    def due(self, version: int) -> bool:
        """Whether ``version`` is to be evaluated: the final version; with ``eval_every``, also the
        first version held at or after 0 and each multiple (none evaluated since that multiple)."""
        if version in self.done:
            return False
        if version >= self.steps:
            return True
        if not self.every:
            return False
        latest_multiple = version - version % self.every
        return not any(latest_multiple <= v <= version for v in self.done)

    def evaluate(self, version: int) -> dict[str, float]:
        """Generate and score the held-out prompts with the backend's weights (policy ``version``)."""
        started = time.perf_counter()
        n = self.spec.samples_per_prompt
        rows = prompt_rows(self.dataset, self.indices, self.data.prompt_key, self.data.label_key,
                           self.data.reward_key, split="evaluation data")
        gens = self.backend.generate([r["prompt"] for r in rows], n, self.sampling, self.seed)
        samples, routes = [], []
        for i, g in enumerate(gens):
            row = rows[g.prompt_index]
            samples.append(RewardSample(prompt=row["prompt"], response=g.text, label=row["label"], metadata={
                "sample_id": f"eval{version}:{row['index']}:{i % n}", "index": row["index"], "eval": True,
                "policy_version": version, "response_tokens": len(g.response_ids),
                "max_new_tokens": self.sampling.max_new_tokens}))
            routes.append(row.get("route"))
        report = self.scorer.score(samples, routes if self.data.reward_key else None)
        grouped: list[list[float]] = [[] for _ in rows]
        for g, total in zip(gens, report.totals):
            grouped[g.prompt_index].append(float(total))
        figures = eval_metrics(grouped, [len(g.response_ids) for g in gens], self.spec.pass_threshold)
        figures.update({f"eval/{k}": v for k, v in report.stats().items() if k.endswith("/mean")})
        self.done.add(version)
        return {"eval/version": float(version), **figures, "eval/seconds": time.perf_counter() - started}

    def run(self, env: Any, version: int, step: int, who: str) -> None:
        """Evaluate ``version`` (traced as a ``relax.evaluate`` span of ``who``, the rollout or the
        evaluation worker, under ``step``) and post the figures to ``RunState`` for the controller."""
        from relax.telemetry import EVALUATE

        with env.telemetry.span(EVALUATE, step=step, role=who, policy_version=version) as span, \
                env.activity.busy(f"{who} evaluates policy v{version} on data.eval"):
            figures = self.evaluate(version)
            span.set(samples=int(figures["eval/samples"]))
        env.state.post_eval.remote(figures)
