"""What a request's ``tool_choice`` and ``response_format`` ask of the model's turn, as a grammar
the rollout backend decodes under (constrained decoding).

A grammar is written in llguidance's Lark dialect (``%json{schema}`` embeds a JSON schema): the
``hf`` backend masks each step's logits with an ``llguidance`` matcher, and an engine whose
structured outputs take Lark grammars can take the same text. One grammar, one place that knows
each tool-call format's markers (``relax.agents.tool_calls``), so a constrained turn parses as
the call it was forced to be.

What is enforced:

- ``tool_choice: required``: the turn is one tool call (several unless ``parallel_tool_calls`` is
  false) of a declared tool, in the model's tool-call format, and nothing else.
- a named tool (OpenAI ``{"type": "function", ...}``, Anthropic ``{"type": "tool", ...}``): a call
  of that tool only.
- ``tool_choice: none``: the turn holds no tool-call marker (it is answered as text).
- ``response_format`` ``json_object`` / ``json_schema`` (Responses: ``text.format``): the text
  answer is JSON (valid against the schema). With ``auto`` and tools, the turn is that JSON or
  tool calls.

The same request is also written for vLLM's structured outputs (``structured_outputs``: the keyword
arguments of its ``StructuredOutputsParams``), served there by xgrammar: ``json`` for a response
format, a ``tags_with_separator`` structural tag for forced calls (the format's opening text and
the call's name are the tag's ``begin``, the arguments its JSON-schema content). ``none`` and a
response format beside ``auto`` tools have no such form: on vLLM they are refused.

Arguments are JSON valid against the tool's schema as far as llguidance's JSON-schema support
goes (an unsupported keyword is a 400 naming the parameter, with llguidance's message). JSON is
generated compactly (``", "`` and ``": "`` separators, no free whitespace): a turn's token budget
then goes to its values. Formats whose calls are not JSON (``qwen3_coder``, ``glm``, ``mistral``,
``deepseek_v3``, ``harmony``) can be kept call-free (``none``, where the format opens a call with
``<tool_call>``) but not forced to call: such a request is a 400 naming the parameter, the format
and the backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from relax.agents.wire_formats import GatewayError
from relax.contracts import ToolSpec

#: How a JSON value is written under a grammar: compact, with the separators ``json.dumps`` uses.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Formats whose tool calls are JSON objects the grammar can force: (opening text, closing text,
#: separator between calls, the key the arguments go under).
_CALL_SHAPES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str, str]] = {
    "hermes": (("<tool_call>", "\n"), ("\n", "</tool_call>"), "\n", "arguments"),
    "llama3_json": ((), (), "; ", "parameters"),
}
#: Formats that open every call with a marker a call-free turn must not write (``none``).
_CALL_MARKERS: dict[str, str] = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "glm": "<tool_call>"}


@dataclass
class Choice:
    """A request's ``tool_choice`` in one shape, whatever the API: ``mode`` is auto, none, required
    or named (then ``name`` is the tool's); ``parallel`` whether a turn may hold several calls."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True


def openai_choice(value: Any, parallel: Any, param: str = "tool_choice") -> Choice:
    """Chat completions' or Responses' ``tool_choice`` (and ``parallel_tool_calls``)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise GatewayError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    many = parallel is not False
    if value is None or value in ("auto", "none", "required"):
        return Choice(value or "auto", parallel=many)
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")  # Responses: {"type": "function", "name": ...}
        if name is None and isinstance(value.get("function"), dict):
            name = value["function"].get("name")  # chat: {"type": "function", "function": {"name": ...}}
        if isinstance(name, str) and name:
            return Choice("named", name, many)
    if isinstance(value, dict) and value.get("type") in ("auto", "none", "required"):
        return Choice(value["type"], parallel=many)
    raise GatewayError(400, f"{param} must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}; got {_shown(value)}", param=param)


def anthropic_choice(value: Any) -> Choice:
    """Anthropic Messages' ``tool_choice``: ``auto``, ``any`` (required), ``tool`` (named), ``none``."""
    if value is None:
        return Choice()
    kind = value.get("type") if isinstance(value, dict) else None
    parallel = not (isinstance(value, dict) and value.get("disable_parallel_tool_use") is True)
    if kind in ("auto", "none"):
        return Choice(kind, parallel=parallel)
    if kind == "any":
        return Choice("required", parallel=parallel)
    if kind == "tool" and isinstance(value.get("name"), str) and value["name"]:
        return Choice("named", value["name"], parallel)
    raise GatewayError(400, "tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} "
                            f"or {{\"type\": \"tool\", \"name\": ...}}; got {_shown(value)}", param="tool_choice")


def response_schema(value: Any, param: str) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` (chat) or ``text.format`` (Responses) asks the answer
    to follow: None for text, ``{"type": "object"}`` for ``json_object``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        holder = value.get("json_schema", value)  # chat nests it; Responses' text.format holds it flat
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if schema is None:
            return {}  # no schema given: any JSON value
        if not isinstance(schema, dict):
            raise GatewayError(400, f"{param}: the json_schema's schema must be a JSON-schema object", param=param)
        return schema
    raise GatewayError(400, f"{param} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                            f"{{\"type\": \"json_schema\", ...}}; got {_shown(value)}", param=param)


def grammar(choice: Choice, schema: dict[str, Any] | None, tools: list[ToolSpec], fmt: str, backend: str,
            tokenizer: Any, format_param: str = "response_format") -> str | None:
    """The Lark grammar (llguidance's dialect) the turn must follow; None: unconstrained.

    Raises ``GatewayError`` (400) for a tool the request does not declare, a format that cannot be
    forced, or a schema llguidance cannot compile, naming the parameter (and the format and backend
    where the format is what cannot be expressed)."""
    answer = None if schema is None else _json_rule(schema)
    if choice.mode in ("required", "named"):
        if not tools:
            raise GatewayError(400, f"tool_choice={choice.mode!r} needs tools: declare the tool in tools",
                               param="tool_choice")
        chosen = tools
        if choice.mode == "named":
            chosen = [t for t in tools if t.name == choice.name]
            if not chosen:
                raise GatewayError(400, f"tool_choice names the function {choice.name!r}, which is not among the "
                                        f"request's tools ({', '.join(t.name for t in tools)})", param="tool_choice")
        text = f"start: {_calls_rule(chosen, fmt, backend, choice, tokenizer)}"
    elif choice.mode == "none" or not tools:
        if answer is not None:
            text = f"start: {answer}"
        elif choice.mode == "none" and tools:
            marker = _CALL_MARKERS.get(fmt)
            if marker is None:
                raise _unexpressible("tool_choice", fmt, backend, "keep a turn free of tool calls")
            if _special_id(tokenizer, marker) is not None:
                text = "start: TEXT\nTEXT: /(?s:.*)/"  # text never holds a special token
            else:
                text = f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*){_regex_escape(marker)}(?s:.*)/"
        else:
            return None
    else:  # auto with tools
        if answer is None:
            return None
        text = f"start: {answer} | {_calls_rule(tools, fmt, backend, choice, tokenizer, format_param)}"
    _check(text, asked_by(choice, schema, format_param))
    return text


def asked_by(choice: Choice, schema: dict[str, Any] | None, format_param: str = "response_format") -> str:
    """The request parameter a turn's grammar comes from (named in a refusal)."""
    return format_param if schema is not None and choice.mode in ("auto", "none") else "tool_choice"


def structured_outputs(choice: Choice, schema: dict[str, Any] | None, tools: list[ToolSpec],
                       fmt: str) -> dict[str, Any] | None:
    """What ``grammar`` asks, as vLLM's ``StructuredOutputsParams`` keyword arguments (xgrammar:
    JSON schemas and structural tags); None where it has no such form (``none``; a response format
    beside ``auto`` tools; a format whose calls are not JSON). Call after ``grammar``, which has
    refused what cannot be asked at all."""
    if choice.mode in ("required", "named"):
        shape = _CALL_SHAPES.get(fmt)
        if shape is None:
            return None
        opening, closing, separator, key = shape
        chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
        tags = [{"type": "tag", "begin": "".join(opening) + f'{{"name": {json.dumps(t.name)}, "{key}": ',
                 "content": {"type": "json_schema", "json_schema": t.parameters or {"type": "object"}},
                 "end": "}" + "".join(closing)} for t in chosen]
        tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                    "separator": separator, "at_least_one": True,
                                                    "stop_after_first": not choice.parallel}}
        return {"structural_tag": json.dumps(tag, ensure_ascii=False)}
    if schema is not None and (choice.mode == "none" or not tools):
        return {"json": schema, "disable_any_whitespace": True}
    return None


def _calls_rule(tools: list[ToolSpec], fmt: str, backend: str, choice: Choice, tokenizer: Any,
                param: str = "tool_choice") -> str:
    shape = _CALL_SHAPES.get(fmt)
    if shape is None:
        raise _unexpressible(param, fmt, backend, "force a tool call")
    opening, closing, separator, key = shape
    bodies = " | ".join(_json_rule(_call_schema(tool, key)) for tool in tools)
    call = " ".join([*(_lit(p, tokenizer) for p in opening), f"({bodies})", *(_lit(p, tokenizer) for p in closing)])
    return f"({call}) ({_lit(separator, tokenizer)} {call})*" if choice.parallel else f"({call})"


def _call_schema(tool: ToolSpec, key: str) -> dict[str, Any]:
    parameters = dict(tool.parameters or {"type": "object"})
    hoisted: dict[str, Any] = {k: parameters.pop(k) for k in ("$defs", "definitions") if k in parameters}
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: parameters or {"type": "object"}},
            "required": ["name", key], "additionalProperties": False, **hoisted}


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json" + json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)


def _lit(text: str, tokenizer: Any) -> str:
    """``text`` as a Lark literal: a string, or ``<[id]>`` where the tokenizer holds it as one
    special token (text never produces a special token, so the grammar must name it)."""
    token = _special_id(tokenizer, text)
    return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}/-" else c for c in text)


def _special_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer holds it as one special token (a grammar must name
    such a token, since text never produces it)."""
    if tokenizer is None:
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in decoder.items() if getattr(t, "special", False)}
    return ids[0] if len(ids) == 1 and ids[0] in special else None



def _check(text: str, param: str) -> None:
    import llguidance

    try:
        compiled = llguidance.LLMatcher.grammar_from_lark(text)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, None)
    except Exception as exc:  # llguidance's refusal of the grammar text is the request's problem
        failed, messages = True, [str(exc)]
    errors = [m for m in messages if "no tokenizer" not in m]
    if failed or errors:
        raise GatewayError(400, f"{param}: the grammar library (llguidance) cannot compile what it asks for: "
                                f"{'; '.join(errors) or 'invalid grammar'}", param=param)


def _unexpressible(param: str, fmt: str, backend: str, what: str) -> GatewayError:
    return GatewayError(400, f"{param} cannot be enforced: the model's tool-call format {fmt!r} "
                             f"(roles.rollout.agent.tool_call_format) writes calls that the rollout backend "
                             f"{backend!r} cannot {what} with a grammar (formats it can: "
                             f"{', '.join(sorted(_CALL_SHAPES))}); leave {param} out and check the reply in "
                             "the program instead", code="unsupported_parameter", param=param)


def _shown(value: Any) -> str:
    shown = json.dumps(value, default=str)
    return shown if len(shown) <= 120 else shown[:120] + "..."
