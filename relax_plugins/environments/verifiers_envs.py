"""``verifiers``: an environment of the ``verifiers`` library's legacy stack (``MultiTurnEnv``,
``ToolEnv``, ``SingleTurnEnv`` scored by their ``Rubric``) as a Relax environment.

The library runs its own rollout loop: ``Environment.run_rollout(input, client, model, ...)`` asks a
client for each model turn, calls ``env_response`` (a ``ToolEnv`` runs the called tools), checks its
stop conditions, and at the end scores the rollout with the environment's rubric. This adapter runs
that very loop, one per trajectory, on an event loop of its own, with a client whose "model" is
Relax's rollout: ``start`` begins the library's rollout and returns when it first asks for a model
turn; ``step`` answers that request with the turn (its text as the assistant message's content, the
tool calls Relax parsed as the message's ``tool_calls``) and returns when the library asks for the
next turn (the messages ``env_response`` added become the observation) or when the rollout ends
(``done``, the rubric's reward as the turn reward, its metrics in ``info``). So the stop conditions,
the tools and the scoring are the library's own, and the trainer sees the model's own tokens.

``env`` names an installed verifiers environment package (loaded with ``load_environment(env,
**env_args)``, as ``vf-eval`` does), or ``package.module:function`` for an environment built in
code (the function is called with ``env_args`` and returns the environment). The trajectory's label
is the rollout's ``answer``; the data row its ``info``.

A rollout that ends with the library's own ``error`` (a tool listed in ``stop_errors`` failed, the
environment's setup raised) fails the trajectory (``env_error``). Rubrics with group-level reward
functions need the whole group at once and are refused. verifiers 0.3.1 (the newest release with
this stack) pins ``mcp<2`` against the project's ``mcp==2.3.0``: it is installed in the ``envs``
test lane (``nox -s envs``), see docs/agents.md.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import AgentTask, Observation, ToolSpec, Turn

MODEL = "relax-policy"
"""The model name the library's rollout records (the policy behind Relax's rollout)."""


def _load(env: str, env_args: dict[str, Any]) -> Any:
    """The verifiers environment ``env`` names: ``module:function`` built in code, or an installed
    environment package."""
    import verifiers as vf

    if ":" in env:
        module_name, _, attr = env.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"verifiers environment {env!r}: cannot import {attr!r} from {module_name!r} ({e}); "
                             "give package.module:function returning a verifiers Environment") from e
        loaded = factory(**env_args)
    else:
        loaded = vf.load_environment(env, **env_args)
    if not isinstance(loaded, vf.Environment):
        raise ValueError(f"verifiers environment {env!r} gave {type(loaded).__name__}, not a verifiers Environment "
                         "(MultiTurnEnv, ToolEnv, SingleTurnEnv, ...)")
    return loaded


class _Rollout:
    """One trajectory's rollout in the library's loop, handed its model turns one at a time.

    The library's coroutine runs on the adapter's event loop; each model request is put on
    ``events`` with a future the caller answers; the end (or a failure) is put there too."""

    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.pending: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: Future | None = None
        self.seen = 0
        """How many of the library's prompt messages the model has seen (the next observation is the rest)."""

    def next_event(self) -> tuple[str, Any]:
        return self.events.get()


def _client_class() -> type:
    """A verifiers ``Client`` whose responses are Relax's model turns (built on first use: verifiers is
    imported only when the adapter is)."""
    from verifiers.legacy.clients.client import Client

    class RelaxTurns(Client):
        """The client of one trajectory's rollout: each request waits for the model's turn."""

        def __init__(self, rollout: _Rollout) -> None:
            super().__init__(None)
            self.rollout = rollout

        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:
            answer = asyncio.get_running_loop().create_future()
            self.rollout.pending = answer
            self.rollout.events.put(("turn", list(prompt)))
            return await answer

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return RelaxTurns


def _response(turn: Turn) -> Any:
    """The library's ``Response`` for a Relax model turn."""
    from verifiers.legacy.types import Response, ResponseMessage, ToolCall

    calls = [ToolCall(id=call.id or f"call_{turn.index}_{i}", name=call.name,
                      arguments=json.dumps(call.arguments, ensure_ascii=False))
             for i, call in enumerate(turn.tool_calls)]
    reason = "tool_calls" if calls else ("stop" if turn.finished else "length")
    message = ResponseMessage(content=turn.text, tool_calls=calls or None, finish_reason=reason,
                              is_truncated=not turn.finished)
    return Response(id=f"turn-{turn.index}", created=int(time.time()), model=MODEL, message=message)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "\n".join(str(getattr(p, "text", None) or (p.get("text") if isinstance(p, dict) else "") or "")
                         for p in content)
    return "" if content is None else str(content)


