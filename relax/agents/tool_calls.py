"""Tool calls in a model turn: how they are written (``roles.rollout.agent.tool_call_format``) and
parsed, and why a call is refused.

``hermes`` (the Qwen and Hermes chat templates): each call is ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` anywhere in the turn. A call that cannot be used (a block that is
not closed, its body not a JSON object, no ``name``, a tool the environment does not declare,
arguments that do not fit the tool's schema) is a ``ToolCallError``: the model gets it back as its
observation and the trajectory goes on; it never reaches the environment and never stops the run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from relax.contracts import ToolCall, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

#: JSON-schema ``type`` names and the Python values that satisfy them.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


@dataclass
class ParsedTurn:
    """The tool calls of one turn: the well-formed ones, and what was wrong with the others."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def attempted(self) -> int:
        """Calls the model tried to make, well-formed or not."""
        return len(self.calls) + len(self.errors)


def parse_tool_calls(text: str, tools: list[ToolSpec], fmt: str = "hermes") -> ParsedTurn:
    """The tool calls in a turn's text, checked against the declared ``tools``."""
    if fmt != "hermes":
        raise ValueError(f"unknown tool-call format {fmt!r}; the formats are: hermes")
    declared = {t.name: t for t in tools}
    out = ParsedTurn()
    for i, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            out.errors.append(f"tool call {i + 1}: its body is not valid JSON ({exc.msg} at character {exc.pos}); "
                              f'write {OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}')
            continue
        problem = _check_call(call, declared)
        if problem:
            out.errors.append(f"tool call {i + 1}: {problem}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        out.calls.append(ToolCall(name=call["name"], arguments=arguments, id=f"call_{i}"))
    # An opening tag after the last closed block: a call the model never finished.
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    if OPEN in tail:
        out.errors.append(f"tool call {out.attempted + 1}: {OPEN} is never closed with {CLOSE}")
    return out


def _check_call(call: Any, declared: dict[str, ToolSpec]) -> str:
    """What is wrong with a decoded call, or "" when it can be made."""
    if not isinstance(call, dict):
        return f"expected a JSON object with name and arguments, got {type(call).__name__}"
    name = call.get("name")
    if not isinstance(name, str):
        return "it has no \"name\" string"
    if name not in declared:
        return f"no tool named {name!r}; the tools are: {', '.join(sorted(declared)) or 'none'}"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return check_arguments(arguments, declared[name])


def check_arguments(arguments: dict[str, Any], tool: ToolSpec) -> str:
    """What is wrong with ``arguments`` for ``tool``'s schema (required keys, unknown keys when
    ``additionalProperties`` is false, the ``type`` of each property), or ""."""
    schema = tool.parameters or {}
    properties: dict[str, Any] = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name!r} needs the argument(s) {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(properties))
        if extra:
            return f"{tool.name!r} takes no argument(s) {', '.join(extra)}; it takes {', '.join(sorted(properties))}"
    for key, value in arguments.items():
        wanted = (properties.get(key) or {}).get("type")
        if wanted is None:
            continue
        names = wanted if isinstance(wanted, list) else [wanted]
        allowed = tuple(t for n in names for t in _TYPES.get(n, (object,)))
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and "boolean" not in names):
            return f"argument {key!r} of {tool.name!r} must be {' or '.join(names)}, got {type(value).__name__}"
    return ""


def error_observation(errors: list[str]) -> str:
    """The observation a turn with unusable tool calls gets (the model sees what was wrong)."""
    return "error: " + "; ".join(errors)
