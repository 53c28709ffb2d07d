"""Trajectory outcomes and the environment lifecycle: every trajectory ends with one typed outcome,
counted per kind; infrastructure failures past a fraction stop the run by name; ``close(state)``
runs once per trajectory on every path and ``setup``/``teardown`` once per worker; refused calls
count per format. The model is scripted (see test_runner.py)."""

from __future__ import annotations

import threading
import time

import pytest

from relax.agents.chat import ChatTokens
from relax.agents.outcomes import InfraFailureLimit, check_failed_frac, healthy
from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
from relax.contracts import AgentTask, Observation
from tests.agents.test_runner import CALL, Script, Waiter


@pytest.fixture(scope="module")
def tokenizer(omni_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_path)


class Lifecycle(Waiter):
    """A waiter that records its lifecycle calls; ``lost_for`` trajectories lose their server."""

    def __init__(self, lost_for=frozenset(), start_fails_for=frozenset(), **kw) -> None:
        super().__init__(**kw)
        self.lost_for, self.start_fails_for = lost_for, start_fails_for
        self.closed: list[object] = []
        self.setups = self.teardowns = 0
        self._close_lock = threading.Lock()

    def setup(self) -> None:
        self.setups += 1

    def teardown(self) -> None:
        self.teardowns += 1

    def start(self, task: AgentTask) -> int:
        if task.sample in self.start_fails_for:
            raise RuntimeError("no sandbox left")
        return task.sample

    def step(self, state: int, turn) -> Observation:
        if state in self.lost_for:
            raise ConnectionResetError("the tool server closed the connection")
        return super().step(state, turn)

    def close(self, state) -> None:
        with self._close_lock:
            self.closed.append(state)


def driver_for(tokenizer, environment, **limits):
    settings = dict(max_turns=4, max_tokens=400, max_new_tokens=80, tool_timeout_s=10.0, concurrency=16)
    settings.update(limits)
    chat = ChatTokens(tokenizer, environment.tools(), None, 256)
    return EnvironmentDriver(environment, "waiter", chat, AgentLimits(**settings), version=lambda: 1)


def tasks(count: int) -> list[AgentTask]:
    return [AgentTask(prompt=f"task {j}", label=None, row={}, index=0, sample=j, trajectory_id=f"0:0:{j}")
            for j in range(count)]


def test_every_trajectory_ends_with_its_outcome_and_close_runs_on_every_path(tokenizer):
    environment = Lifecycle(raise_for=frozenset({3}), hang_for=frozenset({4}), lost_for=frozenset({5}),
                            start_fails_for=frozenset({6}))
    script = Script(tokenizer, {0: [CALL % 0, "done"],
                                1: [CALL % 0] * 4,                                          # turns spent
                                2: ["<tool_call>{not json</tool_call>", "done"],            # refused, then ends
                                3: [CALL % 0, "done"], 4: [CALL % 0, "done"], 5: [CALL % 0, "done"],
                                6: ["done"]})
    driver = driver_for(tokenizer, environment, tool_timeout_s=0.5)
    assert environment.setups == 1
    started = time.monotonic()
    batch = run_trajectories(tasks(7), driver, script, seed=0)
    assert time.monotonic() - started < 15
    outcomes = [t.outcome for t in batch.trajectories]
    assert outcomes == ["ok", "truncated", "tool_error", "env_error", "env_timeout", "infra", "env_error"]
    assert [t.summary()["outcome"] for t in batch.trajectories] == outcomes
    for kind, n in {"ok": 1, "truncated": 1, "tool_error": 1, "env_error": 2, "env_timeout": 1, "infra": 1,
                    "program_error": 0}.items():
        assert batch.stats[f"agent_outcome/{kind}"] == n
    assert batch.stats["agent_malformed_calls/hermes"] == 1
    # close(state) once per trajectory, including the failed, hung and lost ones; None where start failed
    assert sorted(environment.closed, key=str) == sorted([0, 1, 2, 3, 4, 5, None], key=str)
    # infrastructure outcomes train on nothing; model outcomes train as before
    gens = [t.to_generation(0) for t in batch.trajectories]
    assert [sum(g.loss_mask) > 0 for g in gens] == [True, True, True, False, False, False, False]
    assert healthy([{"agent": t.summary()} for t in batch.trajectories]) == [True] * 3 + [False] * 4
    driver.close()
    driver.close()
    assert environment.teardowns == 1


