"""Agent programs in worker processes (``roles.rollout.agent.gateway.processes``): the same
trajectories, token for token, as programs in the driver's process; the same failures, and a dead
worker fails only its own trajectories and is started again; workers end with their driver.

Real worker processes, the real ``openai`` and ``anthropic`` clients, the real batcher; the model's
turns are the forced tiny omni ones of ``test_gateway_apis`` (scripted text, the policy's own
log-probs). The programs (``tests.agents.process_programs``) write what they saw to files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relax.agents.gateway import ProgramDriver, ProgramError
from relax.agents.runner import AgentLimits, run_trajectories
from relax.contracts import AgentTask
from relax.spec.models import AgentSpec, GatewaySpec
from tests.agents.test_gateway_apis import SCRIPT, forced

PROGRAMS = "tests.agents.process_programs"


def _driver(rollout, program: str, processes: int, tool_timeout_s: float = 60, max_turns: int = 3) -> ProgramDriver:
    limits = AgentLimits(max_turns=max_turns, max_tokens=400, max_new_tokens=100, tool_timeout_s=tool_timeout_s,
                         concurrency=8)
    agent = AgentSpec(gateway=GatewaySpec(program=program, processes=processes), max_turns=limits.max_turns,
                      max_tokens=limits.max_tokens)
    return ProgramDriver(agent, rollout, limits, version=lambda: 3, max_prompt_tokens=128)


def _run(rollout, driver: ProgramDriver, labels: list[str], out: Path, tag: str) -> list:
    tasks = [AgentTask(prompt="What is 6*7?", label=label, row={"out": str(out)}, index=j, sample=0,
                       trajectory_id=f"{tag}-{j}-{label}") for j, label in enumerate(labels)]
    return run_trajectories(tasks, driver, forced(rollout, SCRIPT), 0).trajectories


def _seen(out: Path, tag: str, j: int, label: str) -> dict:
    return json.loads((out / f"{tag}-{j}-{label}.json").read_text())


def test_programs_in_worker_processes_record_the_tokens_programs_in_this_process_record(omni_backends, tmp_path):
    rollout, _ = omni_backends
    labels = ["plain", "stream", "socket", "anthropic", "plain", "stream"]
    here = _driver(rollout, f"{PROGRAMS}:program", 0)
    workers = _driver(rollout, f"{PROGRAMS}:program", 2)
    try:
        by_here = _run(rollout, here, labels, tmp_path, "here")
        by_workers = _run(rollout, workers, labels, tmp_path, "workers")
        assert workers._server is not None
        accepted, driver_url = workers._server.accepted, workers.base_url
    finally:
        here.close()
        workers.close()
    assert accepted == 0  # the socket program talked HTTP to its worker's own server, which relayed it
    pids, urls = set(), set()
    for j, (label, a, b) in enumerate(zip(labels, by_here, by_workers)):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert len(b.turns) == 2 and b.final_text == SCRIPT[1]
        assert (b.ids, b.loss_mask, b.logprobs) == (a.ids, a.loss_mask, a.logprobs)
        assert a.agent_reward == b.agent_reward == 0.5  # the program's return crossed back
        seen_here, seen_there = _seen(tmp_path, "here", j, label), _seen(tmp_path, "workers", j, label)
        assert seen_here.pop("pid") == os.getpid()
        pids.add(seen_there.pop("pid"))
        seen_here.pop("base_url")
        urls.add(seen_there.pop("base_url"))
        if "first" in seen_here:  # what the client read: the same but for fresh call ids
            assert seen_there == {**seen_here, "first": {**seen_here["first"], "calls": seen_there["first"]["calls"]}}
        else:
            assert seen_there == seen_here == {"answer": SCRIPT[1]}
    assert len(pids) == 2 and os.getpid() not in pids  # spread over both workers
    assert len(urls) == 2 and driver_url not in urls  # each worker's own server
    for pid in pids:  # close() ended them
        assert not Path(f"/proc/{pid}").exists()


def test_an_async_program_in_a_worker_runs_on_its_event_loop(omni_backends, tmp_path):
    rollout, _ = omni_backends
    here = _driver(rollout, f"{PROGRAMS}:async_program", 0)
    workers = _driver(rollout, f"{PROGRAMS}:async_program", 1)
    try:
        (a, _), (b, _) = (_run(rollout, driver, ["a", "b"], tmp_path, tag)
                          for driver, tag in ((here, "here"), (workers, "workers")))
    finally:
        here.close()
        workers.close()
    assert b.error is None and (b.ids, b.logprobs) == (a.ids, a.logprobs)
    seen = _seen(tmp_path, "workers", 0, "a")
    assert seen["answer"] == SCRIPT[1] and seen["pid"] != os.getpid()


def test_a_program_failing_in_a_worker_fails_its_trajectory_as_it_would_in_this_process(omni_backends, tmp_path):
    rollout, _ = omni_backends
    labels = ["raise", "refused", "badkey", "text", "ok"]
    here = _driver(rollout, f"{PROGRAMS}:failing_program", 0, tool_timeout_s=1.5, max_turns=1)
    workers = _driver(rollout, f"{PROGRAMS}:failing_program", 1, tool_timeout_s=1.5, max_turns=1)
    try:
        by_here = _run(rollout, here, labels, tmp_path, "here")
        by_workers = _run(rollout, workers, labels, tmp_path, "workers")
        assert [(t.error, t.cause) for t in by_workers] == [(t.error, t.cause) for t in by_here]
        raised, refused, badkey, text, ok = by_workers
        assert raised.cause == "LookupError" and "raised LookupError: no tool for task 0" in raised.error
        assert refused.cause == "BadRequestError:context_length_exceeded"
        assert badkey.cause == "AuthenticationError:invalid_api_key"  # the driver checked the relayed key
        assert text.cause == "program_bad_return" and "returned a str" in text.error
        assert ok.error is None and ok.agent_reward == 1.0

        assert workers._processes is not None
        (first,) = workers._processes._workers
        assert first is not None
        (died,) = _run(rollout, workers, ["exit"], tmp_path, "exit")  # os._exit(3) in the worker
        assert died.cause == "program_process_exited" and "exited with code 3" in died.error
        assert first.process.returncode == 3
        (again,) = _run(rollout, workers, ["ok"], tmp_path, "again")  # a new worker serves the next one
        assert again.error is None and again.agent_reward == 1.0
        (second,) = workers._processes._workers
        assert second is not None and second is not first and second.process.poll() is None

        unsendable = AgentTask(prompt="What is 6*7?", label="ok", row={"out": str(tmp_path), "lock": threading.Lock()},
                               index=0, sample=0, trajectory_id="unsendable")
        (kept,) = run_trajectories([unsendable], workers, forced(rollout, SCRIPT), 0).trajectories
        assert kept.cause == "program_task_unsendable" and "cannot be sent" in kept.error

        started = time.monotonic()
        (slow,) = _run(rollout, workers, ["sleep"], tmp_path, "slow")  # past 1.5 s x (1 + 1)
        assert slow.cause == "program_timeout" and time.monotonic() - started < 20
    finally:
        here.close()
        workers.close()


def test_an_async_program_past_its_limit_is_cancelled_in_its_worker(omni_backends, tmp_path):
    rollout, _ = omni_backends
    driver = _driver(rollout, f"{PROGRAMS}:async_sleeping_program", 1, tool_timeout_s=1.0, max_turns=1)
    try:
        slow, quick = _run(rollout, driver, ["sleep", "quick"], tmp_path, "async")
        assert slow.cause == "program_timeout" and quick.error is None
        deadline = time.monotonic() + 10
        while not (tmp_path / "async-0-sleep.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads((tmp_path / "async-0-sleep.json").read_text())["cancelled"] is True
    finally:
        driver.close()


def test_a_program_its_workers_cannot_import_stops_the_start_with_why(omni_backends, monkeypatch):
    rollout, _ = omni_backends
    monkeypatch.setenv("RELAX_TEST_DRIVER_PID", str(os.getpid()))
    driver = _driver(rollout, "tests.agents.broken_in_workers:program", 1)  # imports here
    try:
        with pytest.raises(ProgramError, match="module 'tests.agents.broken_in_workers' cannot be imported"):
            driver.start()
    finally:
        driver.close()


def test_workers_end_when_their_driver_is_killed(tmp_path):
    """A rollout worker killed outright (SIGKILL) leaves no program process behind: each reads the
    end of its channel and exits."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"
        "from relax.agents.program_processes import ProgramProcesses\n"
        f"processes = ProgramProcesses({PROGRAMS + ':program'!r}, 2, routes=lambda: None)\n"
        "processes.start()\n"
        "print(*(w.process.pid for w in processes._workers), flush=True)\n"
        "time.sleep(600)\n")
    root = str(Path(__file__).resolve().parents[2])
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
    try:
        assert driver.stdout is not None
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan is reaped by init, or by this process when it is init)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_negative_process_count_is_refused():
    with pytest.raises(ValueError, match="processes"):
        GatewaySpec(program="m:f", processes=-1)
