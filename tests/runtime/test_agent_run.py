"""``relax run`` of agentic specs on a real local Ray with the real TransferQueue bus: the tiny agent
preset learns to use its calculator, and environment calls that fail end only their trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import testing
from tests.runtime.test_samples_run import check_health_figures

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


TESTKIT = Path(__file__).parents[1] / "spec" / "testkit"


@pytest.fixture(scope="module")
def local_ray():
    """One Ray for the module; its processes (and this one's registry) also see the test plugins,
    among them ``flaky_calculator``."""
    import os

    import relax.registry

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTKIT))
        # the repository root too: the gateway test's agent program is tests.agents.calculator_program
        paths = [str(TESTKIT), str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
        mp.setattr(relax.registry, "_default", None)  # rediscover with the test plugins
        with testing.local_ray():
            yield


def run(tmp_path: Path, name: str, *overrides: str):
    return testing.tiny_run(tmp_path, name, *overrides, preset="tiny-agent-cpu")


def test_the_tiny_agent_preset_learns_to_use_its_tool(local_ray, tmp_path: Path) -> None:
    # The preset as it is (separate mode, max_staleness 1), shortened; tracing on to see the turns.
    code, rows, _ = run(tmp_path, "learns", "trainer.steps=14", "tracing.exporter=jsonl")
    assert code == 0, rows
    rewards = [r["reward/mean"] for r in rows]
    calls = [r["agent/tool_calls_mean"] for r in rows]
    assert sum(rewards[:2]) / 2 <= 0.3, rewards
    assert sum(rewards[-3:]) / 3 >= 0.6, rewards
    assert sum(calls[:2]) / 2 <= 0.4 and sum(calls[-3:]) / 3 >= 0.8, calls
    for row in rows:
        assert row["samples/consumed"] == 128 * row["step"] and row["samples/regenerated"] == 0
        assert row["agent/turns_mean"] >= 1 and 0 <= row["agent/truncated_frac"] <= 1
    spans = [json.loads(line) for line in (tmp_path / "learns" / "traces.jsonl").read_text().splitlines()]
    names = {s["name"] for s in spans}
    assert {"relax.agent.turn", "relax.agent.tool_call"} <= names
    batches = {s["span_id"] for s in spans if s["name"] == "relax.rollout.batch"}
    turns = [s for s in spans if s["name"] == "relax.agent.turn"]
    assert turns and all(s["parent_id"] in batches for s in turns)


def test_an_environment_that_raises_or_hangs_ends_only_its_trajectories(local_ray, tmp_path: Path) -> None:
    # flaky_calculator: sample 1 of each prompt raises in its first step, sample 2 hangs past the
    # tool timeout. Those trajectories end with an error and keep their place with a zero loss mask;
    # the others go on as usual, and the run goes on, each row counted once.
    code, rows, printed = run(tmp_path, "flaky", "trainer.steps=3", "roles.rollout.agent.environment=flaky_calculator",
                              "roles.rollout.agent.tool_timeout_s=1", "roles.rollout.agent.regenerate_failed=1",
                              "trainer.log_samples_every=1",
                              "trainer.log_samples=16")
    assert code == 0, rows
    assert len(rows) == 3
    check_health_figures(rows)
    assert "HINT" not in printed  # most trajectories end: no truncation hint
    # The samples of an agentic run say how each trajectory went: its turns, calls, what the
    # environment answered, and how it ended (flaky_calculator's failures with their cause).
    samples = [json.loads(line) for line in (tmp_path / "flaky" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 16 + [2] * 16 + [3] * 16
    for sample in samples:
        assert {"turns", "tool_calls", "calls", "observations", "outcome"} <= set(sample)
        assert sample["outcome"] in ("ok", "truncated", "tool_error", "infra", "env_timeout")
        assert ("error" in sample) == (sample["outcome"] in ("infra", "env_timeout"))
    # sample 1 raises ConnectionError (infra), sample 2 hangs past the tool timeout (env_timeout)
    assert {"infra", "env_timeout"} <= {s["outcome"] for s in samples}, samples
    assert any(s["outcome"] == "infra" and "flaky" in s["error"] for s in samples), samples
    called = [s for s in samples if s["calls"]]
    assert called and all(c.startswith("calc(") for s in called for c in s["calls"])
    assert all(s["observations"] for s in called if s["outcome"] == "ok")
    for row in rows:
        # 16 prompts x (one raising + one hanging trajectory), but for those whose first turn was cut
        # at its budget (truncated: they never reach step)
        assert 24 <= row["agent/failed"] <= 32 and row["agent/tool_errors"] >= row["agent/failed"]
        assert row["samples/consumed"] == 128 * row["step"] and row["samples/regenerated"] == 0
        # each failed trajectory was run once more (regenerate_failed=1) and failed again: the flaky
        # environment fails the same samples every time
        assert 24 <= row["agent/regenerated"] <= 32
        assert row["train/tokens"] > 0
        # the hanging calls were given up at their 1 s limit, together: the step did not wait 16 x 30 s
        assert row["time/rollout_s"] < 15


def test_trajectories_that_only_truncate_get_one_hint_naming_the_budget(local_ray, tmp_path: Path) -> None:
    # One token per model turn: no turn ever ends, so every trajectory is truncated at its first.
    code, rows, printed = run(tmp_path, "cut", "trainer.steps=2", "roles.rollout.agent.max_new_tokens=1",
                              "trainer.log_samples_every=1")
    assert code == 0, rows
    assert [r["agent/truncated_frac"] for r in rows] == [1.0, 1.0]
    assert [r["response_length/clip_frac"] for r in rows] == [1.0, 1.0]
    check_health_figures(rows)
    hints = [line for line in printed.splitlines() if "HINT" in line]
    assert len(hints) == 1, printed  # once, not every step
    assert hints[0].startswith("[relax] step 1: HINT: 100% of the trajectories of step 1 ended truncated")
    assert "roles.rollout.agent.max_new_tokens=1" in hints[0]
    samples = [json.loads(line) for line in (tmp_path / "cut" / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2} and all(s["outcome"] == "truncated" for s in samples)
    assert all(s["turns"] == 1 and s["response_tokens"] == 1 for s in samples)


def test_an_agent_program_drives_the_policy_through_the_gateway(local_ray, tmp_path: Path) -> None:
    # The same task, driven by a program written against the OpenAI client instead of an environment,
    # run in two worker processes of the rollout actor (the other gateway runs keep programs in it).
    code, rows, _ = run(tmp_path, "gateway", "trainer.steps=2", "placement.mode=colocate",
                        "async_policy.max_staleness=0", "roles.rollout.agent.environment=null",
                        "roles.rollout.agent.gateway.program=tests.agents.calculator_program:solve",
                        "roles.rollout.agent.gateway.processes=2")
    assert code == 0, rows
    assert len(rows) == 2
    for row in rows:
        assert row["agent/failed"] == 0 and row["train/tokens"] > 0
        assert row["samples/consumed"] == 128 * row["step"]
        assert row["agent/segments_mean"] == 1.0  # the program extends its conversation: no branch
    # the model called the calculator in some trajectories (a quarter of the time at first) and
    # answered right after it, as with the environment
    assert max(r["agent/turns_mean"] for r in rows) > 1.1
    assert max(r["reward/mean"] for r in rows) > 0.1
