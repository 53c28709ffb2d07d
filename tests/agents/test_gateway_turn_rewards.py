"""Per-turn rewards from an agent program: ``metadata["relax.turn_reward"]`` on a call sets the reward
of the turn that call generates, ``POST /v1/relax/turn_reward`` sets any turn's afterwards, and the
trajectory's reward adds their sum times ``turn_reward_weight`` as it adds an environment's.

The real ``hf`` rollout on the tiny omni model behind the real gateway, driven by the official
``openai`` client."""

from __future__ import annotations

import openai
import torch

from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.contracts import AgentTask
from relax.runtime.worker.roles.reward import agent_rewards
from relax.spec.models import AgentSpec, GatewaySpec

#: What each program saw, by trajectory id.
SEEN: dict[str, dict] = {}


def reports_turn_rewards(task: AgentTask, base_url: str, api_key: str) -> None:
    """Three calls, each reporting a reward in its metadata (one of them not a number: refused, no
    turn generated), then turn 0's reward replaced through the side route."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": task.prompt}]
    seen = SEEN.setdefault(task.trajectory_id, {})
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                           metadata={"relax.turn_reward": "0.5"})  # the API's metadata: strings
    messages += [first.choices[0].message, {"role": "user", "content": "Go on."}]
    try:
        client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                       metadata={"relax.turn_reward": "high"})
    except openai.BadRequestError as exc:
        seen["bad"] = (exc.status_code, exc.body)
    client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                   metadata={"relax.turn_reward": "0.25", "other": "kept out"})
    seen["replaced"] = client.post("/relax/turn_reward", body={"reward": 1.0, "turn": 0}, cast_to=object)
    try:
        client.post("/relax/turn_reward", body={"reward": 1.0, "turn": 2}, cast_to=object)
    except openai.BadRequestError as exc:
        seen["no_turn"] = (exc.status_code, exc.body)


def test_a_program_reports_turn_rewards_in_metadata_and_through_the_side_route(omni_backends):
    rollout, _ = omni_backends
    sampling = rollout.context.sampling
    limits = AgentLimits(max_turns=4, max_tokens=200, max_new_tokens=4, tool_timeout_s=60, concurrency=2)
    agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_turn_rewards:reports_turn_rewards"),
                      max_turns=4, max_tokens=200, turn_reward_weight=0.5)
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 1, max_prompt_tokens=128)
    tasks = [AgentTask(prompt=f"What is {j}+2?", label="", row={}, index=0, sample=j, trajectory_id=f"tr:{j}")
             for j in range(2)]
    try:
        batch = run_trajectories(tasks, driver, lambda p, s: rollout.generate_tokens(p, sampling, s), 3)
    finally:
        driver.close()

    for task, t in zip(tasks, batch.trajectories):
        seen = SEEN[task.trajectory_id]
        assert t.error is None, t.error
        assert len(t.turns) == 2  # the refused call generated nothing
        status, body = seen["bad"]
        assert status == 400 and body["param"] == "metadata.relax.turn_reward" and "'high'" in body["message"]
        assert seen["replaced"] == {"object": "relax.turn_reward", "turn": 0, "reward": 1.0, "turn_reward": 1.25}
        status, body = seen["no_turn"]
        assert status == 400 and body["param"] == "turn" and "from 0 to 1" in body["message"]
        summary = t.summary()
        assert summary["turn_reward"] == 1.25 and summary["info"]["turn_rewards"] == {"0": 1.0, "1": 0.25}
    # The reward the advantage sees: the plugins' score (or the program's own) plus weight x the turn rewards.
    scores = torch.tensor([0.0, 1.0])
    totals = agent_rewards(scores, [t.summary() for t in batch.trajectories], agent.turn_reward_weight)
    assert totals.tolist() == [0.625, 1.625]
