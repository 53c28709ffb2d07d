"""``mcp``: the tools of Model Context Protocol servers as an environment, through the MCP Python SDK
(``pip install 'relax[mcp]'``, ``mcp==2.3.0``).

The spec names the servers: a stdio ``command`` the environment starts (and stops), or the ``url`` of
a streamable-HTTP server, on loopback unless ``allow_remote``. Their tools, as the servers list them
(name, description, input schema), are the environment's tools: the chat template declares them, the
rollout checks every call against their schemas, and the calls of a turn go to their servers in
order. A tool's result becomes the observation: text as text, images and audio as media items (they
travel by reference like the data's media, and need their modality in the run), embedded resources
as their text. A result the server marks as an error is an ``error: ...`` line, as for any tool.

Sessions are per worker (one session per server, opened once, shared by the worker's trajectories)
or per trajectory (opened in ``start``, closed in ``close``), as ``session`` says. Every session runs
on one event loop thread the environment owns, since an MCP session is bound to the loop that opened
it; the rollout's calls into the environment (under ``tool_timeout_s``) wait on it. A server that
dies or hangs ends the trajectories that call it (``env_error``, ``env_timeout``), not the run.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import threading
from concurrent.futures import Future
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.contracts import AgentTask, Observation, ToolCall, ToolSpec, Turn


class MCPServerSpec(BaseModel):
    """One MCP server: a command to start over stdio, or a streamable-HTTP URL."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    """What errors and observations call the server."""
    command: list[str] | None = None
    """The server's command line (``[executable, arg, ...]``), run as a child process speaking MCP
    on its stdin and stdout."""
    url: str | None = None
    """A streamable-HTTP endpoint (``http://127.0.0.1:8000/mcp``)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for a command, over the SDK's default environment."""
    cwd: str | None = None
    """Working folder of a command."""
    allow_remote: bool = False
    """Let ``url`` name a host off this machine (off by default: tool traffic stays on loopback)."""

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of command (a stdio server to start) "
                             "and url (a streamable-HTTP server)")
        if self.command is not None and not self.command:
            raise ValueError(f"MCP server {self.name!r}: command is empty; give [executable, arg, ...]")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"MCP server {self.name!r}: url {self.url!r} is not an http(s) URL")
            if not self.allow_remote and not _loopback(parts.hostname):
                raise ValueError(f"MCP server {self.name!r}: {parts.hostname} is not on this machine; set "
                                 "allow_remote: true to reach it (tool traffic leaves the machine)")
        return self


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Loop:
    """An event loop on its own daemon thread: every MCP session lives on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-sessions", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise


class _Session:
    """One open client session to one server, held by a task on the environment's loop (the SDK's
    sessions must be closed by the task that opened them)."""

    def __init__(self, spec: MCPServerSpec) -> None:
        self.spec = spec
        self.client: Any = None
        self._closing: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def open(self, timeout: float) -> _Session:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters

        spec = self.spec
        target: Any = spec.url if spec.url is not None else StdioServerParameters(
            command=spec.command[0], args=list(spec.command[1:]), env=dict(spec.env) or None, cwd=spec.cwd)
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()

        async def hold() -> None:
            try:
                async with Client(target, cache=None) as client:
                    ready.set_result(client)
                    await self._closing.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

        self._task = asyncio.create_task(hold())
        try:
            self.client = await asyncio.wait_for(asyncio.shield(ready), timeout)
        except BaseException as exc:
            self._task.cancel()
            if isinstance(exc, asyncio.TimeoutError):
                raise RuntimeError(f"MCP server {spec.name!r} did not answer within connect_timeout_s={timeout:g} s") \
                    from None
            raise RuntimeError(f"MCP server {spec.name!r} could not be reached: {type(exc).__name__}: {exc}") from exc
        return self

    async def close(self, timeout: float) -> None:
        if self._task is None or self._task.done():
            return
        self._closing.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (TimeoutError, Exception):
            self._task.cancel()


class MCPEnvironment:
    """Tools of MCP servers; a turn without tool calls ends the trajectory."""

    class Config(BaseModel):
        """Options of the ``mcp`` environment."""

        model_config = ConfigDict(extra="forbid")

        servers: list[MCPServerSpec] = Field(min_length=1)
        """The MCP servers whose tools the model may call."""
        session: Literal["worker", "trajectory"] = "worker"
        """``worker``: one session per server for all of a rollout worker's trajectories (opened once);
        ``trajectory``: each trajectory opens its own (a stdio server process each) and closes it at its end."""
        tools: list[str] | None = None
        """The tools offered, by name; null: every tool the servers list."""
        max_calls_per_turn: int = Field(4, ge=1)
        """Calls served per turn; the ones past it get an error line."""
        connect_timeout_s: float = Field(60.0, gt=0.0)
        """Seconds to start a stdio server (or reach a URL) and list its tools."""

    def __init__(self, config: Config) -> None:
        self.config = config
        names = [s.name for s in config.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"MCP server names must differ; got {', '.join(names)}")
        self._loop: _Loop | None = None
        self._lock = threading.Lock()
        self._worker: dict[str, _Session] = {}
        self._tools: list[ToolSpec] | None = None
        self._owner: dict[str, str] = {}
        """Tool name -> the server that serves it."""

    # -- lifecycle ----------------------------------------------------------------------------------

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = _Loop()
        return self._loop.run(coro, timeout)

    async def _open_all(self) -> dict[str, _Session]:
        timeout = self.config.connect_timeout_s
        sessions = await asyncio.gather(*(_Session(spec).open(timeout) for spec in self.config.servers),
                                        return_exceptions=True)
        failed = next((s for s in sessions if isinstance(s, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(s.close(timeout) for s in sessions if isinstance(s, _Session)))
            raise failed
        return {s.spec.name: s for s in sessions}

    async def _close_all(self, sessions: dict[str, _Session]) -> None:
        await asyncio.gather(*(s.close(self.config.connect_timeout_s) for s in sessions.values()))

    def setup(self) -> None:
        """Per worker: open the worker sessions (``session: worker``) and list the tools."""
        self.tools()

    def teardown(self) -> None:
        """Per worker: close the worker sessions (stdio servers stop) and the event loop."""
        if self._loop is None:
            return
        sessions, self._worker = self._worker, {}
        if sessions:
            self._run(self._close_all(sessions), self.config.connect_timeout_s * 2)
        self._loop.loop.call_soon_threadsafe(self._loop.loop.stop)
        self._loop.thread.join(timeout=5)
        self._loop = None

    def tools(self) -> list[ToolSpec]:
        """The servers' tools (listed once; with ``session: trajectory`` through sessions opened for it)."""
        if self._tools is not None:
            return list(self._tools)
        if self.config.session == "worker":
            if not self._worker:
                self._worker = self._run(self._open_all())
            sessions = self._worker
            listed = self._run(self._list(sessions))
        else:
            async def list_once() -> list[tuple[str, Any]]:
                sessions = await self._open_all()
                try:
                    return await self._list(sessions)
                finally:
                    await self._close_all(sessions)

            listed = self._run(list_once())
        specs: list[ToolSpec] = []
        for server, tool in listed:
            if self.config.tools is not None and tool.name not in self.config.tools:
                continue
            if tool.name in self._owner:
                raise ValueError(f"MCP servers {self._owner[tool.name]!r} and {server!r} both list a tool named "
                                 f"{tool.name!r}; offer one of them (the tools option)")
            self._owner[tool.name] = server
            specs.append(ToolSpec(tool.name, tool.description or "", dict(tool.input_schema or {"type": "object"})))
        missing = sorted(set(self.config.tools or []) - set(self._owner))
        if missing:
            raise ValueError(f"the MCP servers list no tool named {', '.join(missing)}; they list: "
                             f"{', '.join(sorted(t.name for _, t in listed))}")
        self._tools = specs
        return list(specs)

    async def _list(self, sessions: dict[str, _Session]) -> list[tuple[str, Any]]:
        out = []
        for name, session in sessions.items():
            cursor = None
            while True:
                page = await asyncio.wait_for(session.client.list_tools(cursor=cursor), self.config.connect_timeout_s)
                out += [(name, tool) for tool in page.tools]
                cursor = page.next_cursor
                if not cursor:
                    break
        return out

    # -- a trajectory --------------------------------------------------------------------------------

    def start(self, task: AgentTask) -> dict[str, Any]:
        state: dict[str, Any] = {"task": task, "calls": 0, "sessions": None}
        if self.config.session == "trajectory":
            state["sessions"] = self._run(self._open_all())
        return state

    def close(self, state: dict[str, Any] | None) -> None:
        """A trajectory's own sessions are closed (their stdio servers stop); worker sessions stay."""
        sessions = (state or {}).get("sessions")
        if sessions:
            state["sessions"] = None
            self._run(self._close_all(sessions), self.config.connect_timeout_s * 2)

    def step(self, state: dict[str, Any], turn: Turn) -> Observation:
        if not turn.tool_calls:
            return Observation(done=True, info={"tool_calls": 0})
        sessions = state.get("sessions") or self._worker
        items: list[dict[str, Any]] = []
        errors = 0
        for i, call in enumerate(turn.tool_calls):
            if i:
                items.append({"type": "text", "text": "\n"})
            if i >= self.config.max_calls_per_turn:
                items.append({"type": "text", "text": f"error: at most {self.config.max_calls_per_turn} tool calls "
                                                      "per turn; this one was not run"})
                errors += 1
                continue
            result_items, failed = self._run(self._call(sessions, call))
            items += result_items
            errors += failed
        state["calls"] += len(turn.tool_calls)
        names = ",".join(dict.fromkeys(call.name for call in turn.tool_calls))
        content: str | list[dict[str, Any]] = items
        if all(item["type"] == "text" for item in items):
            content = "".join(item["text"] for item in items)
        return Observation(content=content, role="tool",
                           info={"tool": names, "tool_calls": len(turn.tool_calls), "tool_errors": errors})

    async def _call(self, sessions: dict[str, _Session], call: ToolCall) -> tuple[list[dict[str, Any]], int]:
        server = self._owner[call.name]
        session = sessions[server]
        try:
            result = await session.client.call_tool(call.name, call.arguments)
        except Exception as exc:  # the session broke (the server exited, the connection closed)
            raise RuntimeError(f"MCP server {server!r} failed during {call.name}: {type(exc).__name__}: {exc}") from exc
        items = [_item(block) for block in result.content]
        if result.is_error:
            text = " ".join(item.get("text", "") for item in items if item["type"] == "text")
            return [{"type": "text", "text": f"error: {text}".rstrip()}], 1
        if not items and result.structured_content is not None:
            import json

            items = [{"type": "text", "text": json.dumps(result.structured_content, ensure_ascii=False)}]
        return items, 0


def _item(block: Any) -> dict[str, Any]:
    """One content block of a tool result as an observation item."""
    kind = getattr(block, "type", "")
    if kind == "text":
        return {"type": "text", "text": block.text}
    if kind in ("image", "audio"):
        return {"type": kind, kind: base64.b64decode(block.data)}
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        return {"type": "text", "text": text if text is not None else f"[resource {resource.uri}]"}
    if kind == "resource_link":
        return {"type": "text", "text": f"[resource {block.uri}]"}
    return {"type": "text", "text": f"[{kind or type(block).__name__} content]"}
