"""The agent gateway against the built-in environment: the same task, three ways, side by side.

    python bench/gateway.py [--trajectories 128] [--repeats 3] [--arms async_in_process/2,...] [--timeline]
                            [--set model.options.hidden_size=256 ...]
    python bench/gateway.py --steps 8 --trajectories 1024 --arms async_in_process/2,sync_in_process/2

Why: an agent program behind the gateway must not cost the run much over an environment plugin,
or users keep their agents out of training (issue 42 measured 3.2x to 10x per step, with
clients built per trajectory). On the tiny agent preset's model and task (``builtin:tiny-lm``
trained for the calculator; ``347*58=``-style products) and the real ``hf`` rollout, one rollout
unit of ``--trajectories`` trajectories is run by:

- **environment**: the built-in ``calculator`` environment (``EnvironmentDriver``);
- **sync**: a plain ``def`` program with one ``openai.OpenAI`` client for the whole run
  (``with_options(api_key=...)`` per trajectory: the pattern docs/agents.md gives);
- **async**: an ``async def`` program with one ``openai.AsyncOpenAI`` client for the run (async
  programs all run on the gateway's one event loop, so they can share it);
- **sync_in_process** and **async_in_process**: the same two programs with the gateway's in-process
  ``http_client`` / ``async_http_client`` (``relax.agents.gateway_http``): no socket;
- **async_raw**: the async program posting its JSON with the in-process ``httpx2`` client, without
  the ``openai`` client: what the gateway itself costs.

An arm named ``<arm>/N`` runs its programs in N worker processes
(``roles.rollout.agent.gateway.processes``, ``relax.agents.program_processes``); without it they
run in this process, beside the gateway and the model. In a worker the in-process clients reach the
gateway over the worker's channel; ``sync/N`` and ``async/N`` over loopback HTTP.

Before the arms, the ``openai`` client alone is timed: a chat call with the same messages and tools
against a transport that answers at once, no gateway behind it (CPU per call). It bounds what a
client program can reach: the arms pay it on every call, the environment never does.

``--set`` applies spec overrides to the preset, e.g. a larger model (``model.options.hidden_size``,
``num_layers``, ``intermediate_size``): the gateway's cost a call is the same whatever the model, so
the ratios show how much of a unit it is once the model's own time grows. ``--device cuda``
generates on an NVIDIA GPU (the programs and the gateway stay on the CPU, as in a run): issue 42's
ratio where the model's time is a GPU's, e.g. ``python bench/gateway.py --device cuda
--trajectories 1024 --set model.options.hidden_size=256 model.options.num_layers=4
model.options.intermediate_size=1024 model.options.head_dim=64``.

``--steps N`` measures s/step instead: the preset's own ``relax run`` (separate mode, on a local
Ray, training included) for N steps per arm and repeat, ``--trajectories`` a step, all concurrent
(``roles.rollout.agent.concurrency``); it prints each arm's median ``time/step_s`` after the first
``--skip`` steps and its ratio to the environment's.

Arms alternate within each repeat (drift on a shared machine hits all alike), and each repeat
starts one arm later than the one before: no arm always goes first (when the environment arm did,
it once took 18% longer than the next arm to generate the same first 1,024-row batch). Printed per
arm: the median wall seconds per unit and its range, this process's CPU seconds (and the worker
processes', apart), turns per trajectory, model batches, and the most file descriptors and threads this
process and the arm's worker processes held together during the unit (sampled every 10 ms), then
the ratios gateway arm / environment (issue 42 asks for at most 1.5x). ``--timeline`` prints each
model batch of the last repeat: when it started, its rows and its seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]


def _calculate(arguments: str) -> str:
    from relax_plugins.environments.tools import ToolError

    try:
        return _calculator().evaluate(json.loads(arguments)["expr"])
    except (ToolError, KeyError, ValueError, TypeError) as exc:
        return f"error: {exc}"


@functools.cache
def _calculator():
    from relax_plugins.environments.calculator import CalculatorEnvironment

    return CalculatorEnvironment(CalculatorEnvironment.Config())


@functools.cache
def _tools() -> tuple:
    """The calculator's tools in OpenAI form (what the environment arm declares too)."""
    return tuple(tool.to_openai() for tool in _calculator().tools())


@functools.cache
def shared_client(base_url: str, in_process: bool = False) -> openai.OpenAI:
    """One client for the run: one connection pool, one SSL set-up (or the in-process transport)."""
    from relax.agents.gateway_http import http_client

    return openai.OpenAI(base_url=base_url, api_key="per-trajectory", max_retries=0, timeout=120,
                         http_client=http_client(base_url) if in_process else None)


