"""The request and reply shapes of the APIs the agent gateway speaks, turned into one model call.

An agent program may talk to the policy through any of four APIs; each request becomes a
``ModelCall`` (chat messages, function tools, a token cap) and each model turn comes back as a
``Reply``, which is written in the API's own shape, whole or as server-sent events:

- OpenAI Chat Completions (``POST /v1/chat/completions``), streamed with ``stream: true``;
- OpenAI Responses (``POST /v1/responses``): input items, function tools, ``function_call`` and
  ``function_call_output`` items, ``previous_response_id``, streamed events;
- Anthropic Messages (``POST /v1/messages``): text, ``tool_use`` and ``tool_result`` blocks,
  streamed events;
- the legacy OpenAI Completions (``POST /v1/completions``): text in, text out, for programs that
  render their prompts themselves (``TextCall``).

A turn is generated whole (the batcher serves a turn in one backend call), so a streamed reply is
the same turn cut into events once it is generated: the tokens a program reads streamed are the
tokens it reads unstreamed, and those the trajectory records. Refusals carry the API's error shape
(OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", "error": {...}}``) and a 4xx status
for whatever is wrong with the request.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.contracts import ToolSpec

#: The model name ``GET /v1/models`` lists (a request may name any model: there is only the policy).
MODEL_ID = "relax-policy"

Api = Literal["chat", "responses", "messages", "completions", "turn_reward"]
ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """A request the gateway refuses, with its HTTP status and the API's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self, api: Api | None = None) -> dict[str, Any]:
        """The error body in the API's shape (Anthropic's for ``messages``, OpenAI's otherwise)."""
        if api == "messages":
            kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error"}.get(self.status, "api_error" if self.status >= 500 else self.kind)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Message:
    """A chat message as the gateway compares and renders it (text only)."""

    role: str
    content: str
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """``name`` and ``tool_call_id``: passed to the template, not compared."""

    def same(self, other: Message) -> bool:
        """Equal as the model read it, up to whitespace and ``content: null`` for empty text (what
        clients change when they re-serialize a history): neither is an edit."""
        return (self.role, _squeezed(self.content), self.tool_calls) == \
            (other.role, _squeezed(other.content), other.tool_calls)

    def template(self, developer: str = "developer") -> dict[str, Any]:
        """The message as Hugging Face chat templates take it (tool-call arguments as objects);
        ``developer``: the template's role for a developer message."""
        role = developer if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content, **self.extra}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                                 for n, a in self.tool_calls]
        return out


def _squeezed(text: str) -> str:
    return " ".join(text.split())


@dataclass
class ModelCall:
    """One model turn a chat-style request asks for."""

    messages: list[Message]
    tools: list[ToolSpec]
    tools_key: str
    max_tokens: int | None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = MODEL_ID
    previous_response_id: str | None = None
    """Responses API: the response whose conversation ``messages`` continue (resolved by the gateway)."""
    instructions: str | None = None
    """Responses API: the system message in front of the conversation."""
    tool_choice: Any = None
    """The request's ``tool_choice`` as sent (read by ``relax.agents.constraints``)."""
    parallel_tool_calls: Any = None
    response_format: Any = None
    """Chat's ``response_format`` or Responses' ``text.format``, as sent (``format_param`` names it)."""
    format_param: str = "response_format"
    grammar: str | None = None
    """The grammar the turn is decoded under (``relax.agents.constraints``); None: unconstrained."""
    structured_outputs: dict[str, Any] | None = None
    """The same for vLLM's structured outputs (None: it has no such form)."""
    tool_calls_off: bool = False
    """``tool_choice: none``: the turn is answered as text, never parsed for tool calls."""


@dataclass
class TextCall:
    """One model turn of the legacy completions API: the prompt as the program rendered it."""

    prompt: str
    max_tokens: int | None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str = MODEL_ID


