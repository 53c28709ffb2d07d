"""The ``mcp`` environment against a real MCP server: one built with the SDK's server API
(``MCPServer``, FastMCP's successor in mcp 2) in this test and run over stdio as a child process.
Its tools become the environment's tools; calls return text, images and error results as
observations; a server that hangs or dies ends only the trajectories that use it, with
``env_timeout`` / ``env_error``; sessions per worker or per trajectory are closed at the end."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
from relax.contracts import AgentTask, ToolCall, Turn
from relax.registry import get_registry

SERVER = textwrap.dedent('''
    import base64, os, sys, time
    from mcp.server import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import ImageContent

    server = MCPServer("relax-test")
    PNG = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")

    @server.tool()
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        if not set(expr) <= set("0123456789+-*/() "):
            raise ToolError(f"not arithmetic: {expr}")
        return str(eval(expr))

    @server.tool()
    def greet(name: str) -> str:
        """Greet someone."""
        return f"grüß dich, {name} ✓"

    @server.tool()
    def pixel() -> ImageContent:
        """One red pixel."""
        return ImageContent(type="image", data=base64.b64encode(PNG).decode(), mime_type="image/png")

    @server.tool()
    def pid() -> str:
        """This server's process id."""
        return str(os.getpid())

    @server.tool()
    def hang(seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "woke"

    @server.tool()
    def die() -> str:
        """Exit the server."""
        os._exit(3)

    server.run(transport="stdio")
''')


@pytest.fixture(scope="module")
def server_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(SERVER)
    return path


def environment(server_file: Path, **options):
    registry = get_registry()
    config = registry.build_config("environments", "mcp", {
        "servers": [{"name": "calc-server", "command": [sys.executable, str(server_file)]}], **options})
    return registry.load("environments", "mcp")(config)


def task(j: int = 0) -> AgentTask:
    return AgentTask(prompt=f"task {j}", label=None, row={}, index=0, sample=j, trajectory_id=f"0:0:{j}")


def test_the_servers_tools_are_the_environments_and_calls_become_observations(server_file):
    env = environment(server_file, tools=["calc", "greet", "pixel"])
    try:
        tools = {t.name: t for t in env.tools()}
        assert set(tools) == {"calc", "greet", "pixel"}
        assert tools["calc"].description == "Evaluate an arithmetic expression."
        assert tools["calc"].parameters["properties"]["expr"]["type"] == "string"
        assert tools["calc"].parameters["required"] == ["expr"]
        env.setup()
        state = env.start(task())
        turn = Turn(index=0, text="", finished=True,
                    tool_calls=[ToolCall("calc", {"expr": "347*58"}), ToolCall("greet", {"name": "Zoë"}),
                                ToolCall("calc", {"expr": "__import__('os')"})])
        observation = env.step(state, turn)
        lines = observation.content.split("\n")
        assert lines[0] == "20126" and lines[1] == "grüß dich, Zoë ✓"
        assert lines[2].startswith("error: ") and "not arithmetic" in lines[2]
        assert observation.info == {"tool": "calc,greet", "tool_calls": 3, "tool_errors": 1}
        image = env.step(state, Turn(index=1, text="", finished=True, tool_calls=[ToolCall("pixel", {})]))
        (item,) = image.content
        assert item["type"] == "image" and item["image"].startswith(b"\x89PNG")
        assert env.step(state, Turn(index=2, text="20126", tool_calls=[], finished=True)).done
        env.close(state)
    finally:
        env.teardown()


def test_bad_options_are_named(server_file):
    with pytest.raises(Exception, match="exactly one of command"):
        environment(server_file, servers=[{"name": "x"}])
    with pytest.raises(Exception, match="example.com is not on this machine; set allow_remote"):
        environment(server_file, servers=[{"name": "x", "url": "http://example.com/mcp"}])
    env = environment(server_file, tools=["calc", "nope"])
    try:
        with pytest.raises(ValueError, match="list no tool named nope"):
            env.tools()
    finally:
        env.teardown()


def driver_for(env, tokenizer, **limits):
    settings = dict(max_turns=3, max_tokens=600, max_new_tokens=80, tool_timeout_s=20.0, concurrency=8)
    settings.update(limits)
    chat = ChatTokens(tokenizer, env.tools(), None, 256)
    return EnvironmentDriver(env, "mcp", chat, AgentLimits(**settings), version=lambda: 1)


@pytest.fixture(scope="module")
def tokenizer(omni_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_path)


def call(tool: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": tool, "arguments": arguments})}</tool_call>'


def test_a_hanging_server_call_ends_only_its_trajectory(server_file, tokenizer):
    from tests.agents.test_runner import Script

    env = environment(server_file)  # one session per worker: all trajectories share the server
    driver = driver_for(env, tokenizer, tool_timeout_s=3.0)
    script = Script(tokenizer, {0: [call("calc", expr="2+3"), "5"], 1: [call("hang", seconds=30), "late"],
                                2: [call("greet", name="Ada"), "done"]})
    started = time.monotonic()
    batch = run_trajectories([task(j) for j in range(3)], driver, script, seed=0)
    assert time.monotonic() - started < 20
    assert [t.outcome for t in batch.trajectories] == ["ok", "env_timeout", "ok"]
    assert batch.trajectories[0].observations[0] == "5"
    assert batch.trajectories[2].observations[0] == "grüß dich, Ada ✓"
    driver.close()


def test_a_dying_server_ends_only_the_trajectories_using_it_and_sessions_close(server_file, tokenizer):
    import os

    from tests.agents.test_runner import Script

    env = environment(server_file, session="trajectory")  # a server process per trajectory
    driver = driver_for(env, tokenizer)
    script = Script(tokenizer, {0: [call("die"), "?"], 1: [call("pid"), call("calc", expr="1+1"), "2"]})
    batch = run_trajectories([task(j) for j in range(2)], driver, script, seed=0)
    died, lived = batch.trajectories
    assert died.outcome == "env_error" and "MCP server 'calc-server' failed during die" in died.error
    assert lived.outcome == "ok" and lived.observations[1] == "2"
    server_pid = int(lived.observations[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # close(state) ended the trajectory's server process
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the MCP server of a finished trajectory (pid {server_pid}) is still running")
    driver.close()


@pytest.mark.envs  # about 25 s here: in the envs lane
def test_a_streamable_http_server_on_loopback(server_file, tmp_path):
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    http_server = tmp_path / "http_server.py"
    http_server.write_text(server_file.read_text().replace(
        'server.run(transport="stdio")', f'server.run(transport="streamable-http", host="127.0.0.1", port={port})'))
    process = subprocess.Popen([sys.executable, str(http_server)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until it listens
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        env = get_registry().load("environments", "mcp")(get_registry().build_config("environments", "mcp", {
            "servers": [{"name": "http", "url": f"http://127.0.0.1:{port}/mcp"}], "tools": ["calc"]}))
        try:
            assert [t.name for t in env.tools()] == ["calc"]
            state = env.start(task())
            observation = env.step(state, Turn(index=0, text="", finished=True,
                                               tool_calls=[ToolCall("calc", {"expr": "6*7"})]))
            assert observation.content == "42"
            env.close(state)
        finally:
            env.teardown()
    finally:
        process.terminate()
        process.wait(timeout=10)