def _answered(reply) -> list:
    """The reply's message and the calculator's answer to each of its tool calls; empty when the
    reply calls no tool (the program is done)."""
    if reply.choices[0].finish_reason != "tool_calls":
        return []
    message = reply.choices[0].message
    return [message, *({"role": "tool", "tool_call_id": c.id, "content": _calculate(c.function.arguments)}
                       for c in message.tool_calls)]


def sync_program(task, base_url: str, api_key: str, in_process: bool = False) -> None:
    """Ask, answer each tool call with the calculator, ask again (at most two rounds)."""
    client = shared_client(base_url, in_process).with_options(api_key=api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=list(_tools()))
    for _ in range(2):
        turn = _answered(reply)
        if not turn:
            break
        messages += turn
        reply = client.chat.completions.create(model="policy", messages=messages, tools=list(_tools()))


def sync_in_process_program(task, base_url: str, api_key: str) -> None:
    sync_program(task, base_url, api_key, in_process=True)


@functools.cache
def shared_async_client(base_url: str, in_process: bool = False) -> openai.AsyncOpenAI:
    """One async client for the run: async programs all run on the gateway's one event loop."""
    from relax.agents.gateway_http import async_http_client

    return openai.AsyncOpenAI(base_url=base_url, api_key="per-trajectory", max_retries=0, timeout=120,
                              http_client=async_http_client(base_url) if in_process else None)


async def async_in_process_program(task, base_url: str, api_key: str) -> None:
    await async_program(task, base_url, api_key, in_process=True)


async def async_program(task, base_url: str, api_key: str, in_process: bool = False) -> None:
    """The same loop, written as an async program with one shared async client."""
    client = shared_async_client(base_url, in_process).with_options(api_key=api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=list(_tools()))
    for _ in range(2):
        turn = _answered(reply)
        if not turn:
            break
        messages += turn
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=list(_tools()))


async def async_raw_program(task, base_url: str, api_key: str) -> None:
    """The same loop as an async program that posts the JSON itself with the in-process ``httpx2``
    client (as agent harnesses with their own HTTP layer do): the gateway's cost without the
    ``openai`` client's request building and response parsing."""
    from relax.agents.gateway_http import async_http_client

    http = async_http_client(base_url)
    headers = {"Authorization": f"Bearer {api_key}"}
    messages: list = [{"role": "user", "content": task.prompt}]
    for _ in range(3):
        reply = await http.post("/chat/completions", headers=headers,
                                json={"model": "policy", "messages": messages, "tools": list(_tools())})
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            break
        message = choice["message"]
        messages += [message, *({"role": "tool", "tool_call_id": c["id"],
                                 "content": _calculate(c["function"]["arguments"])} for c in message["tool_calls"])]


def client_alone_ms(calls: int = 300) -> float:
    """CPU milliseconds the ``openai`` client spends on one chat call (the calculator's tools, a
    reply with a tool call) when the answer costs nothing: a transport that returns it at once."""
    import httpx2

    answer = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "policy",
                         "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                             "role": "assistant", "content": None, "tool_calls": [{
                                 "id": "call_1", "type": "function",
                                 "function": {"name": "calc", "arguments": '{"expr": "347*58"}'}}]}}],
                         "usage": {"prompt_tokens": 30, "completion_tokens": 16, "total_tokens": 46}}).encode()

    def answered(request):
        request.read()
        return httpx2.Response(200, content=answer, headers={"content-type": "application/json"})

    client = openai.OpenAI(base_url="http://gateway/v1", api_key="per-trajectory", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(answered)))
    messages = [{"role": "user", "content": "347*58="}]

    def call() -> None:
        client.with_options(api_key="k").chat.completions.create(model="policy", messages=messages,
                                                                 tools=list(_tools()))

    for _ in range(20):
        call()
    started = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - started) / calls * 1e3


def _cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process ``pid`` has spent."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # it has exited (a restarted worker): its CPU is not counted
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Held:
    """The most file descriptors and threads this process and the agent program processes
    ``children`` names hold together while it runs (sampled), and the CPU seconds the children spend."""

    def __init__(self, children: list[int]) -> None:
        self.children = children
        self.fds = self.threads = 0
        self.children_cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
            for pid in self.children:
                try:
                    fds += len(os.listdir(f"/proc/{pid}/fd"))
                    threads += int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                        if line.startswith("Threads:")))
                except (OSError, StopIteration, ValueError):
                    continue  # it has just exited (a restarted worker)
            self.fds, self.threads = max(self.fds, fds), max(self.threads, threads)

    def __enter__(self) -> Held:
        self._cpu = sum(_cpu_s(pid) for pid in self.children)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.children_cpu = sum(_cpu_s(pid) for pid in self.children) - self._cpu


