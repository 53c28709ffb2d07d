"""An agent program that rewrites its memory, for the live run of segments
(``tests/runtime/test_agent_segments_run.py``): two calls that extend the conversation, then a third
whose history is replaced by a summary, so each trajectory is two segments."""

from __future__ import annotations

import functools

import openai


@functools.cache
def shared_client(base_url: str) -> openai.OpenAI:
    """One client for the run (docs/agents.md)."""
    return openai.OpenAI(base_url=base_url, api_key="per-trajectory", max_retries=0)


def summarizes_at_turn_3(task, base_url: str, api_key: str) -> None:
    """Ask, ask to check, then ask again from a summary of the conversation (a new segment); the
    reward plugins score the last answer."""
    client = shared_client(base_url).with_options(api_key=api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "Check it."}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    summary = [{"role": "system", "content": "Asked once, checked once."}, {"role": "user", "content": task.prompt}]
    client.chat.completions.create(model="policy", messages=summary, max_tokens=8)
    return None
