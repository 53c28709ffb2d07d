"""The ``gem`` adapter scores as gem does: 64 seeded games through the data set and environment
plugins, driven by the rollout's trajectory runner, and through gem's own ``reset``/``step`` loop
give equal step rewards, sample for sample. The model is a scripted policy that reads only the
conversation (binary search on the game's hints, with some malformed guesses), so both loops see
the same actions exactly when they show the same observations.

gem-llm 0.1 pins msgspec and reasoning-gym against the project, so it runs in the ``envs`` lane
(``nox -s envs``); elsewhere this module is skipped."""

from __future__ import annotations

import re
import zlib

import pytest

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
from relax.contracts import AgentTask, Generation, TokenPrompt
from relax.registry import get_registry

gem = pytest.importorskip("gem", reason="gem-llm pins msgspec 0.19 against the project's 0.23: it is installed only in "
                             "nox -s envs")

ENV = "game:GuessTheNumber-v0-easy"


def policy(conversation: str) -> str:
    """The next guess from the conversation's text: bisect what the hints leave open; about one game
    in four gets an unboxed answer on its second turn (a format error gem scores itself)."""
    low, high = map(int, re.search(r"between (\d+) and (\d+)", conversation).groups())
    for guess, hint in re.findall(r"you guessed (\d+), and the target number is (higher|lower)", conversation):
        if hint == "higher":
            low = max(low, int(guess) + 1)
        else:
            high = min(high, int(guess) - 1)
    turns = len(re.findall(r"you guessed \d+", conversation))
    example = re.search(r"for example, \\boxed\{(\d+)\}", conversation).group(1)  # the game's own, per seed
    if turns == 1 and zlib.crc32(example.encode()) % 4 == 0:
        return "I think it is seven"
    return f"My guess: \\boxed{{{(low + high) // 2}}}"


class PolicyModel:
    """Generates the policy's action for each prompt (decoded), ending with the stop token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.stop = tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts: list[TokenPrompt], seed: int) -> list[Generation]:
        out = []
        for i, prompt in enumerate(prompts):
            action = policy(self.tokenizer.decode(prompt.ids))
            ids = self.tokenizer(action, add_special_tokens=False)["input_ids"] + [self.stop]
            out.append(Generation(prompt_index=i, prompt_ids=list(prompt.ids), response_ids=ids,
                                  logprobs=[-0.5] * len(ids), text=action, finished=True))
        return out


@pytest.fixture(scope="module")
def tokenizer(omni_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_path)


def plugin(kind: str, options: dict):
    registry = get_registry()
    return registry.load(kind, "gem")(registry.build_config(kind, "gem", options))


def gem_loop(seed: int) -> tuple[float, int]:
    """gem's own loop: reset with the seed, the policy on the observations so far, step until done."""
    env = gem.make(ENV)
    observation, _ = env.reset(seed=seed)
    conversation, total, steps = observation, 0.0, 0
    while True:
        observation, reward, terminated, truncated, _ = env.step(policy(conversation))
        total, steps = total + reward, steps + 1
        conversation += "\n" + observation
        if terminated or truncated:
            return total, steps


def test_gem_step_rewards_equal_gems_own_loop(tokenizer):
    data = plugin("datasets", {"env": ENV, "size": 64, "seed": 100})
    env = plugin("environments", {"env": ENV})
    chat = ChatTokens(tokenizer, env.tools(), None, 512)
    limits = AgentLimits(max_turns=30, max_tokens=6000, max_new_tokens=40, tool_timeout_s=20.0, concurrency=16)
    driver = EnvironmentDriver(env, "gem", chat, limits, version=lambda: 1)
    tasks = [AgentTask(prompt=data[i]["prompt"], label=data[i]["seed"], row=data[i], index=i, sample=0,
                       trajectory_id=f"0:{i}:0") for i in range(64)]
    batch = run_trajectories(tasks, driver, PolicyModel(tokenizer), seed=0)
    rewards = []
    for i, traj in enumerate(batch.trajectories):
        expected, steps = gem_loop(100 + i)
        assert traj.error is None, traj.error
        assert traj.turn_reward == pytest.approx(expected, abs=1e-12), i
        assert len(traj.turns) == steps, i
        rewards.append(traj.turn_reward)
    assert len(set(rewards)) > 1  # won games and format errors both present


def test_a_label_that_is_not_the_rows_seed_is_named():
    env = plugin("environments", {"env": ENV})
    with pytest.raises(ValueError, match="data.label_key: seed"):
        env.start(AgentTask(prompt="", label="x", row={}, index=0, sample=0, trajectory_id="t"))
    with pytest.raises(ValueError, match="gem has no environment 'game:Nope'"):
        plugin("environments", {"env": "game:Nope"})
