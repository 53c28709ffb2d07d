"""The held-out evaluation's figures and schedule (``relax.runtime.worker.evaluation``), without a run:
pass@k against hand-counted values, and which policy versions a rollout evaluates."""

from __future__ import annotations

from itertools import combinations
from types import SimpleNamespace

import pytest

from relax.runtime.metrics import evaluations_for_row
from relax.runtime.worker.evaluation import Evaluator, eval_metrics, k_values, pass_at_k
from relax.spec.models import EvalSpec


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of the k-subsets of the responses that hold at least one pass."""
    subsets = list(combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("outcomes", [[True, False, False, False], [False] * 5, [True] * 3,
                                      [False, True, False, True, False, False, True, False]])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(outcomes):
    for k in range(1, len(outcomes) + 1):
        assert pass_at_k(len(outcomes), sum(outcomes), k) == pytest.approx(brute_pass_at_k(outcomes, k))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="passed <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_the_reported_k_are_powers_of_two_and_n():
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]


def test_eval_metrics_average_over_prompts_and_count_passes_by_threshold():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 1.0, 1.0]]  # prompt 0: 1 pass of 4; prompt 1: 2 (threshold 1)
    figures = eval_metrics(rewards, [3] * 8, threshold=1.0)
    assert figures["eval/prompts"] == 2 and figures["eval/samples"] == 8
    assert figures["eval/reward_mean"] == pytest.approx(4.0 / 8)
    assert figures["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert figures["eval/pass@2"] == pytest.approx((brute_pass_at_k([1, 0, 0, 0], 2)
                                                    + brute_pass_at_k([0, 0, 1, 1], 2)) / 2)
    assert figures["eval/pass@4"] == 1.0
    assert eval_metrics(rewards, [3] * 8, threshold=0.5)["eval/pass@1"] == pytest.approx((1 / 4 + 1) / 2)


def _evaluator(every: int, steps: int) -> Evaluator:
    settings = SimpleNamespace(eval_every=every, steps=steps, evaluation=EvalSpec(), data=None, seed=0)
    return Evaluator(settings, backend=None, dataset=list(range(10)), scorer=None,
                     sampling=SimpleNamespace(temperature=1.0))


def test_each_multiple_is_evaluated_once_at_the_first_version_held_after_it():
    evaluator = _evaluator(every=10, steps=40)
    evaluated = []
    for held in [0, 0, 1, 2, 9, 11, 12, 19, 23, 31, 32, 40]:  # a rollout's versions, step after step
        if evaluator.due(held):
            evaluator.done.add(held)
            evaluated.append(held)
    assert evaluated == [0, 11, 23, 31, 40]


def test_without_an_interval_only_the_final_version_is_evaluated():
    evaluator = _evaluator(every=0, steps=12)
    assert [v for v in range(13) if evaluator.due(v)] == [12]



class _Published:
    """The run's published policy versions as an evaluation worker sees them: each wait answers
    the newest version, ``lag`` versions past the one asked for (training ran on meanwhile)."""

    def __init__(self, lag: int, steps: int) -> None:
        self.lag, self.steps, self.asked = lag, steps, []

    def wait(self, min_version: int, held: int):
        self.asked.append(min_version)
        version = min(self.steps, min_version + self.lag) if min_version else 0
        return version, ({"w": version} if version > held else None)


class _Backend:
    version = 0

    def load_weights(self, weights, version):
        assert weights == {"w": version}
        self.version = version


@pytest.mark.parametrize("every, lag, before, expected", [
    (10, 0, [], [0, 10, 20, 30, 40]),  # keeps up: each multiple itself
    (10, 7, [], [0, 17, 27, 37, 40]),  # falls behind: the newest version at its turn, one per multiple
    (0, 0, [], [40]),  # no interval: only the final version
    (10, 0, [0, 10], [20, 30, 40]),  # restarted in place after evaluating 0 and 10: goes on from there
])
def test_the_evaluation_worker_evaluates_each_due_version_through_the_final_one(every, lag, before, expected):
    from contextlib import nullcontext

    from relax.runtime.worker.roles.evaluation import EvaluationLoop

    posted = []
    loop = EvaluationLoop.__new__(EvaluationLoop)  # its plugins are pure stand-ins here
    loop.env = SimpleNamespace(settings=SimpleNamespace(steps=40), call=lambda answer: answer,
                               state=SimpleNamespace(evaluated=SimpleNamespace(remote=lambda: before)),
                               telemetry=SimpleNamespace(span=lambda *a, **k: nullcontext()),
                               activity=SimpleNamespace(busy=lambda label: nullcontext()))
    loop.context, loop.backend = SimpleNamespace(device="cuda"), _Backend()
    loop.weights = _Published(lag, 40)
    loop.evaluator = _evaluator(every=every, steps=40)
    loop.evaluator.run = lambda env, version, step, who: (loop.evaluator.done.add(version), posted.append(version))
    assert loop.run(0) == len(expected)
    assert posted == expected and loop.backend.version == 40


def test_a_resumed_run_does_not_evaluate_again_what_its_kept_rows_evaluated(tmp_path):
    """Resuming from the checkpoint of step 6 keeps the evaluations written with rows 1..6; the new
    attempt's ``RunState`` starts from their versions, which every evaluator seeds ``done`` from."""
    import json

    from relax.runtime.metrics import MetricsLog
    from relax.runtime.state.run_state import RunState

    lines = [{"step": 1, "eval/version": 0.0}, {"step": 5, "eval/version": 4.0}, {"step": 9, "eval/version": 8.0}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = MetricsLog(tmp_path, resume_step=6)
    assert log.evaluated_versions() == [0, 4]
    state = RunState(evaluated=log.evaluated_versions())
    state.post_eval({"eval/version": 8.0})
    assert state.evaluated() == [0, 4, 8]
    assert MetricsLog(tmp_path, resume_step=None).evaluated_versions() == []  # a new run starts clean


def test_a_lagging_controller_keeps_a_later_versions_evaluation_for_that_versions_row():
    """The controller was restarting a worker while the run went on: the reports of step 9 (of 10)
    already carry the evaluation of the final version 10. Row 9 takes the evaluation of v8 only;
    v10's waits for row 10, the last row, which therefore needs no further wait."""
    v8, v10 = {"eval/version": 8.0}, {"eval/version": 10.0}
    now, later = evaluations_for_row([v8, v10], 9)
    assert now == [v8] and later == [v10]
    now, later = evaluations_for_row([*later], 10)
    assert now == [v10] and later == []
    assert evaluations_for_row([], 3) == ([], [])
