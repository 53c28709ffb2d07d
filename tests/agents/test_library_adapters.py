"""Environment-library adapters score as the libraries do: 64 fixed samples through each adapter and
through the library's own scoring or ``step`` loop give equal rewards, sample for sample.

- ``reasoning_gym`` (data set and reward plugins) against ``score_answer`` on the library's items;
- ``skyrl_gym`` (environment plugin, driven by the rollout's trajectory runner with a scripted
  model) against skyrl-gym's ``make``/``init``/``step`` loop on the same actions; also an environment
  built in code (``module:Class``)."""

from __future__ import annotations

import random

import pytest
import reasoning_gym  # in the test extra, with skyrl_gym: a missing one is a broken install
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
from relax.contracts import AgentTask, RewardSample
from relax.registry import get_registry
from tests.agents.test_runner import Script


def plugin(kind: str, name: str, options: dict):
    registry = get_registry()
    return registry.load(kind, name)(registry.build_config(kind, name, options))


@pytest.mark.parametrize("name,extract", [("basic_arithmetic", "answer_tag"), ("leg_counting", "none")])
def test_reasoning_gym_rewards_equal_the_librarys_score_answer(name, extract):
    data = plugin("datasets", "reasoning_gym", {"name": name, "size": 64, "seed": 11,
                                                "prompt_template": "{question} Answer in <answer></answer>."})
    reward = plugin("rewards", "reasoning_gym", {"name": name, "extract": extract})
    library = reasoning_gym.create_dataset(name, seed=11, size=64)
    rng = random.Random(5)
    responses, expected = [], []
    for i in range(64):
        entry = library[i]
        assert data[i]["prompt"].startswith(entry["question"]) and data[i]["answer"] == str(entry["answer"])
        answer = rng.choice([entry["answer"], str(entry["answer"]) + "0", " " + str(entry["answer"]) + " ", "x"])
        text = f"thinking... <answer>{answer}</answer><|im_end|>" if extract == "answer_tag" else f"{answer}<|im_end|>"
        responses.append(text)
        given = reasoning_gym.utils.extract_answer(text.split("<|im_end|>")[0]) if extract == "answer_tag" \
            else text.split("<|im_end|>")[0].strip()
        expected.append(float(library.score_answer(given, entry)))
    scores = reward.score([RewardSample(prompt=data[i]["prompt"], response=responses[i], label=data[i]["entry"])
                           for i in range(64)])
    assert scores == expected
    assert 0 < sum(scores) < 64  # right and wrong answers both present


def test_reasoning_gym_refuses_a_label_that_is_not_an_entry():
    reward = plugin("rewards", "reasoning_gym", {"name": "basic_arithmetic"})
    with pytest.raises(ValueError, match="set data.label_key: entry"):
        reward.score([RewardSample(prompt="", response="3", label="3")])
    with pytest.raises(ValueError, match="no generator 'basic_arithmetc'.*similar: basic_arithmetic"):
        plugin("datasets", "reasoning_gym", {"name": "basic_arithmetc"})


@pytest.fixture(scope="module")
def tokenizer(omni_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_path)


def drive(tokenizer, env, turns: dict[int, list[str]], labels: list[str], max_turns: int):
    chat = ChatTokens(tokenizer, env.tools(), None, 256)
    limits = AgentLimits(max_turns=max_turns, max_tokens=2000, max_new_tokens=60, tool_timeout_s=20.0, concurrency=16)
    driver = EnvironmentDriver(env, "skyrl_gym", chat, limits, version=lambda: 1)
    tasks = [AgentTask(prompt=f"task {j}", label=labels[j], row={"i": j}, index=j, sample=0, trajectory_id=f"0:{j}:0")
             for j in range(len(labels))]
    return run_trajectories(tasks, driver, Script(tokenizer, turns), seed=0)


def library_rewards(env_id: str, actions: list[str], label: str, extras: dict) -> tuple[float, int]:
    """skyrl-gym's own loop: make, init, step each action until done; the rewards' sum and the steps."""
    from omegaconf import OmegaConf

    env = skyrl_gym.make(env_id, env_config=OmegaConf.create({}),
                         extras={**extras, "reward_spec": {"method": "rule", "ground_truth": label}, "extra_info": {}})
    env.init([{"role": "user", "content": "q"}])
    total, steps = 0.0, 0
    for action in actions:
        out = env.step(action)
        total += out["reward"]
        steps += 1
        if out["done"]:
            break
    env.close()
    return total, steps


def test_skyrl_gym_step_rewards_equal_the_librarys_loop(tokenizer):
    rng = random.Random(3)
    labels = [str(rng.randint(1, 99)) for _ in range(64)]
    turns = {}
    for j, label in enumerate(labels):
        script = []
        for _ in range(3):
            kind = rng.choice(["right", "wrong", "none"])
            script.append(f"So the answer: #### {label}" if kind == "right" else
                          f"Maybe #### {int(label) + 1}" if kind == "wrong" else "I am not sure yet.")
        turns[j] = script
    env = plugin("environments", "skyrl_gym", {"env": "gsm8k_multi_turn", "extras": {"max_turns": 3}})
    batch = drive(tokenizer, env, turns, labels, max_turns=3)
    for j, traj in enumerate(batch.trajectories):
        expected, steps = library_rewards("gsm8k_multi_turn", turns[j], labels[j], {"max_turns": 3})
        assert traj.error is None, traj.error
        assert traj.turn_reward == pytest.approx(expected, abs=1e-12), j
        assert len(traj.turns) == steps
    totals = [t.turn_reward for t in batch.trajectories]
    assert len(set(totals)) > 3  # the samples differ: right, wrong and unformatted answers


class GuessEnv(BaseTextEnv):
    """A skyrl-gym environment built in code: guess the number, told higher/lower, two tries."""

    def __init__(self, env_config=None, extras: dict | None = None) -> None:
        super().__init__()
        self.target = int(extras["reward_spec"]["ground_truth"])
        self.max_turns = 2

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        guess = int("".join(c for c in action if c.isdigit()) or -1)
        if guess == self.target:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
        done = self.turns >= self.max_turns
        hint = [] if done else [{"role": "user", "content": "higher" if guess < self.target else "lower"}]
        return BaseTextEnvStepOutput(observations=hint, reward=0.0, done=done, metadata={})


def test_a_skyrl_gym_environment_built_in_code(tokenizer):
    env = plugin("environments", "skyrl_gym", {"env": f"{__name__}:GuessEnv"})
    batch = drive(tokenizer, env, {0: ["5", "7"], 1: ["9", "1"], 2: ["3"]}, ["7", "2", "3"], max_turns=4)
    assert [t.turn_reward for t in batch.trajectories] == [1.0, 0.0, 1.0]
    assert [len(t.turns) for t in batch.trajectories] == [2, 2, 1]
    assert batch.trajectories[0].observations[0] == "higher" and batch.trajectories[1].observations[0] == "lower"
    assert [t.outcome for t in batch.trajectories] == ["ok", "ok", "ok"]
    with pytest.raises(ValueError, match="no environment 'nope'"):
        plugin("environments", "skyrl_gym", {"env": "nope"})
