"""The client side of the gateway tests: the tools, and tool loops written with the real ``openai``
and ``anthropic`` clients. Kept free of torch, so that a program worker process that imports them
(``process_programs``) starts in a couple of seconds."""

from __future__ import annotations

import anthropic
import openai

from relax.agents import gateway_http
from relax.contracts import AgentTask

CHAT_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "multiplies two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
RESPONSES_TOOL = {"type": "function", **CHAT_TOOL["function"]}
ANTHROPIC_TOOL = {"name": "multiply", "description": "multiplies two integers",
                  "input_schema": CHAT_TOOL["function"]["parameters"]}


def streamed_chat(client: openai.OpenAI, messages: list, stream: bool) -> dict:
    """One chat call, streamed or not, as the text, tool calls, log-probs and usage the program read."""
    if not stream:
        reply = client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL], logprobs=True)
        choice = reply.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason,
                "logprobs": [t.logprob for t in choice.logprobs.content], "usage": reply.usage.completion_tokens}
    content, calls, logprobs, finish, usage, roles = [], {}, [], None, None, []
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL], logprobs=True,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            roles += [delta.role] if delta.role else []
            content += [delta.content] if delta.content else []
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, ["", "", ""])
                slot[0] += call.id or ""
                slot[1] += (call.function.name or "") if call.function else ""
                slot[2] += (call.function.arguments or "") if call.function else ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [t.logprob for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    return {"content": "".join(content) or None, "calls": [tuple(calls[i]) for i in sorted(calls)],
            "finish": finish, "logprobs": logprobs, "usage": usage}


def tool_loop(client: openai.OpenAI, task: AgentTask) -> dict:
    """Two turns: the model's tool call, answered 42, then its reply (streamed for the label ``stream``)."""
    messages: list = [{"role": "user", "content": task.prompt}]
    first = streamed_chat(client, messages, task.label == "stream")
    messages.append({"role": "assistant", "content": first["content"], "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in first["calls"]]})
    messages += [{"role": "tool", "tool_call_id": i, "content": "42"} for i, _, _ in first["calls"]]
    return {"first": first, "second": streamed_chat(client, messages, task.label == "stream")}


async def async_tool_loop(task: AgentTask, base_url: str, api_key: str) -> dict:
    """Two turns with ``openai.AsyncOpenAI`` and the async in-process client: a tool call, answered 42."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=gateway_http.async_http_client(base_url))
    messages: list = [{"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    return {"answer": second.choices[0].message.content}


def anthropic_loop(task: AgentTask, base_url: str, api_key: str) -> dict:
    """Two turns with the ``anthropic`` client and the in-process client: a tool use, answered 42."""
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0,
                                 http_client=gateway_http.http_client(base_url))
    messages: list = [{"role": "user", "content": task.prompt}]
    first = client.messages.create(model="m", max_tokens=100, messages=messages, tools=[ANTHROPIC_TOOL])
    (use,) = [block for block in first.content if block.type == "tool_use"]
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
    second = client.messages.create(model="m", max_tokens=100, messages=messages, tools=[ANTHROPIC_TOOL])
    return {"answer": second.content[0].text}
