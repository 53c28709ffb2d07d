"""The ``verifiers`` adapter scores as verifiers does: 64 fixed samples through the environment
plugin, driven by the rollout's trajectory runner with a scripted model, and through verifiers' own
``run_rollout`` with a scripted client (the library's loop and its rubric scoring) give equal
rewards, sample for sample. The environments are built in code: a ``ToolEnv`` with two tools and a
``SingleTurnEnv``, each with its own ``Rubric``.

verifiers 0.3.1 (the newest release with the legacy ``ToolEnv``/``Rubric`` stack) pins ``mcp<2``
against the project's ``mcp==2.3.0``, so it runs in the ``envs`` lane (``nox -s envs``); elsewhere
this module is skipped."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
from relax.contracts import AgentTask
from relax.registry import get_registry
from tests.agents.test_runner import Script

vf = pytest.importorskip("verifiers", reason="verifiers 0.3.1 pins mcp<2 against the project's mcp 2.3.0: it is "
                         "installed only in nox -s envs")
pytest.importorskip("verifiers.legacy", reason="the legacy stack (ToolEnv, Rubric) is in verifiers <= 0.3.1")

from datasets import Dataset  # noqa: E402
from verifiers.legacy.clients.client import Client  # noqa: E402
from verifiers.legacy.types import Response, ResponseMessage, ToolCall  # noqa: E402

STOCK = {"apple": 3, "pear": 5, "plum": 11, "fig": 7}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def stock(item: str) -> str:
    """How many of an item are in stock.

    Args:
        item: The item's name.
    """
    if item not in STOCK:
        raise KeyError(f"no item {item!r}")
    return str(STOCK[item])


def answer_of(completion) -> str:
    texts = [m.content for m in completion if m.role == "assistant" and isinstance(m.content, str)]
    found = re.findall(r"<answer>(.*?)</answer>", texts[-1] if texts else "")
    return found[-1].strip() if found else ""


async def correct(completion, answer) -> float:
    return 1.0 if answer_of(completion) == str(answer) else 0.0


async def used_tools(completion) -> float:
    return float(sum(len(m.tool_calls or []) for m in completion if m.role == "assistant") > 0)


def tool_env(max_turns: int = 4):
    """A verifiers ToolEnv built in code: two tools, a rubric rewarding the right answer (1.0) and
    tool use (0.25)."""
    rubric = vf.Rubric(funcs=[correct, used_tools], weights=[1.0, 0.25])
    return vf.ToolEnv(tools=[add, stock], max_turns=max_turns, rubric=rubric,
                      dataset=Dataset.from_list([{"question": "q", "answer": "0"}]))


def single_turn_env():
    """A verifiers SingleTurnEnv built in code, scored by its rubric's right answer."""
    return vf.SingleTurnEnv(rubric=vf.Rubric(funcs=[correct]), dataset=Dataset.from_list([{"question": "q",
                                                                                              "answer": "0"}]))


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def scripts(seed: int, labels: list[str]) -> list[list[tuple[str, list[tuple[str, dict]]]]]:
    """Per sample, its model turns: (text, calls) with calls in the text as hermes tool calls; a turn
    without calls ends a ToolEnv's rollout. Right and wrong answers, tool calls that fail (an item
    not in stock), several calls in one turn, and rollouts cut at the environment's max_turns."""
    rng = random.Random(seed)
    out = []
    for label in labels:
        turns = []
        for _ in range(rng.choice([0, 1, 2, 4])):
            calls = [rng.choice([("add", {"a": rng.randint(0, 9), "b": rng.randint(0, 9)}),
                                 ("stock", {"item": rng.choice([*STOCK, "kiwi"])})])
                     for _ in range(rng.choice([1, 1, 2]))]
            turns.append(("Let me check.\n" + "\n".join(call_text(n, a) for n, a in calls), calls))
        guess = label if rng.random() < 0.5 else str(int(label) + rng.randint(1, 3))
        turns.append((f"The total is <answer>{guess}</answer>", []))
        out.append(turns)
    return out


class ScriptedClient(Client):
    """verifiers' side: a client answering each request with the sample's next scripted turn."""

    def __init__(self, turns) -> None:
        super().__init__(None)
        self.turns, self.asked = turns, 0

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        text, calls = self.turns[min(self.asked, len(self.turns) - 1)]
        self.asked += 1
        tool_calls = [ToolCall(id=f"c{self.asked}_{i}", name=n, arguments=json.dumps(a)) for i, (n, a) in
                      enumerate(calls)] or None
        return Response(id=str(self.asked), created=0, model=model,
                        message=ResponseMessage(content=text, tool_calls=tool_calls,
                                                finish_reason="tool_calls" if calls else "stop", is_truncated=False))

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        return response

    async def close(self):
        return None


