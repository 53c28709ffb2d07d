"""A small base for environments whose every turn is tool calls: each call goes to a method, the
results of one turn come back as one observation, and a turn without calls ends the trajectory.

A subclass declares its tools in ``tools()`` and implements one ``tool_<name>(state, **arguments)``
method per tool, returning the result text. A problem with the call's input (a bad expression, a
missing file) is raised as ``ToolError``: the model reads it as ``error: ...`` and may try again. Any
other exception is a bug of the environment and propagates (the runtime fails that trajectory with
its reason, not the run).
"""

from __future__ import annotations

import inspect
from typing import Any

from relax.contracts import AgentTask, Observation, ToolCall, ToolSpec, Turn


class ToolError(Exception):
    """A tool call the tool cannot serve; its message is what the model sees after ``error: ``."""


class ToolEnvironment:
    """Dispatches the calls of a turn to ``tool_<name>`` methods; stateless between trajectories
    (the per-trajectory state is the dict ``start`` returns), so ``start`` and ``step`` may run
    concurrently for different trajectories."""

    max_calls_per_turn: int = 4
    """Calls served per turn; the ones past it get an error line (a subclass sets it from its config)."""

    def tools(self) -> list[ToolSpec]:
        raise NotImplementedError(f"{type(self).__name__} must declare its tools")

    def start(self, task: AgentTask) -> dict[str, Any]:
        """The trajectory's state: its task and how many calls it made."""
        return {"task": task, "calls": 0}

    def step(self, state: dict[str, Any], turn: Turn) -> Observation:
        """The results of the turn's calls, one line each, in order; ``done`` when it made none."""
        if not turn.tool_calls:
            return Observation(done=True, info={"tool_calls": 0})
        lines, errors = [], 0
        for i, call in enumerate(turn.tool_calls):
            if i >= self.max_calls_per_turn:
                text = f"error: at most {self.max_calls_per_turn} tool calls per turn; this one was not run"
                errors += 1
            else:
                text, failed = self._call(state, call)
                errors += failed
            lines.append(text)
        state["calls"] = state.get("calls", 0) + len(turn.tool_calls)
        names = ",".join(dict.fromkeys(call.name for call in turn.tool_calls))
        return Observation(content="\n".join(lines), role="tool",
                           info={"tool": names, "tool_calls": len(turn.tool_calls), "tool_errors": errors})

    def _call(self, state: dict[str, Any], call: ToolCall) -> tuple[str, bool]:
        """The call's result text and whether it failed."""
        method = getattr(self, f"tool_{call.name}", None)
        if method is None:  # the rollout checks names against tools(); a mismatch is this class's bug
            raise NotImplementedError(f"{type(self).__name__} declares tool {call.name!r} but has no "
                                      f"tool_{call.name} method")
        try:
            inspect.signature(method).bind(state, **call.arguments)
        except TypeError as exc:  # arguments the schema let through but the method does not take
            return f"error: bad arguments for {call.name}: {exc}", True
        try:
            return str(method(state, **call.arguments)), False
        except ToolError as exc:
            return f"error: {exc}", True