@dataclass
class Reply:
    """A generated turn as every API writes it."""

    text: str
    """The turn's decoded text (tool-call blocks included)."""
    content: str | None
    """The text the program gets (tool-call blocks removed when they were parsed as calls)."""
    calls: list[tuple[str, str, dict[str, Any]]]
    """``(id, name, arguments)`` of each tool call."""
    finish: Literal["stop", "length", "tool_calls"]
    token_ids: list[int]
    token_text: Callable[[list[int]], list[str]]
    """Each token's text, decoded one by one (``tokens``)."""
    logprobs: list[float]
    prompt_tokens: int
    pieces: list[str] | None = None
    """The content cut at token boundaries (joined they are ``content``), or None when it cannot be."""

    @functools.cached_property
    def tokens(self) -> list[str]:
        """Each token's text: decoded only for a reply that shows log-probs (most calls do not ask)."""
        return self.token_text(self.token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


# -- reading requests --------------------------------------------------------------------------------


def _obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    return body


def _cap(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GatewayError(400, f"{name} must be a positive integer, got {value!r}", param=name)
        return value
    return None


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise GatewayError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise GatewayError(400, "stream_options must be an object", param="stream_options")
    return _flag(options, "include_usage")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else MODEL_ID


def _arguments(where: str, arguments: Any) -> dict[str, Any]:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise GatewayError(400, f"{where} has arguments that are not JSON ({exc.msg})") from exc
    if not isinstance(arguments, dict):
        raise GatewayError(400, f"{where} has arguments that are not a JSON object")
    return arguments


def _text(where: str, content: Any, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text content: a string, null, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: content must be a string or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise GatewayError(400, f"{where} has a {kind!r} content part; the gateway takes text only (images and "
                                    "audio reach the model through environments, see docs/agents.md)",
                               code="unsupported_content")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise GatewayError(400, f"{where}: a text part's text must be a string")
        parts.append(text)
    return "".join(parts)


def _function_tools(raw: Any, param: str,
                    shape: Literal["chat", "responses", "messages"]) -> tuple[list[ToolSpec], str]:
    """Function tools as ``ToolSpec``, and a key to compare them by (they are part of the prompt)."""
    if raw is None:
        return [], "[]"
    if not isinstance(raw, list):
        raise GatewayError(400, f"{param} must be a list of function tools", param=param)
    tools = []
    for i, tool in enumerate(raw):
        if shape == "chat":
            spec = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" \
                else None
            schema_key, example = "parameters", '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
        elif shape == "responses":
            spec = tool if isinstance(tool, dict) and tool.get("type") == "function" else None
            schema_key, example = "parameters", '{"type": "function", "name": ..., "parameters": {...}}'
        else:
            spec = tool if isinstance(tool, dict) and tool.get("type", "custom") == "custom" else None
            schema_key, example = "input_schema", '{"name": ..., "input_schema": {...}}'
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise GatewayError(400, f"{param}[{i}]: only function tools are supported ({example})", param=param)
        parameters = spec.get(schema_key) or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise GatewayError(400, f"{param}[{i}].{schema_key} must be a JSON schema object", param=param)
        description = spec.get("description")
        tools.append(ToolSpec(spec["name"], description if isinstance(description, str) else "", parameters))
    return tools, json.dumps([t.to_openai() for t in tools], sort_keys=True, default=str)


def chat_message(index: int, raw: Any) -> Message:
    """A Chat Completions message, checked: a known role, text content, tool calls with JSON arguments."""
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise GatewayError(400, f"{where} must be an object with role and content")
    role = raw.get("role")
    if role not in ROLES:
        raise GatewayError(400, f"{where} has role {role!r}; the roles are: {', '.join(ROLES)}")
    calls = []
    raw_calls = raw.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise GatewayError(400, f"{where}: tool_calls must be a list")
    for j, call in enumerate(raw_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GatewayError(400, f"{where}: tool call {j} needs function.name and function.arguments")
        calls.append((function["name"], _arguments(f"{where}: tool call {j}", function.get("arguments"))))
    extra = {k: raw[k] for k in ("name", "tool_call_id") if isinstance(raw.get(k), str)}
    return Message(role, _text(where, raw.get("content")), calls, extra)


def read_chat(body: Any, backend: str) -> ModelCall:
    """A ``POST /v1/chat/completions`` request."""
    body = _obj(body)
    if body.get("n") not in (None, 1):
        raise GatewayError(400, "n must be 1: each call is one turn of one trajectory", code="unsupported_parameter",
                           param="n")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "messages must be a non-empty list of chat messages", param="messages")
    messages = [chat_message(i, m) for i, m in enumerate(raw)]
    tools, key = _function_tools(body.get("tools"), "tools", "chat")
    return ModelCall(messages, tools, key, _cap(body, "max_completion_tokens", "max_tokens"),
                     logprobs=_flag(body, "logprobs"), stream=_flag(body, "stream"),
                     include_usage=_include_usage(body), model=_model(body), tool_choice=body.get("tool_choice"),
                     parallel_tool_calls=body.get("parallel_tool_calls"),
                     response_format=body.get("response_format"))


def read_responses(body: Any, backend: str) -> ModelCall:
    """A ``POST /v1/responses`` request: ``instructions``, then the input items as messages
    (``function_call`` items join the assistant message before them, ``function_call_output``
    items become tool messages)."""
    body = _obj(body)
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError(400, "instructions must be a string", param="instructions")
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "input must be a string or a non-empty list of input items", param="input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise GatewayError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise GatewayError(400, f"{where} has role {role!r}; a message item's roles are: system, developer, "
                                        "user, assistant", param="input")
            messages.append(Message(role, _text(where, item.get("content"), ("input_text", "output_text", "text"))))
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise GatewayError(400, f"{where}: a function_call item needs name, call_id and arguments",
                                   param="input")
            call = (name, _arguments(where, item.get("arguments")))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls.append(call)
            else:
                messages.append(Message("assistant", "", [call]))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise GatewayError(400, f"{where}: a function_call_output item needs call_id and output",
                                   param="input")
            text = output if isinstance(output, str) else _text(where, output, ("input_text", "output_text", "text"))
            messages.append(Message("tool", text, extra={"tool_call_id": call_id}))
        elif kind == "reasoning":
            continue  # the policy's reasoning is in its text; a reasoning item adds nothing to render
        else:
            raise GatewayError(400, f"{where} is a {kind!r} item; the gateway takes message, function_call and "
                                    "function_call_output items", param="input", code="unsupported_content")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise GatewayError(400, "previous_response_id must be a string", param="previous_response_id")
    tools, key = _function_tools(body.get("tools"), "tools", "responses")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise GatewayError(400, "text must be an object", param="text")
    if body.get("n") not in (None, 1):
        raise GatewayError(400, "n must be 1", param="n")
    return ModelCall(messages, tools, key, _cap(body, "max_output_tokens"), stream=_flag(body, "stream"),
                     model=_model(body), previous_response_id=previous, instructions=instructions,
                     logprobs=_includes(body, "message.output_text.logprobs"), tool_choice=body.get("tool_choice"),
                     parallel_tool_calls=body.get("parallel_tool_calls"),
                     response_format=(text or {}).get("format"), format_param="text.format")


def _includes(body: dict[str, Any], what: str) -> bool:
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list):
        raise GatewayError(400, "include must be a list of strings", param="include")
    return what in include


def read_messages(body: Any, backend: str) -> ModelCall:
    """A ``POST /v1/messages`` (Anthropic) request: ``system``, then the messages; a user message's
    ``tool_result`` blocks become tool messages, an assistant message's ``tool_use`` blocks its calls."""
    body = _obj(body)
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        messages.append(Message("system", _text("system", system)))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "messages: a non-empty list of messages is required")
    for i, item in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(item, dict) or item.get("role") not in ("user", "assistant"):
            raise GatewayError(400, f"{where}: a message is an object with role user or assistant and content")
        role, content = item["role"], item.get("content")
        if isinstance(content, str):
            messages.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise GatewayError(400, f"{where}.content must be a string or a list of content blocks")
        text: list[str] = []
        calls: list[tuple[str, dict[str, Any]]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                name = block.get("name")
                if not isinstance(name, str) or not isinstance(block.get("id"), str):
                    raise GatewayError(400, f"{at}: a tool_use block needs id, name and input")
                calls.append((name, _arguments(at, block.get("input"))))
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise GatewayError(400, f"{at}: a tool_result block needs tool_use_id")
                if text:  # text before a tool result stays a user message of its own
                    messages.append(Message("user", "".join(text)))
                    text = []
                messages.append(Message("tool", _text(at, block.get("content")),
                                        extra={"tool_call_id": block["tool_use_id"]}))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # the policy's reasoning is in its text
            else:
                raise GatewayError(400, f"{at} is a {kind!r} block in a {role} message; the gateway takes text, "
                                        "tool_use (assistant) and tool_result (user) blocks")
        if text or calls or not messages or messages[-1].role != "tool":
            messages.append(Message(role, "".join(text), calls))
    tools, key = _function_tools(body.get("tools"), "tools", "messages")
    cap = _cap(body, "max_tokens")
    if cap is None:
        raise GatewayError(400, "max_tokens: a positive integer is required")
    return ModelCall(messages, tools, key, cap, stream=_flag(body, "stream"), model=_model(body),
                     tool_choice=body.get("tool_choice"))


def read_completions(body: Any) -> TextCall:
    """A ``POST /v1/completions`` request (one prompt string)."""
    body = _obj(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise GatewayError(400, "prompt must be one non-empty string (each call is one turn of one trajectory)",
                           param="prompt")
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        raise GatewayError(400, "n and best_of must be 1: each call is one turn of one trajectory", param="n")
    if body.get("suffix") is not None:
        raise GatewayError(400, "suffix (fill-in-the-middle) is not supported", param="suffix",
                           code="unsupported_parameter")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise GatewayError(400, f"logprobs must be a non-negative integer, got {logprobs!r}", param="logprobs")
    return TextCall(prompt, _cap(body, "max_tokens"), logprobs=logprobs is not None, stream=_flag(body, "stream"),
                    include_usage=_include_usage(body), echo=_flag(body, "echo"), model=_model(body))


# -- writing replies ---------------------------------------------------------------------------------

Event = tuple[str | None, Any]
"""A server-sent event: its ``event:`` name (None: none) and its data (a JSON value, or ``[DONE]``)."""


def _chat_logprobs(reply: Reply, start: int = 0, end: int | None = None) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in zip(reply.tokens[start:end], reply.logprobs[start:end])]}