def runs(args: argparse.Namespace, arms: tuple[str, ...]) -> None:
    """``--steps``: the preset's own ``relax run`` (separate mode, a local Ray), one run per arm and
    repeat, with ``--trajectories`` trajectories a step, all concurrent; the median ``time/step_s``
    of each arm's steps after the first ``--skip`` (start-up), and its ratio to the environment's."""
    from relax import testing

    here = str(Path(__file__).parent)  # the programs (gateway:...) must import in Ray's processes too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    samples = 8  # the preset's algorithm.samples_per_prompt
    common = [f"trainer.steps={args.steps}", "trainer.checkpoint_every=0",
              f"algorithm.prompts_per_step={args.trajectories // samples}",
              f"roles.rollout.agent.concurrency={args.trajectories}", *args.set]
    overrides = {"environment": []}
    for arm in arms:
        program, _, processes = arm.partition("/")
        overrides[arm] = ["roles.rollout.agent.environment=null",
                          f"roles.rollout.agent.gateway.program=gateway:{program}_program",
                          f"roles.rollout.agent.gateway.processes={processes or 0}"]
    steps: dict[str, list[float]] = {arm: [] for arm in overrides}
    order = list(overrides)
    root = Path(tempfile.mkdtemp(prefix="relax-gateway-runs-"))
    with testing.local_ray():
        for repeat in range(args.repeats):
            for arm in order[repeat % len(order):] + order[:repeat % len(order)]:
                code, rows, printed = testing.tiny_run(root, f"{arm.replace('/', '-w')}-{repeat}", *common,
                                                       *overrides[arm], preset="tiny-agent-cpu")
                if code != 0:
                    sys.exit(f"the {arm} run failed (exit {code}):\n{printed[-2000:]}")
                took = [row["time/step_s"] for row in rows[args.skip:]]
                steps[arm] += took
                print(f"{arm}: " + ", ".join(f"{s:.2f}" for s in took) + " s/step; agent/failed "
                      f"{max(row.get('agent/failed', 0) for row in rows):g}", flush=True)
    print(f"relax run of the tiny agent preset, {args.trajectories} trajectories a step (all concurrent), "
          f"{args.steps} steps, the first {args.skip} left out, {args.repeats} repeats, {os.cpu_count()} cores")
    env = statistics.median(steps["environment"])
    for arm, values in steps.items():
        print(f"{arm:20s} {statistics.median(values):6.2f} s/step (range {min(values):.2f}-{max(values):.2f}), "
              f"ratio to the environment {statistics.median(values) / env:.2f}  (issue 42: at most 1.5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default="sync_in_process,async_in_process,async_raw,sync_in_process/2,"
                                          "async_in_process/2,sync/2,async/2",
                        help="the gateway arms to run, comma-separated, each with /N to run its programs in N "
                             "worker processes (the environment arm always runs)")
    parser.add_argument("--device", default="cpu",
                        help="where the hf rollout generates: cpu, or cuda on a machine with an NVIDIA GPU")
    parser.add_argument("--timeline", action="store_true",
                        help="print each model batch of the last repeat: when it started, its rows, its seconds")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="spec overrides for the preset (e.g. model.options.hidden_size=256)")
    parser.add_argument("--steps", type=int, default=0,
                        help="instead of rollout units: the preset's relax run for this many steps per arm "
                             "(s/step, training included)")
    parser.add_argument("--skip", type=int, default=2, help="with --steps: the first steps left out (start-up)")
    args = parser.parse_args()
    if args.steps:
        if args.steps <= args.skip:
            parser.error("--steps must be more than --skip")
        return runs(args, tuple(arm for arm in args.arms.split(",") if arm))

    import torch

    from relax import testing
    from relax.agents.chat import ChatTokens
    from relax.agents.gateway import ProgramDriver
    from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
    from relax.contracts import AgentTask, PluginKind
    from relax.plan.contexts import rollout_context
    from relax.registry import get_registry
    from relax.runtime.model_files import materialize_model
    from relax.spec.models import AgentSpec, GatewaySpec

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: this machine has no CUDA GPU that torch can use; run with --device cpu")
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))  # the programs: gateway:sync_program, gateway:async_program
    spec, _, base = testing.tiny_spec(Path(tempfile.mkdtemp(prefix="relax-gateway-bench-")), "bench",
                                      *args.set, preset="tiny-agent-cpu")
    path = materialize_model(spec, base)
    registry = get_registry()
    rollout = registry.load(PluginKind.rollout, "hf")(registry.build_config(PluginKind.rollout, "hf", {}),
                                                       rollout_context(spec, path, args.device))
    environment = _calculator()
    agent = spec.roles.rollout.agent
    n = args.trajectories
    limits = AgentLimits(max_turns=agent.max_turns, max_tokens=agent.max_tokens,
                         max_new_tokens=agent.max_new_tokens or 16, tool_timeout_s=60, concurrency=n)
    max_prompt = spec.data.max_prompt_tokens
    chat = ChatTokens(rollout.tokenizer, list(environment.tools()), None, max_prompt)
    drivers = {"environment": EnvironmentDriver(environment, "calculator", chat, limits, version=lambda: 0)}
    gateway_arms = tuple(arm for arm in args.arms.split(",") if arm)
    for arm in gateway_arms:
        program, _, processes = arm.partition("/")
        gateway = AgentSpec(gateway=GatewaySpec(program=f"gateway:{program}_program", processes=int(processes or 0)),
                            max_turns=agent.max_turns, max_tokens=agent.max_tokens, concurrency=n)
        drivers[arm] = ProgramDriver(gateway, rollout, limits, version=lambda: 0, max_prompt_tokens=max_prompt)
    rng = random.Random(0)
    tasks = [AgentTask(prompt=f"{rng.randint(100, 999)}*{rng.randint(10, 99)}=", label="", row={}, index=j,
                       sample=0, trajectory_id=f"0:{j}:0") for j in range(n)]

    timeline: list[tuple[float, int, float]] = []

    def generate(prompts, seed):
        started = time.perf_counter()
        out = rollout.generate_tokens(prompts, rollout.context.sampling, seed)
        timeline.append((started, len(prompts), time.perf_counter() - started))
        return out

    for driver in drivers.values():  # warm the template, the model and the server
        run_trajectories(tasks[:4], driver, generate, 0)
    walls: dict[str, list[float]] = {arm: [] for arm in drivers}
    cpus: dict[str, list[float]] = {arm: [] for arm in drivers}
    worker_cpus: dict[str, list[float]] = {arm: [] for arm in drivers}
    held: dict[str, tuple[int, int]] = {arm: (0, 0) for arm in drivers}
    turns: dict[str, float] = {}
    failed: dict[str, int] = {}
    batches: dict[str, float] = {}
    order = list(drivers)
    for repeat in range(args.repeats):
        for arm in order[repeat % len(order):] + order[:repeat % len(order)]:  # each repeat starts one arm later
            driver = drivers[arm]
            timeline.clear()
            with Held(driver.program_pids() if isinstance(driver, ProgramDriver) else []) as watch:
                started, cpu = time.perf_counter(), time.process_time()
                batch = run_trajectories(tasks, driver, generate, 1 + repeat)
                walls[arm].append(time.perf_counter() - started)
                cpus[arm].append(time.process_time() - cpu)
            worker_cpus[arm].append(watch.children_cpu)
            if args.timeline and repeat == args.repeats - 1:
                print(f"{arm}: " + ", ".join(f"{at - started:.2f} s: {rows} rows in {took:.2f} s"
                                              for at, rows, took in timeline), flush=True)
            held[arm] = (max(held[arm][0], watch.fds), max(held[arm][1], watch.threads))
            turns[arm] = batch.stats["agent_turns"]
            failed[arm] = int(batch.stats["agent_failed"])
            batches[arm] = batch.stats["agent_generate_calls"]
    for driver in drivers.values():
        close = getattr(driver, "close", None)
        if close is not None:
            close()
    alone = client_alone_ms()
    print(f"{n} trajectories a unit, {args.repeats} repeats, tiny agent preset model"
          f"{' with ' + ' '.join(args.set) if args.set else ''}, hf rollout on {args.device}, "
          f"{os.cpu_count()} cores")
    print(f"openai client alone: {alone:.2f} ms CPU a chat call; the environment arm: "
          f"{statistics.median(cpus['environment']) / n * 1e3:.2f} ms CPU a trajectory, model included")
    for arm, values in walls.items():
        print(f"{arm:16s} {statistics.median(values):7.2f} s/unit (range {min(values):.2f}-{max(values):.2f}), "
              f"CPU {statistics.median(cpus[arm]):.2f} s"
              f"{f' (+ workers {statistics.median(worker_cpus[arm]):.2f} s)' if '/' in arm else ''}, "
              f"{turns[arm]:.2f} turns/trajectory, "
              f"{batches[arm]:.0f} model batches, {failed[arm]} failed, at most {held[arm][0]} fds and "
              f"{held[arm][1]} threads held")
    env = statistics.median(walls["environment"])
    for arm in gateway_arms:
        print(f"ratio {arm} / environment: {statistics.median(walls[arm]) / env:.2f}  (issue 42: at most 1.5); "
              f"CPU seconds {statistics.median(cpus[arm]) / statistics.median(cpus['environment']):.2f}")


if __name__ == "__main__":
    main()
