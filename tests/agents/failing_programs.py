"""Agent programs that fail, for the visible-failure runs (``tests/runtime/test_agent_failures.py``):
one that always fails and one that fails about one trajectory in ten, otherwise the calculator
program."""

from __future__ import annotations

import zlib

from tests.agents.calculator_program import solve


def always_fails(task, base_url: str, api_key: str) -> None:
    raise KeyError(f"tool registry has no entry for task {task.index}")


def fails_one_in_ten(task, base_url: str, api_key: str) -> float | None:
    if zlib.crc32(task.trajectory_id.encode()) % 10 == 0:
        raise KeyError(f"tool registry has no entry for task {task.index}")
    return solve(task, base_url, api_key)