def _tool_call(call: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    call_id, name, arguments = call
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def chat_completion(reply: Reply, call: ModelCall) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"] = [_tool_call(c) for c in reply.calls]
    choice = {"index": 0, "message": message, "finish_reason": reply.finish,
              "logprobs": _chat_logprobs(reply) if call.logprobs else None}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": call.model, "choices": [choice], "usage": _usage(reply)}


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def chat_chunks(reply: Reply, call: ModelCall) -> Iterator[Event]:
    """The ``chat.completion.chunk`` events of a turn: the role, the content (a piece per token when
    it can be cut at tokens, with that token's log-prob), the tool calls, the finish reason, the
    usage (``stream_options.include_usage``), ``[DONE]``."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": call.model}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> Event:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return None, {**head, "choices": [choice], **({"usage": None} if call.include_usage else {})}

    yield chunk({"role": "assistant", "content": ""})
    if reply.pieces is not None:
        for i, piece in enumerate(reply.pieces):
            yield chunk({"content": piece}, logprobs=_chat_logprobs(reply, i, i + 1) if call.logprobs else None)
    else:
        if reply.content:
            yield chunk({"content": reply.content})
        if call.logprobs:
            for i in range(len(reply.tokens)):
                yield chunk({}, logprobs=_chat_logprobs(reply, i, i + 1))
    for i, (call_id, name, arguments) in enumerate(reply.calls):
        yield chunk({"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                     "function": {"name": name, "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": json.dumps(arguments)}}]})
    yield chunk({}, reply.finish)
    if call.include_usage:
        yield None, {**head, "choices": [], "usage": _usage(reply)}
    yield None, "[DONE]"


def response_object(reply: Reply, call: ModelCall, response_id: str, status: str = "completed") -> dict[str, Any]:
    """The Responses API's ``response`` of a turn: a message item, then a function_call item per call."""
    output: list[dict[str, Any]] = []
    if reply.content or not reply.calls:
        part: dict[str, Any] = {"type": "output_text", "text": reply.content or "", "annotations": []}
        if call.logprobs:
            part["logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                for t, lp in zip(reply.tokens, reply.logprobs)]
        output.append({"type": "message", "id": f"msg_{response_id[5:]}", "status": "completed",
                       "role": "assistant", "content": [part]})
    for call_id, name, arguments in reply.calls:
        output.append({"type": "function_call", "id": f"fc_{call_id[5:]}", "call_id": call_id, "name": name,
                       "arguments": json.dumps(arguments), "status": "completed"})
    incomplete = {"reason": "max_output_tokens"} if reply.finish == "length" else None
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": call.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": incomplete, "output": output if status == "completed" else [],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [
                {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                 "strict": False} for t in call.tools],
            "previous_response_id": call.previous_response_id, "error": None, "instructions": call.instructions,
            "metadata": {}, "temperature": None, "top_p": None, "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
                      "total_tokens": reply.prompt_tokens + reply.completion_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def response_events(reply: Reply, call: ModelCall, response_id: str) -> Iterator[Event]:
    """The Responses API's streamed events of a turn (created, each output item with its text or
    argument deltas, completed)."""
    done = response_object(reply, call, response_id)
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> Event:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    yield event("response.created", response=response_object(reply, call, response_id, "in_progress"))
    yield event("response.in_progress", response=response_object(reply, call, response_id, "in_progress"))
    for index, item in enumerate(done["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            yield event("response.content_part.added", output_index=index, item_id=item["id"], content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []})
            pieces = reply.pieces if reply.pieces is not None else [part["text"]]
            for i, piece in enumerate(pieces):
                extra = {}
                if call.logprobs and reply.pieces is not None:
                    extra["logprobs"] = [{"token": reply.tokens[i], "logprob": reply.logprobs[i], "top_logprobs": []}]
                yield event("response.output_text.delta", output_index=index, item_id=item["id"], content_index=0,
                            delta=piece, **extra)
            yield event("response.output_text.done", output_index=index, item_id=item["id"], content_index=0,
                        text=part["text"])
            yield event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", output_index=index, item_id=item["id"],
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", output_index=index, item_id=item["id"],
                        arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_message(reply: Reply, call: ModelCall) -> dict[str, Any]:
    """The Anthropic ``message`` of a turn: a text block, then a tool_use block per call."""
    content: list[dict[str, Any]] = []
    if reply.content or not reply.calls:
        content.append({"type": "text", "text": reply.content or ""})
    content += [{"type": "tool_use", "id": call_id, "name": name, "input": arguments}
                for call_id, name, arguments in reply.calls]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": call.model,
            "content": content, "stop_reason": _STOP_REASONS[reply.finish], "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}}


def anthropic_events(reply: Reply, call: ModelCall) -> Iterator[Event]:
    """The Anthropic streamed events of a turn: message_start, each block's start, deltas and stop,
    message_delta (the stop reason and output tokens), message_stop."""
    message = anthropic_message(reply, call)
    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {"type": "text", "text": ""}}
            for piece in (reply.pieces if reply.pieces is not None else [block["text"]]):
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": piece}}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {**block, "input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "input_json_delta",
                                                    "partial_json": json.dumps(block["input"])}}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                               "stop_sequence": None},
                            "usage": {"output_tokens": reply.completion_tokens}}
    yield "message_stop", {"type": "message_stop"}


