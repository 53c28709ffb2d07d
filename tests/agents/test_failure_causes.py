"""Failures you can see: a program whose calls are all refused fails with a named cause, printed
once with its first message and then counted, kept in the row's metadata and in the unit's stats.

The issue's case: a system prompt far past ``data.max_prompt_tokens``, through the real gateway and
``openai`` client (the model is never reached, so its turns are not needed)."""

from __future__ import annotations

import io

import openai

from relax.agents.failure_causes import FailureCauses
from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.contracts import AgentTask
from relax.spec.models import AgentSpec, GatewaySpec


def long_system_prompt(task: AgentTask, base_url: str, api_key: str) -> None:
    """Every call refused (the prompt is too long); the program does not catch the error."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
    client.chat.completions.create(model="m", messages=[{"role": "system", "content": "rules. " * 500},
                                                        {"role": "user", "content": task.prompt}])


def crashes(task: AgentTask, base_url: str, api_key: str) -> None:
    raise KeyError("no such tool")


def _run(rollout, program: str, count: int):
    limits = AgentLimits(max_turns=2, max_tokens=100, max_new_tokens=8, tool_timeout_s=30, concurrency=8)
    agent = AgentSpec(gateway=GatewaySpec(program=f"tests.agents.test_failure_causes:{program}"))
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 0, max_prompt_tokens=128)
    tasks = [AgentTask(prompt="hi", label="", row={}, index=0, sample=j, trajectory_id=f"{program}:{j}")
             for j in range(count)]
    try:
        return run_trajectories(tasks, driver, lambda prompts, seed: [], 0).trajectories
    finally:
        driver.close()


def test_each_cause_is_printed_once_with_its_first_message_then_counted(omni_backends):
    rollout, _ = omni_backends
    refused = _run(rollout, "long_system_prompt", 3)
    for t in refused:
        assert t.cause == "BadRequestError:context_length_exceeded"
        summary = t.summary()
        assert summary["cause"] == t.cause and "data.max_prompt_tokens=128" in summary["error"]
    crashed = _run(rollout, "crashes", 2)
    assert {t.cause for t in crashed} == {"KeyError"}

    log = io.StringIO()
    causes = FailureCauses(out=log)
    assert causes.note(refused[:2]) == {"agent_cause/BadRequestError:context_length_exceeded": 2.0}
    assert causes.note(refused[2:] + crashed) == {"agent_cause/BadRequestError:context_length_exceeded": 1.0,
                                                  "agent_cause/KeyError": 2.0}
    assert causes.note([]) == {}
    lines = log.getvalue().splitlines()
    firsts = [line for line in lines if "first of this cause" in line]
    assert len(firsts) == 2  # each cause once, with the first failure's message
    assert "BadRequestError:context_length_exceeded" in firsts[0] and "max_prompt_tokens" in firsts[0]
    assert "KeyError" in firsts[1] and "no such tool" in firsts[1]
    assert lines[-1] == ("relax agent: failed trajectories so far, by cause: "
                         "BadRequestError:context_length_exceeded 3, KeyError 2")
