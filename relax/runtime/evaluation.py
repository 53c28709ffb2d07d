"""Evaluation during training: the held-out prompts (``data.eval``) sampled and scored with one
policy version (``trainer.eval_every``, ``trainer.eval``).

The rollout that hosts the run's step loop evaluates, with the backend it generates with: before
training (version 0), at the first version it holds at or after each multiple of ``eval_every``,
and once more with the final version after the last step. It evaluates right after it produced a
step, so in separate mode the evaluation runs while the actor trains on that step; the next step's
generation starts when the evaluation ends (the actor waits only if the rollout was already the
slower of the two, which with ``max_staleness: 1`` it usually is: then training is delayed by
about the evaluation's length). In colocate mode rollout and training alternate anyway, and the evaluation
adds its time to the step it follows.

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
from relax.runtime.data import prompt_rows

#: The evaluation's sampling seed: fixed, so every version answers the same draws.
EVAL_SEED_OFFSET = 7_777_777


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
    a ``relax.runtime.scoring.RewardScorer``; ``settings`` the run's ``RunSettings``."""

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
        """Versions this process evaluated (a restarted rollout may evaluate one again)."""

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
