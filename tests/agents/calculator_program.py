"""An agent program for the gateway, written as a user would: the OpenAI client, the calculator's
tool, its own loop. ``tests/runtime/test_agent_run.py`` runs the tiny agent preset with it
(``roles.rollout.agent.gateway.program: tests.agents.calculator_program:solve``)."""

from __future__ import annotations

import functools
import json

import openai

from relax_plugins.environments.calculator import CalculatorEnvironment
from relax_plugins.environments.tools import ToolError

CALCULATOR = CalculatorEnvironment(CalculatorEnvironment.Config())
TOOLS = [tool.to_openai() for tool in CALCULATOR.tools()]


@functools.cache
def shared_client(base_url: str) -> openai.OpenAI:
    """One client for the run (docs/agents.md): one connection pool and SSL set-up, not one per trajectory."""
    return openai.OpenAI(base_url=base_url, api_key="per-trajectory", max_retries=0)


def solve(task, base_url: str, api_key: str) -> float | None:
    """Ask, run the calculator for each call the model makes, ask again; the reward plugins score
    the last answer (None)."""
    client = shared_client(base_url).with_options(api_key=api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    for _ in range(2):
        message = reply.choices[0].message
        if reply.choices[0].finish_reason != "tool_calls":
            break
        messages.append(message)
        for call in message.tool_calls:
            try:
                result = CALCULATOR.evaluate(json.loads(call.function.arguments)["expr"])
            except ToolError as exc:  # the model wrote an expression the calculator cannot read
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return None
