"""The gateway's transport: agent programs that hand the official clients the in-process
``http_client`` reach the gateway without a socket and get the tokens a socket gets; one
kept-alive connection serves call after call.

The forced tiny omni rollout of ``test_gateway_apis`` (scripted turns, the policy's own log-probs),
the real ``openai`` and ``anthropic`` clients, the real batcher."""

from __future__ import annotations

import json
import socket

import openai

from relax.agents import gateway_http
from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.contracts import AgentTask
from relax.spec.models import AgentSpec, GatewaySpec
from tests.agents.client_loops import anthropic_loop, async_tool_loop, tool_loop
from tests.agents.test_gateway_apis import SCRIPT, forced

#: What each program received, by trajectory id.
SEEN: dict[str, dict] = {}
#: One shared in-process client per gateway (by base URL), as a run would keep it.
CLIENTS: dict[str, openai.OpenAI] = {}


def socket_program(task: AgentTask, base_url: str, api_key: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    SEEN[task.trajectory_id] = tool_loop(client, task)


def in_process_program(task: AgentTask, base_url: str, api_key: str) -> None:
    """The shared-client pattern without a socket: one client per gateway, a key per trajectory."""
    shared = CLIENTS.get(base_url) or CLIENTS.setdefault(base_url, openai.OpenAI(
        base_url=base_url, api_key="-", max_retries=0, http_client=gateway_http.http_client(base_url)))
    SEEN[task.trajectory_id] = tool_loop(shared.with_options(api_key=api_key), task)


async def async_in_process_program(task: AgentTask, base_url: str, api_key: str) -> None:
    SEEN[task.trajectory_id] = await async_tool_loop(task, base_url, api_key)


def anthropic_in_process_program(task: AgentTask, base_url: str, api_key: str) -> None:
    SEEN[task.trajectory_id] = anthropic_loop(task, base_url, api_key)


def _run(rollout, program: str, labels: list[str]):
    """The trajectories of ``program`` and the connections its gateway accepted meanwhile."""
    limits = AgentLimits(max_turns=3, max_tokens=400, max_new_tokens=100, tool_timeout_s=60, concurrency=8)
    agent = AgentSpec(gateway=GatewaySpec(program=f"tests.agents.test_gateway_transport:{program}"),
                      max_turns=limits.max_turns, max_tokens=limits.max_tokens)
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 3, max_prompt_tokens=128)
    tasks = [AgentTask(prompt="What is 6*7?", label=label, row={}, index=0, sample=j,
                       trajectory_id=f"{program}:{label}") for j, label in enumerate(labels)]
    try:
        batch = run_trajectories(tasks, driver, forced(rollout, SCRIPT), 0)
        assert driver._server is not None
        accepted = driver._server.accepted
    finally:
        driver.close()
    for t in batch.trajectories:
        assert t.error is None, t.error
        assert len(t.turns) == 2 and t.final_text == SCRIPT[1]
    return batch.trajectories, accepted


def test_in_process_clients_skip_the_socket_and_get_the_tokens_a_socket_gets(omni_backends):
    rollout, _ = omni_backends
    by_socket, accepted = _run(rollout, "socket_program", ["plain", "stream"])
    assert accepted >= 1  # a client's connections (kept alive between its calls)
    in_process, accepted = _run(rollout, "in_process_program", ["plain", "stream"])
    assert accepted == 0
    for label, a, b in zip(("plain", "stream"), by_socket, in_process):
        assert (b.ids, b.loss_mask) == (a.ids, a.loss_mask)
        assert b.logprobs == a.logprobs
        seen, want = SEEN[f"in_process_program:{label}"], SEEN[f"socket_program:{label}"]
        assert seen == {**want, "first": {**want["first"], "calls": seen["first"]["calls"]}}  # fresh call ids
        assert [(n, json.loads(args)) for _, n, args in seen["first"]["calls"]] == [("multiply", {"a": 6, "b": 7})]
    (async_traj, *_), accepted = _run(rollout, "async_in_process_program", ["a", "b"])
    assert accepted == 0 and SEEN["async_in_process_program:a"]["answer"] == SCRIPT[1]
    assert async_traj.ids == by_socket[0].ids
    (messages_traj,), accepted = _run(rollout, "anthropic_in_process_program", ["m"])
    assert accepted == 0 and SEEN["anthropic_in_process_program:m"]["answer"] == SCRIPT[1]
    assert messages_traj.ids == by_socket[0].ids  # this template renders tool_result as a tool turn


def test_an_in_process_client_for_a_url_no_gateway_serves_says_so():
    try:
        gateway_http.http_client("http://127.0.0.1:9/v1")
    except ValueError as exc:
        assert "no Relax agent gateway serves" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_one_kept_alive_connection_serves_call_after_call(omni_backends):
    rollout, _ = omni_backends
    limits = AgentLimits(max_turns=2, max_tokens=64, max_new_tokens=8, tool_timeout_s=30, concurrency=2)
    agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_transport:socket_program"))
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 0)
    driver.start()
    try:
        assert driver._server is not None
        host, port = driver._server.server_address[:2]
        with socket.create_connection((host, port), timeout=5) as sock:
            for _ in range(3):  # no key: 401, and the connection stays open (the GET has no body to skip)
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                head = b""
                while b"\r\n\r\n" not in head:
                    head += sock.recv(4096)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = head.partition(b"\r\n\r\n")[2]
                while len(body) < length:
                    body += sock.recv(4096)
                assert head.startswith(b"HTTP/1.1 401") and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert driver._server.accepted == 1
    finally:
        driver.close()
