"""Agent programs for ``test_program_processes``: they run in the gateway's worker processes, so
what they saw is written to a file (the task's ``row["out"]`` folder, one JSON file per
trajectory, with the process id and the base URL the program was given), not kept in a module
dict the test could read. Like ``client_loops``, free of torch: a worker starts in seconds."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import openai

from relax.agents import gateway_http
from tests.agents.client_loops import anthropic_loop, async_tool_loop, tool_loop


def _write(task, base_url: str, seen: dict) -> None:
    Path(task.row["out"], f"{task.trajectory_id}.json").write_text(
        json.dumps({**seen, "pid": os.getpid(), "base_url": base_url}))


def program(task, base_url: str, api_key: str) -> float:
    """The client the label names: ``plain`` or ``stream`` (the ``openai`` client with the gateway's
    in-process client: in a worker, its channel), ``socket`` (a client of its own, over loopback
    HTTP), ``anthropic`` (the ``anthropic`` client, in process)."""
    if task.label == "anthropic":
        _write(task, base_url, anthropic_loop(task, base_url, api_key))
        return 0.5
    http = None if task.label == "socket" else gateway_http.http_client(base_url)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60, http_client=http)
    _write(task, base_url, tool_loop(client, task))
    return 0.5


async def async_program(task, base_url: str, api_key: str) -> None:
    _write(task, base_url, await async_tool_loop(task, base_url, api_key))


def failing_program(task, base_url: str, api_key: str) -> object:
    """Fails as its label says, after one call: ``raise``, ``refused`` (the call is refused: the
    client's error with its code), ``badkey`` (a call under a wrong key), ``text`` (returns a
    string), ``exit`` (the process dies), ``sleep`` (past its time limit); ``ok`` returns 1.0."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                           http_client=gateway_http.http_client(base_url))
    prompt = task.prompt * 200 if task.label == "refused" else task.prompt  # past max_prompt_tokens: a 400
    if task.label == "badkey":  # its own client, over HTTP, under a key no trajectory has: a 401
        own = openai.OpenAI(base_url=base_url, api_key="relax-not-a-key", max_retries=0, timeout=30)
        own.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
    if task.label == "raise":
        raise LookupError(f"no tool for task {task.index}")
    if task.label == "text":
        return "done"
    if task.label == "exit":
        os._exit(3)
    if task.label == "sleep":
        time.sleep(60)
    return 1.0


async def async_sleeping_program(task, base_url: str, api_key: str) -> None:
    """Sleeps past its time limit after one call (then is cancelled), or returns at once."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=gateway_http.async_http_client(base_url))
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task.prompt}])
    if task.label == "sleep":
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            _write(task, base_url, {"cancelled": True})
            raise