def library_rewards(env, turns, labels) -> list[float]:
    """verifiers' own loop and rubric: ``run_rollout`` per sample with the scripted client."""

    async def all_rollouts():
        outs = []
        for j, label in enumerate(labels):
            inp = {"prompt": [{"role": "user", "content": f"task {j}"}], "example_id": j, "answer": label,
                   "info": {}}
            outs.append(await env.run_rollout(inp, ScriptedClient(turns[j]), "scripted", {}))
        return outs

    outputs = asyncio.run(all_rollouts())
    assert all(o["error"] is None for o in outputs)
    return [float(o["reward"]) for o in outputs]


@pytest.fixture(scope="module")
def tokenizer(omni_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_path)


def plugin(options: dict):
    registry = get_registry()
    return registry.load("environments", "verifiers")(registry.build_config("environments", "verifiers", options))


def drive(tokenizer, env, turns, labels, max_turns: int):
    chat = ChatTokens(tokenizer, env.tools(), None, 256)
    limits = AgentLimits(max_turns=max_turns, max_tokens=4000, max_new_tokens=200, tool_timeout_s=20.0,
                         concurrency=16)
    driver = EnvironmentDriver(env, "verifiers", chat, limits, version=lambda: 1)
    tasks = [AgentTask(prompt=f"task {j}", label=labels[j], row={"i": j}, index=j, sample=0, trajectory_id=f"0:{j}:0")
             for j in range(len(labels))]
    return run_trajectories(tasks, driver, Script(tokenizer, {j: [t for t, _ in turns[j]] for j in range(len(turns))}),
                            seed=0)


def test_tool_env_rewards_equal_verifiers_rubric_scoring(tokenizer):
    labels = [str(v) for v in random.Random(1).choices(range(2, 30), k=64)]
    turns = scripts(7, labels)
    expected = library_rewards(tool_env(), turns, labels)
    env = plugin({"env": f"{__name__}:tool_env"})
    assert [t.name for t in env.tools()] == ["add", "stock"]
    batch = drive(tokenizer, env, turns, labels, max_turns=8)
    env.teardown()
    for j, traj in enumerate(batch.trajectories):
        assert traj.error is None, (j, traj.error)
        assert traj.outcome in ("ok", "tool_error"), (j, traj.outcome)
        assert traj.turn_reward == expected[j], j
        assert len(traj.turns) == min(len(turns[j]), 4)  # the ToolEnv's own max_turns cuts the long ones
    assert set(expected) == {0.0, 0.25, 1.0, 1.25}  # right and wrong, with and without tools
    failed = [o for t in batch.trajectories for o in t.observations if "no item 'kiwi'" in str(o)]
    assert failed  # a tool's error is the observation, as verifiers formats it


def test_single_turn_env_rewards_equal_verifiers_rubric_scoring(tokenizer):
    labels = [str(v) for v in random.Random(2).choices(range(2, 30), k=64)]
    turns = [[t[-1]] for t in scripts(8, labels)]
    expected = library_rewards(single_turn_env(), turns, labels)
    env = plugin({"env": f"{__name__}:single_turn_env"})
    assert env.tools() == []
    batch = drive(tokenizer, env, turns, labels, max_turns=3)
    env.teardown()
    assert [t.turn_reward for t in batch.trajectories] == expected
    assert [len(t.turns) for t in batch.trajectories] == [1] * 64
    assert 0 < sum(expected) < 64


def failing_setup_env():
    class Broken(vf.SingleTurnEnv):
        async def setup_state(self, state):
            raise vf.Error("the sandbox did not start")

    return Broken(rubric=vf.Rubric(funcs=[correct]), dataset=Dataset.from_list([{"question": "q", "answer": "0"}]))


def test_a_rollout_that_verifiers_ends_with_an_error_is_an_env_error(tokenizer):
    env = plugin({"env": f"{__name__}:failing_setup_env"})
    batch = drive(tokenizer, env, {0: [("<answer>3</answer>", [])]}, ["3"], max_turns=2)
    env.teardown()
    traj = batch.trajectories[0]
    assert traj.outcome == "env_error" and "the sandbox did not start" in traj.error


def test_unknown_environments_are_named():
    with pytest.raises(ValueError, match="cannot import 'nope'"):
        plugin({"env": f"{__name__}:nope"})
    with pytest.raises(ValueError, match="Could not import 'no_such_env'"):
        plugin({"env": "no_such_env"})
