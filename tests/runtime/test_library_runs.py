"""Short ``relax run``s of the tiny model on an environment of each library (real local Ray and bus):
a reasoning-gym generator as data set and reward, a skyrl-gym environment built in code, a gem
game, a verifiers ``ToolEnv`` built in code (the calculator as its tool, its rubric's reward), and
the tiny agent's calculator served by an MCP server over stdio. Each goes a few steps,
records its rewards and fails nothing. The ``envs`` lane runs them (``nox -s envs``)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from relax import testing

pytestmark = [pytest.mark.envs, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).parents[2]

CALC_SERVER = textwrap.dedent('''
    from fractions import Fraction
    from mcp.server import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("calculator")

    @server.tool()
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        if not expr or not set(expr) <= set("0123456789+-*/(). "):
            raise ToolError(f"not arithmetic: {expr}")
        value = eval(expr, {"__builtins__": {}})
        return str(Fraction(value).limit_denominator()) if isinstance(value, float) else str(value)

    server.run(transport="stdio")
''')


@pytest.fixture(scope="module")
def local_ray():
    """One Ray for the module; its workers import the test modules (a skyrl-gym environment built in
    code lives in tests/agents/test_library_adapters.py)."""
    import os

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        with testing.local_ray():
            yield


SHORT = ("trainer.steps=2", "algorithm.prompts_per_step=4", "algorithm.samples_per_prompt=4")


def check(code: int, rows: list[dict], agentic: bool) -> None:
    assert code == 0, rows
    assert len(rows) == 2
    for row in rows:
        assert "reward/mean" in row
        if agentic:
            assert row["agent/failed"] == 0 and row["agent/outcome/env_error"] == 0
            assert row["agent/outcome/env_timeout"] == 0 and row["agent/outcome/infra"] == 0


def test_a_reasoning_gym_generator(local_ray, tmp_path):
    code, rows, _ = testing.tiny_run(
        tmp_path, "rg", *SHORT, "data.train={source: reasoning_gym, options: {name: basic_arithmetic, size: 64}}",
        "data.label_key=entry", "rewards=[{name: reasoning_gym, weight: 1.0, options: {name: basic_arithmetic}}]")
    check(code, rows, agentic=False)


def test_a_skyrl_gym_environment_built_in_code(local_ray, tmp_path):
    code, rows, _ = testing.tiny_run(
        tmp_path, "skyrl", *SHORT, "roles.rollout.agent.environment=skyrl_gym",
        "roles.rollout.agent.environment_options={env: 'tests.agents.test_library_adapters:GuessEnv'}",
        preset="tiny-agent-cpu")
    check(code, rows, agentic=True)


def test_a_gem_game(local_ray, tmp_path):
    pytest.importorskip("gem", reason="gem-llm pins msgspec 0.19 against the project's 0.23: it is installed only in "
                                 "nox -s envs")
    env = "game:GuessTheNumber-v0-easy"
    code, rows, _ = testing.tiny_run(
        tmp_path, "gem", *SHORT, f"data.train={{source: gem, options: {{env: '{env}', size: 64}}}}",
        "data.label_key=seed", "data.max_prompt_tokens=512", "roles.rollout.agent.max_tokens=256",
        "roles.rollout.agent.environment=gem", f"roles.rollout.agent.environment_options={{env: '{env}'}}",
        preset="tiny-agent-cpu")
    check(code, rows, agentic=True)


def calculator_tool_env():
    """A verifiers ToolEnv built in code: the tiny agent's ``calc`` as its tool, its rubric rewarding
    an answer equal to the label (the Ray workers import it by ``module:function``)."""
    from fractions import Fraction

    import verifiers as vf
    from datasets import Dataset

    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expr: The expression, digits and + - * / ( ).
        """
        if not expr or not set(expr) <= set("0123456789+-*/(). "):
            raise ValueError(f"not arithmetic: {expr}")
        value = eval(expr, {"__builtins__": {}})
        return str(Fraction(value).limit_denominator()) if isinstance(value, float) else str(value)

    async def exact(completion, answer) -> float:
        said = [m.content for m in completion if m.role == "assistant" and isinstance(m.content, str)]
        return float(bool(said) and said[-1].strip() == str(answer).strip())

    return vf.ToolEnv(tools=[calc], max_turns=4, rubric=vf.Rubric(funcs=[exact]),
                      dataset=Dataset.from_list([{"question": "1*1=", "answer": "1"}]))


def test_a_verifiers_tool_env_built_in_code(local_ray, tmp_path):
    pytest.importorskip("verifiers.legacy", reason="verifiers 0.3.1 pins mcp<2 against the project's 2.3.0: it is "
                        "installed only in nox -s envs")
    code, rows, _ = testing.tiny_run(
        tmp_path, "verifiers", "trainer.steps=2", "roles.rollout.agent.environment=verifiers",
        "roles.rollout.agent.environment_options={env: 'tests.runtime.test_library_runs:calculator_tool_env'}",
        "rewards=[{name: exact_match, weight: 0.0}]", preset="tiny-agent-cpu")  # the rubric's reward alone
    check(code, rows, agentic=True)
    assert max(r["agent/tool_calls_mean"] for r in rows) > 0  # the model's calls reached the ToolEnv's tool
    assert max(r["reward/mean"] for r in rows) > 0  # the rubric scored some answers right


def test_the_tiny_agent_calls_its_calculator_through_mcp(local_ray, tmp_path):
    server = tmp_path / "calc_server.py"
    server.write_text(CALC_SERVER)
    code, rows, _ = testing.tiny_run(
        tmp_path, "mcp", "trainer.steps=2", "roles.rollout.agent.environment=mcp",
        f"roles.rollout.agent.environment_options={{servers: [{{name: calc, command: ['{sys.executable}', "
        f"'{server}']}}]}}", preset="tiny-agent-cpu")
    check(code, rows, agentic=True)
    assert max(r["agent/tool_calls_mean"] for r in rows) > 0  # the model's calls reached the server