class VerifiersEnvironment:
    """A verifiers legacy environment: the library's rollout loop per trajectory, Relax as its model."""

    class Config(BaseModel):
        """Options of the verifiers adapter."""

        model_config = ConfigDict(extra="forbid")

        env: str = Field(min_length=1)
        """An installed verifiers environment (its package name, loaded with ``load_environment``), or
        ``package.module:function`` returning an environment built in code."""
        env_args: dict[str, Any] = Field(default_factory=dict)
        """Keyword arguments of ``load_environment`` (or of the function)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.env = _load(config.env, config.env_args)
        rubric = self.env.rubric
        if any(rubric._is_group_func(f) for f in rubric.funcs):
            raise ValueError(f"verifiers environment {config.env!r} has group-level reward functions; Relax scores "
                             "each trajectory on its own: use per-rollout reward functions")
        self._client = _client_class()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="verifiers-rollouts", daemon=True)
                self._thread.start()
            return self._loop

    def tools(self) -> list[ToolSpec]:
        specs = []
        for tool in self.env.tool_defs or []:
            get = tool.get if isinstance(tool, dict) else lambda k, t=tool: getattr(t, k, None)
            specs.append(ToolSpec(name=str(get("name")), description=str(get("description") or ""),
                                  parameters=dict(get("parameters") or {"type": "object", "properties": {}})))
        return specs

    def start(self, task: AgentTask) -> dict[str, Any]:
        rollout = _Rollout()
        rollout.loop = self._running_loop()
        rollout_input = {"prompt": [{"role": "user", "content": task.prompt}], "example_id": task.index,
                         "answer": "" if task.label is None else str(task.label), "info": dict(task.row)}
        client = self._client(rollout)

        async def run() -> None:
            try:
                output = await self.env.run_rollout(rollout_input, client, MODEL, {})
            except BaseException as e:  # noqa: BLE001 - handed to the trajectory's thread
                rollout.events.put(("failed", e))
                raise
            rollout.events.put(("done", output))

        rollout.task = asyncio.run_coroutine_threadsafe(run(), rollout.loop)
        state = {"rollout": rollout}
        kind, value = rollout.next_event()
        if kind != "turn":
            self._raise_end(kind, value, "before the first model turn")
        rollout.seen = len(value)
        return state

    def step(self, state: dict[str, Any], turn: Turn) -> Observation:
        rollout: _Rollout = state["rollout"]
        answer, rollout.pending = rollout.pending, None
        if answer is None or rollout.loop is None:
            raise RuntimeError("the verifiers rollout is not waiting for a model turn")
        rollout.loop.call_soon_threadsafe(answer.set_result, _response(turn))
        kind, value = rollout.next_event()
        if kind == "turn":
            added = value[rollout.seen + 1:]  # after the assistant message just answered
            rollout.seen = len(value)
            roles = {getattr(m, "role", "user") for m in added}
            return Observation(content="\n".join(_text(getattr(m, "content", "")) for m in added),
                               role="tool" if roles == {"tool"} else "user")
        if kind != "done":
            self._raise_end(kind, value, f"after model turn {turn.index}")
        if value.get("error") is not None:
            raise RuntimeError(f"verifiers environment {self.config.env!r} ended its rollout with an error: "
                               f"{value['error']}")
        metrics = {k: float(v) for k, v in (value.get("metrics") or {}).items() if isinstance(v, int | float)}
        return Observation(done=True, reward=float(value.get("reward") or 0.0), role="user",
                           info={"verifiers": {"stop_condition": value.get("stop_condition"), "metrics": metrics}})

    def _raise_end(self, kind: str, value: Any, when: str) -> None:
        if kind == "failed":
            raise RuntimeError(f"verifiers environment {self.config.env!r} failed {when}: "
                               f"{type(value).__name__}: {value}") from value
        error = value.get("error") if isinstance(value, dict) else None
        why = f"its error: {error}" if error is not None else "its stop conditions fired at once"
        raise RuntimeError(f"verifiers environment {self.config.env!r} ended its rollout {when} without asking the "
                           f"model: {why}")

    def close(self, state: dict[str, Any] | None) -> None:
        rollout: _Rollout | None = (state or {}).pop("rollout", None)
        if rollout is not None and rollout.task is not None and not rollout.task.done():
            rollout.task.cancel()  # a trajectory ended by Relax (its turns or tokens spent, a failure)
            rollout.events.put(("failed", asyncio.CancelledError()))

    def teardown(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
