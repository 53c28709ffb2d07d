"""Reward entries in the spec: validation rules, and the reward loop's routing and statistics."""

from __future__ import annotations

from pathlib import Path

from types import SimpleNamespace

import pytest

from relax.spec import RunSpec, SpecError, validate_spec

JUDGE = {"name": "genrm", "options": {"model": "builtin:tiny-lm", "model_options": {"task": "judge"},
                                      "template": "{prompt}{response}?"}}


def issues(raw: dict) -> dict[str, str]:
    try:
        validate_spec({"name": "rewards", "tracing": {"exporter": "none"}, **raw})
    except SpecError as exc:
        return {i.path: f"{i.message} | {i.remedy}" for i in exc.issues}
    return {}


def test_a_judge_needs_reward_workers_of_its_own():
    found = issues({"rewards": [JUDGE]})
    assert "serves a model" in found["roles.reward.host"] and "set roles.reward.host: own" in found["roles.reward.host"]
    assert issues({"rewards": [JUDGE], "roles": {"reward": {"host": "own"}}}) == {}


def test_the_judge_backend_and_its_options_are_checked():
    bad = {**JUDGE, "options": {**JUDGE["options"], "backend": "nope"}}
    assert "no rollout plugin named 'nope'" in issues({"rewards": [bad], "roles": {"reward": {"host": "own"}}})[
        "rewards[0].options.backend"]
    bad = {**JUDGE, "options": {**JUDGE["options"], "backend_options": {"max_batch_sise": 4}}}
    found = issues({"rewards": [bad], "roles": {"reward": {"host": "own"}}})
    assert "rewards[0].options.backend_options.max_batch_sise" in found


def test_a_builtin_judge_models_options_are_checked():
    bad = {**JUDGE, "options": {**JUDGE["options"], "model_options": {"task": "judg"}}}
    found = issues({"rewards": [bad], "roles": {"reward": {"host": "own"}}})
    assert "tiny-lm" in found["rewards[0].options.model_options.task"]


def test_judge_templates_are_checked():
    bad = {**JUDGE, "options": {**JUDGE["options"], "template": "{question} {response}"}}
    found = issues({"rewards": [bad], "roles": {"reward": {"host": "own"}}})
    assert "unknown field(s) ['question']" in found["rewards[0].options.template"]


def test_reward_ids_must_be_distinct():
    found = issues({"rewards": [{"name": "exact_match"}, {"name": "exact_match", "weight": 0.5}]})
    assert "'exact_match' also names rewards[0]" in found["rewards[1].id"]
    assert issues({"rewards": [{"name": "exact_match"}, {"name": "exact_match", "id": "strict"}]}) == {}


def test_reward_policy_fields_are_typed():
    found = issues({"rewards": [{"name": "exact_match", "on_error": "ignore", "timeout_s": 0}]})
    assert set(found) == {"rewards[0].on_error", "rewards[0].timeout_s"}


class RecordingSpan:
    def __init__(self) -> None:
        self.attributes: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def set(self, **attributes) -> None:
        self.attributes.update(attributes)


def reward_loop(overrides: dict):
    import torch  # noqa: F401  (the loop builds tensors)

    from relax.plan.model import RoleWiring
    from relax.plan.wiring import reward_uses, run_settings
    from relax.runtime.worker.roles.reward import RewardLoop

    # Shape only: the loop is handed its rows, so the data set's columns (which validation checks
    # data.reward_key against) do not matter here.
    spec = RunSpec.model_validate({"name": "loop", "tracing": {"exporter": "none"}, **overrides})
    span = RecordingSpan()
    telemetry = SimpleNamespace(span=lambda *a, **k: span)
    wiring = RoleWiring(role="reward", task="reward", rewards=reward_uses(spec), reads=["prompt", "response", "label"])
    from relax.runtime.state.health import Activity

    env = SimpleNamespace(settings=run_settings(spec, Path.cwd()), telemetry=telemetry, activity=Activity())
    return RewardLoop(env, wiring), span


