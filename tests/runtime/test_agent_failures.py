"""Failures you can see, in a live ``relax run`` of the tiny agent preset behind the gateway (real
local Ray, the real bus): a program that always fails stops the run with its cause on the last
line (exit 1), one that fails one trajectory in ten runs on with the cause counted per step.

In the faults lane (``nox -s faults``): two live runs take about two minutes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_agent_run import local_ray, run  # noqa: F401 - the module's Ray fixture

pytestmark = [pytest.mark.faults, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

GATEWAY = ("placement.mode=colocate", "async_policy.max_staleness=0", "roles.rollout.agent.environment=null")


def test_a_program_that_always_fails_stops_the_run_naming_its_cause(local_ray, tmp_path: Path,  # noqa: F811
                                                                    capfd) -> None:
    code, rows, printed = run(tmp_path, "always", "trainer.steps=2", *GATEWAY,
                              "roles.rollout.agent.gateway.program=tests.agents.failing_programs:always_fails")
    assert code == 1 and not rows, printed
    last = [line for line in capfd.readouterr().err.splitlines() if line.strip()][-1]
    assert last.startswith("relax run: the run failed") and "program_error 128" in last
    assert "raised KeyError: 'tool registry has no entry" in last, last


def test_a_program_that_fails_one_trajectory_in_ten_runs_on_with_the_cause_counted(local_ray,  # noqa: F811
                                                                                    tmp_path: Path) -> None:
    code, rows, printed = run(tmp_path, "tenth", "trainer.steps=2", *GATEWAY,
                              "roles.rollout.agent.gateway.program=tests.agents.failing_programs:fails_one_in_ten")
    assert code == 0 and len(rows) == 2, printed
    for row in rows:
        failed = row.get("agent/cause/KeyError", 0)
        assert 0 < failed < 0.3 * 128 and row["agent/outcome/program_error"] == failed
        assert row["agent/failed"] == failed
