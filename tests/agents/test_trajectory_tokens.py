"""Token in, token out: a multi-turn trajectory reaches the trainer exactly as the model read and
wrote it, with an image a tool returned in the middle.

The real ``hf`` rollout and ``torch`` trainer on the tiny omni model (a ChatML template, turns
ending in ``<|im_end|>``); the environment is a small one written here against the published
contract. The trainer's input ids and loss mask must equal the trajectory's token for token, and
its recomputed log-probs must equal the rollout's behaviour log-probs on every model token (the
image the tool returned is rebuilt from its reference for both)."""

from __future__ import annotations

import random

import torch
from pydantic import BaseModel

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
from relax.algo.batch import TrainBatch
from relax.contracts import AgentTask, Observation, ToolSpec
from relax.media import MediaSet, dumps_context
from relax.roles import Column
from relax.runtime.worker.rows import rollout_columns
from relax_plugins.datasets.omni import encode_media, omni_problem
from relax_plugins.processing import pad_token_ids, placeholder_count

TURNS = 4


class PictureEnvironment:
    """Answers the first turn with a picture (a tool result), the second with a user message, the
    third with text, and ends after the fourth: whatever the model says."""

    class Config(BaseModel):
        image: str

    def __init__(self, config: "PictureEnvironment.Config") -> None:
        self.config = config

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec("look", "shows the picture", {"type": "object", "properties": {}})]

    def start(self, task: AgentTask) -> dict:
        return {"task": task.trajectory_id}

    def step(self, state: dict, turn) -> Observation:
        if turn.index == 0:
            return Observation([{"type": "text", "text": "here it is:"}, {"type": "image", "image": self.config.image}],
                               info={"tool": "look"})
        if turn.index == 1:
            return Observation("and now?", role="user")
        if turn.index == 2:
            return Observation("almost done", reward=0.25)
        return Observation(done=True)


def test_a_four_turn_trajectory_with_an_image_reaches_the_trainer_token_for_token(omni_backends, omni_spec, tmp_path):
    rollout, trainer = omni_backends
    problem = omni_problem(random.Random("agent-picture"), "image")
    data, suffix = encode_media("image", problem["media"])
    picture = tmp_path / f"picture{suffix}"
    picture.write_bytes(data)
    environment = PictureEnvironment(PictureEnvironment.Config(image=str(picture)))
    media = MediaSet.from_info(rollout.context.media, tmp_path, tmp_path / "media")
    chat = ChatTokens(rollout.tokenizer, environment.tools(), rollout.encode_text, 128)
    limits = AgentLimits(max_turns=TURNS, max_tokens=600, max_new_tokens=12, tool_timeout_s=30, concurrency=4)
    driver = EnvironmentDriver(environment, "picture", chat, limits, version=lambda: 3, media=media)
    tasks = [AgentTask(prompt="What is 3+4?", label="7", row={}, index=0, sample=j, trajectory_id=f"0:0:{j}")
             for j in range(4)]
    sampling = rollout.context.sampling
    batch = run_trajectories(tasks, driver, lambda prompts, seed: rollout.generate_tokens(prompts, sampling, seed), 7)

    done = [t for t in batch.trajectories if t.error is None and not t.truncated]
    assert done, [(t.error, t.truncated, len(t.turns)) for t in batch.trajectories]
    pads = pad_token_ids(rollout.encoder.processor)
    for t in done:
        assert len(t.turns) == TURNS and len(t.media) == 1
        assert t.turn_reward == 0.25
        # The picture is in the tokens after the first model turn, never in the prompt.
        first_end = t.turns[0][1]
        assert placeholder_count(t.response_ids[:first_end], pads) == 0
        assert placeholder_count(t.response_ids[first_end:], pads) > 0
        # Model tokens carry their version, the others 0; observation tokens are masked out.
        assert {v for v, m in zip(t.versions, t.loss_mask) if m} == {3}
        assert all(v == 0 for v, m in zip(t.versions, t.loss_mask) if not m)
        assert sum(end - start for start, end in t.turns) == sum(t.loss_mask)

    gens = [t.to_generation(i) for i, t in enumerate(done)]
    columns = rollout_columns(gens, ["What is 3+4?"] * len(done), ["7"] * len(done), rollout.pad_token_id)
    columns[Column.media] = [dumps_context("What is 3+4?", t.all_media, tokens_given=True) for t in done]
    train = TrainBatch.from_columns(columns, [3] * len(done))
    for i, t in enumerate(done):
        real = train.attention_mask[i].bool()
        assert train.input_ids[i][real].tolist() == t.ids
        assert train.response_mask[i][real].tolist() == [0.0] * len(t.prompt_ids) + [float(m) for m in t.loss_mask]
        assert train.token_versions[i][real].tolist() == [0] * len(t.prompt_ids) + t.versions

    recomputed = trainer.compute_logprobs(train)
    mask = train.response_mask.bool()
    assert mask.sum() == sum(sum(t.loss_mask) for t in done)
    assert torch.allclose(recomputed[mask], train.rollout_logprobs[mask], atol=1e-4), \
        (recomputed[mask] - train.rollout_logprobs[mask]).abs().max()