def test_the_reward_loop_routes_rows_and_reports_each_reward():
    loop, span = reward_loop({
        "data": {"reward_key": "source"},
        "rewards": [{"name": "exact_match", "id": "arith"},
                    {"name": "regex", "id": "fmt", "options": {"pattern": r"^\d+$"}, "weight": 0.5},
                    {"name": "overlong_penalty", "options": {"buffer": 2}, "always": True}],
        "roles": {"rollout": {"sampling": {"max_new_tokens": 4}}},
    })
    columns = {"prompt": ["1+1=", "1+2=", "2+2="], "response": ["2", "x", "5"], "label": ["2", "3", "4"]}
    meta = [{"sample_id": "0:0:0", "reward_route": "arith", "response_tokens": 1, "trace": {"t": 1}},
            {"sample_id": "0:1:0", "reward_route": "fmt", "response_tokens": 4},
            {"sample_id": "0:2:0", "reward_route": None, "response_tokens": 3}]
    total = loop.score(3, columns, meta)
    # row 0: exact 1 (+0 length); row 1: fmt miss 0, length -1 at the limit; row 2: all: 0 + 0.5 + -0.5
    assert total.tolist() == pytest.approx([1.0, -1.0, 0.0])
    stats = loop._stats[3]
    assert stats["reward_mean"] == pytest.approx(0.0)
    assert stats["rewards"]["arith/mean"] == 0.5 and stats["rewards"]["arith/count"] == 2
    assert stats["rewards"]["overlong_penalty/mean"] == pytest.approx(-0.5)
    assert not any(k.endswith("_s") for k in stats["rewards"])  # timings summed by bus_task are top-level only
    assert span.attributes["relax.reward.fmt.mean"] == 0.5


def test_the_reward_loop_reads_lengths_and_names_failing_samples():
    from relax.runtime.worker.scoring import RewardError

    loop, _ = reward_loop({"rewards": [{"name": "overlong_penalty", "options": {"buffer": 2}},
                                       {"name": "math_verify", "id": "math"}],
                           "roles": {"rollout": {"sampling": {"max_new_tokens": 4}}}})
    import torch

    columns = {"prompt": ["q", "q"], "response": ["\\boxed{3}", "3"], "label": ["3", None],
               "lengths": torch.tensor([[2, 3], [2, 4]])}
    meta = [SimpleNamespace(sample_id="7:0:0", policy_version=7, extra={"group": 0}),
            SimpleNamespace(sample_id="7:1:0", policy_version=7, extra={"group": 0})]
    with pytest.raises(RewardError, match=r"reward 'math' \(math_verify\) failed on sample 7:1:0: .*has no label"):
        loop.score(7, columns, meta)
    columns["label"] = ["3", "4"]
    assert loop.score(7, columns, meta).tolist() == pytest.approx([0.5, -1.0])


def test_an_earlier_segment_is_not_scored_and_gets_its_trajectory_s_reward():
    """A trajectory of two segments is two rows: the earlier one (``agent.linked``) takes the reward of
    the last one's row (its own text is not scored), and the figures count each trajectory once."""
    loop, _ = reward_loop({"rewards": [{"name": "exact_match"}],
                           "roles": {"rollout": {"agent": {"environment": "calculator", "turn_reward_weight": 0.5}}}})
    columns = {"prompt": ["2*21", "2*21", "3+4"], "response": ["wrong", "42", "8"], "label": ["42", "42", "7"]}
    meta = [{"sample_id": "0:0:0", "group": 0, "sample": 0, "segment": 0, "agent": {"outcome": "ok", "linked": True}},
            {"sample_id": "0:0:0", "group": 0, "sample": 0, "segment": 1,
             "agent": {"outcome": "ok", "turn_reward": 1.0, "segments": 2}},
            {"sample_id": "0:1:0", "group": 1, "sample": 0, "agent": {"outcome": "ok"}}]
    total = loop.score(0, columns, meta)
    assert total.tolist() == [1.5, 1.5, 0.0]  # exact match 1 + 0.5 x the turn reward, on both segments' rows
    assert loop._stats[0]["reward_mean"] == 0.75  # over the two trajectories
    assert loop._stats[0]["rewards"]["exact_match/count"] == 2