def text_completion(reply: Reply, call: TextCall, echo: str) -> dict[str, Any]:
    """The legacy ``text_completion`` of a turn."""
    choice = {"index": 0, "text": echo + (reply.content or ""), "finish_reason": "length" if reply.finish == "length"
              else "stop", "logprobs": _text_logprobs(reply) if call.logprobs else None}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": call.model, "choices": [choice], "usage": _usage(reply)}


def _text_logprobs(reply: Reply, start: int = 0, end: int | None = None) -> dict[str, Any]:
    tokens, logprobs = reply.tokens[start:end], reply.logprobs[start:end]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def text_chunks(reply: Reply, call: TextCall, echo: str) -> Iterator[Event]:
    """The legacy completion's streamed chunks (a piece per token when it can be cut), ``[DONE]``."""
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": call.model}

    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> Event:
        return None, {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

    if echo:
        yield chunk(echo)
    if reply.pieces is not None:
        for i, piece in enumerate(reply.pieces):
            yield chunk(piece, logprobs=_text_logprobs(reply, i, i + 1) if call.logprobs else None)
    else:
        yield chunk(reply.content or "", logprobs=_text_logprobs(reply) if call.logprobs else None)
    yield chunk("", "length" if reply.finish == "length" else "stop")
    if call.include_usage:
        yield None, {**head, "choices": [], "usage": _usage(reply)}
    yield None, "[DONE]"


def sse(event: Event) -> bytes:
    """One server-sent event on the wire."""
    name, data = event
    text = data if isinstance(data, str) else json.dumps(data)
    return ((f"event: {name}\n" if name else "") + f"data: {text}\n\n").encode("utf-8")