def test_infrastructure_failures_past_the_fraction_stop_with_a_named_cause(tokenizer):
    environment = Lifecycle(lost_for=frozenset({0, 1}))
    script = Script(tokenizer, {j: [CALL % 0, "done"] for j in range(4)})
    driver = driver_for(tokenizer, environment)
    batch = run_trajectories(tasks(4), driver, script, seed=0, max_failed_frac=0.5)  # 2 of 4: at the limit
    assert batch.stats["agent_outcome/infra"] == 2
    with pytest.raises(InfraFailureLimit, match=r"2 of 4 trajectories failed \(infra 2\), "
                                                r"more than roles.rollout.agent.max_failed_frac=0.25; the first: "
                                                r".*ConnectionResetError: the tool server closed the connection"):
        run_trajectories(tasks(4), driver, Script(tokenizer, script.turns), seed=0, max_failed_frac=0.25)


def test_the_failed_fraction_check_alone():
    check_failed_frac({"ok": 3.0, "env_timeout": 1.0}, None)
    check_failed_frac({"ok": 3.0, "env_timeout": 1.0}, 0.25)
    with pytest.raises(InfraFailureLimit, match="env_timeout 1, program_error 1"):
        check_failed_frac({"ok": 2.0, "env_timeout": 1.0, "program_error": 1.0, "tool_error": 5.0}, 0.2)


def test_a_failing_close_is_recorded_and_keeps_the_outcome(tokenizer):
    class BadClose(Lifecycle):
        def close(self, state) -> None:
            raise RuntimeError("could not delete the sandbox")

    script = Script(tokenizer, {0: [CALL % 0, "done"]})
    batch = run_trajectories(tasks(1), driver_for(tokenizer, BadClose()), script, seed=0)
    (traj,) = batch.trajectories
    assert traj.outcome == "ok" and "could not delete the sandbox" in traj.info["close_error"]


def test_a_failing_setup_stops_the_worker_by_name(tokenizer):
    class BadSetup(Lifecycle):
        def setup(self) -> None:
            raise OSError("port 7000 is taken")

    with pytest.raises(Exception, match="environment 'waiter': setup raised OSError: port 7000 is taken"):
        driver_for(tokenizer, BadSetup())


def test_the_infra_limit_stops_the_run_and_outcomes_reach_the_metrics_row():
    from relax.runtime.failure_class import repeats_on_retry
    from relax.runtime.worker.roles.rollout import merge_unit_stats

    with pytest.raises(InfraFailureLimit) as caught:
        check_failed_frac({"ok": 1.0, "infra": 3.0}, 0.5)
    assert repeats_on_retry(caught.value)  # the worker is not restarted into the same broken environment
    assert not repeats_on_retry(RuntimeError("the sandbox service hiccuped"))
    unit = {"admission_wait_s": 0.0, "weight_load_s": 0.0, "rollout_s": 1.0, "bus_s": 0.0, "response_tokens": 5,
            "order": [0], "policy_version": 0, "holder": "r0"}
    merged = merge_unit_stats([{**unit, "agent_outcome/ok": 3.0, "agent_outcome/infra": 1.0,
                                "agent_malformed_calls/hermes": 2.0},
                               {**unit, "agent_outcome/ok": 4.0, "agent_malformed_calls/hermes": 1.0}])
    assert merged["agent_outcome/ok"] == 7.0 and merged["agent_outcome/infra"] == 1.0
    assert merged["agent_malformed_calls/hermes"] == 3.0


def test_max_failed_frac_defaults_to_half_and_the_old_key_names_the_new_one():
    from pydantic import ValidationError

    from relax.spec.models import AgentSpec

    assert AgentSpec(environment="calculator").max_failed_frac == 0.5
    assert AgentSpec(environment="calculator", max_failed_frac=None).max_failed_frac is None
    with pytest.raises(ValidationError, match="max_infra_fraction was renamed max_failed_frac"):
        AgentSpec(environment="calculator", max_infra_fraction=0.5)
