"""The OpenAI-compatible gateway: agent programs written against the real ``openai`` client drive
the policy over loopback, and their trajectories reach the trainer as the model read and wrote them.

The real ``hf`` rollout and ``torch`` trainer on the tiny omni model (a ChatML template, turns
ending in ``<|im_end|>``), the real batcher (``run_trajectories``). The agent programs are the
module-level functions below, referenced as ``tests.agents.test_gateway:<name>`` like a user's."""

from __future__ import annotations

import copy
import json
import threading
import time

import openai
import pytest
import torch

from relax.agents.gateway import ProgramDriver, ProgramError
from relax.agents.runner import AgentLimits, run_trajectories
from relax.algo.batch import TrainBatch
from relax.contracts import AgentTask
from relax.media import dumps_context
from relax.roles import Column
from relax.runtime.worker.rows import rollout_columns
from relax.spec.models import AgentSpec, GatewaySpec

FOLLOW_UP = "Are you sure?"

#: What each program saw, by trajectory id (the programs run on the gateway's trajectory threads).
SEEN: dict[str, dict] = {}
#: Released at the end of the error test, so the hanging program's thread ends.
RELEASE = threading.Event()


def _client(base_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def two_turns(task: AgentTask, base_url: str, api_key: str) -> float:
    """Ask, keep the reply as the client returned it, ask a follow-up, return a reward."""
    client = _client(base_url, api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    first = client.chat.completions.create(model="any-name", messages=messages, logprobs=True)
    messages += [first.choices[0].message, {"role": "user", "content": FOLLOW_UP}]
    second = client.chat.completions.create(model="any-name", messages=messages, logprobs=True, max_tokens=8)
    SEEN[task.trajectory_id] = {
        "logprobs": [[t.logprob for t in r.choices[0].logprobs.content] for r in (first, second)],
        "finish": [r.choices[0].finish_reason for r in (first, second)],
        "texts": [r.choices[0].message.content for r in (first, second)],
        "completion_tokens": [r.usage.completion_tokens for r in (first, second)],
    }
    return 0.25 * task.sample


def misbehaves(task: AgentTask, base_url: str, api_key: str) -> float | None:
    """Each label a way to get it wrong; the program's own failures end only its trajectory."""
    client = _client(base_url, api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    reply = client.chat.completions.create(model="m", messages=messages)
    seen = SEEN.setdefault(task.trajectory_id, {})
    if task.label == "raise":
        raise RuntimeError("the agent crashed")
    if task.label == "hang":
        RELEASE.wait(120)
        return 1.0
    if task.label == "turns":  # one call more than max_turns, without catching the refusal
        for _ in range(3):
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "again"}]
            reply = client.chat.completions.create(model="m", messages=messages)
        return 1.0
    if task.label == "edit":
        with pytest.raises(openai.AuthenticationError) as wrong:
            _client(base_url, "not-a-key").chat.completions.create(model="m", messages=messages)
        seen["401"] = (wrong.value.status_code, wrong.value.body)
        edited = [{"role": "user", "content": task.prompt + " (edited)"},
                  {"role": "assistant", "content": reply.choices[0].message.content},
                  {"role": "user", "content": "go on"}]
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="m", messages=edited)
        seen["edit"] = (bad.value.status_code, bad.value.body)
        image = [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
        with pytest.raises(openai.BadRequestError) as media:
            client.chat.completions.create(model="m", messages=image)
        seen["media"] = (media.value.status_code, media.value.body)
        return 1.0
    return None  # "ok": the reward plugins will score the final text


CALCULATOR = {"type": "function", "function": {
    "name": "multiply", "description": "multiplies two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def uses_a_tool(task: AgentTask, base_url: str, api_key: str) -> None:
    """Declare a tool, answer the model's call with a tool message, ask again."""
    client = _client(base_url, api_key)
    messages: list = [{"role": "user", "content": task.prompt}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    SEEN[task.trajectory_id] = {"first": first.choices[0], "second": second.choices[0]}
    return None


def _driver(program: str, backend, limits: AgentLimits) -> ProgramDriver:
    """The gateway with ``agent.history: strict`` (an edited history is refused; segments have
    tests of their own, ``test_gateway_segments.py``)."""
    agent = AgentSpec(gateway=GatewaySpec(program=f"tests.agents.test_gateway:{program}"),
                      max_turns=limits.max_turns, max_tokens=limits.max_tokens, history="strict")
    return ProgramDriver(agent, backend, limits, version=lambda: 5, max_prompt_tokens=128)


def _generate(rollout):
    sampling = rollout.context.sampling
    return lambda prompts, seed: rollout.generate_tokens(prompts, sampling, seed)


def test_a_two_turn_agent_program_through_the_openai_client_is_trained_on_its_exact_tokens(omni_backends):
    rollout, trainer = omni_backends
    limits = AgentLimits(max_turns=2, max_tokens=200, max_new_tokens=12, tool_timeout_s=60, concurrency=8)
    driver = _driver("two_turns", rollout, limits)
    tasks = [AgentTask(prompt=f"What is {j}+4?", label=str(j + 4), row={}, index=0, sample=j,
                       trajectory_id=f"two:{j}") for j in range(3)]
    try:
        batch = run_trajectories(tasks, driver, _generate(rollout), 11)
    finally:
        driver.close()

    trajectories = batch.trajectories
    tokenizer = rollout.tokenizer
    for task, t in zip(tasks, trajectories):
        assert t.error is None and not t.truncated, t.error
        assert t.agent_reward == 0.25 * task.sample
        assert len(t.turns) == 2
        seen = SEEN[task.trajectory_id]
        # The client received exactly the recorded tokens' log-probs, turn by turn (stop token included).
        for (start, end), received in zip(t.turns, seen["logprobs"]):
            assert received == pytest.approx(t.logprobs[start:end], abs=1e-6)
        assert seen["completion_tokens"] == [end - start for start, end in t.turns]
        assert seen["completion_tokens"][1] <= 8  # the request's max_tokens is a cap
        ended = t.response_ids[t.turns[0][1] - 1] in set(rollout.stop_token_ids)
        assert seen["finish"][0] == ("stop" if ended else "length")
        # The prompt is the first call's messages through the template; between the turns only the
        # follow-up's tokens (the rest of the turn's closing text first) are appended, never the
        # decoded first turn again.
        assert tokenizer.decode(t.prompt_ids, skip_special_tokens=False) == \
            f"<|im_start|>user\n{task.prompt}<|im_end|>\n<|im_start|>assistant\n"
        between = t.response_ids[t.turns[0][1]:t.turns[1][0]]
        closing = "\n" if seen["finish"][0] == "stop" else "<|im_end|>\n"
        assert tokenizer.decode(between, skip_special_tokens=False) == \
            f"{closing}<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
        assert t.final_text == seen["texts"][1]
        assert {v for v, m in zip(t.versions, t.loss_mask) if m} == {5}
        assert sum(t.loss_mask) == sum(end - start for start, end in t.turns)

    gens = [t.to_generation(i) for i, t in enumerate(trajectories)]
    columns = rollout_columns(gens, [task.prompt for task in tasks], [task.label for task in tasks],
                              rollout.pad_token_id)
    columns[Column.advantages] = torch.tensor([-1.0, 0.5, 1.0])
    # The omni trainer reads every row's media context; a text-only trajectory has no items.
    columns[Column.media] = [dumps_context(task.prompt, [], tokens_given=True) for task in tasks]
    train = TrainBatch.from_columns(columns, [5] * len(gens))
    for i, t in enumerate(trajectories):
        real = train.attention_mask[i].bool()
        assert train.input_ids[i][real].tolist() == t.ids
        assert train.response_mask[i][real].tolist() == [0.0] * len(t.prompt_ids) + [float(m) for m in t.loss_mask]

    mask = train.response_mask.bool()
    recomputed = trainer.compute_logprobs(train)
    assert torch.allclose(recomputed[mask], train.rollout_logprobs[mask], atol=1e-4), \
        (recomputed[mask] - train.rollout_logprobs[mask]).abs().max()
    weights, version = trainer.weights(), trainer.version
    optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    try:
        metrics = trainer.train_step(train)
        assert metrics["updates"] == 1.0 and metrics["tokens"] == mask.sum().item()
        after = trainer.compute_logprobs(train)
        assert not torch.allclose(after[mask], recomputed[mask])  # the trajectories were trained on
    finally:  # the session's trainer stays equal to the rollout's weights for the other tests
        trainer.load_weights(weights, version)
        trainer.optimizer.load_state_dict(optimizer)


def test_a_tool_call_reaches_the_program_in_openai_form_and_its_answer_is_appended(omni_backends):
    """The model's turns are scripted here (real tokenizer and template, the gateway and client for real):
    a hermes tool call, then an answer."""
    from relax.contracts import Generation

    rollout, _ = omni_backends
    tokenizer = rollout.tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    said = ['<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>', "It is 42."]

    def scripted(prompts, seed):
        out = []
        for i, prompt in enumerate(prompts):
            turn = tokenizer.decode(prompt.ids, skip_special_tokens=False).count("<|im_start|>assistant") - 1
            ids = tokenizer(said[turn], add_special_tokens=False)["input_ids"] + [im_end]
            out.append(Generation(prompt_index=i, prompt_ids=prompt.ids, response_ids=ids,
                                  logprobs=[-0.5] * len(ids), text=said[turn], finished=True))
        return out

    limits = AgentLimits(max_turns=2, max_tokens=300, max_new_tokens=100, tool_timeout_s=30, concurrency=8)
    driver = _driver("uses_a_tool", rollout, limits)
    task = AgentTask(prompt="What is 6*7?", label="42", row={}, index=0, sample=0, trajectory_id="tool:0")
    try:
        (t,) = run_trajectories([task], driver, scripted, 0).trajectories
    finally:
        driver.close()

    assert t.error is None, t.error
    first, second = SEEN["tool:0"]["first"], SEEN["tool:0"]["second"]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "multiply"
    assert json.loads(call.function.arguments) == {"a": 6, "b": 7}
    assert second.finish_reason == "stop" and second.message.content == "It is 42." and not second.message.tool_calls
    assert t.tool_calls == 1 and t.tool_errors == 0 and t.final_text == "It is 42."
    # The model's call stays as it wrote it in the tokens; the tool's answer follows as a tool message.
    assert tokenizer.decode(t.response_ids, skip_special_tokens=False) == (
        f"{said[0]}<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n{said[1]}<|im_end|>")


def test_a_program_that_errs_ends_only_its_own_trajectory(omni_backends):
    rollout, _ = omni_backends
    limits = AgentLimits(max_turns=2, max_tokens=200, max_new_tokens=12, tool_timeout_s=2, concurrency=8)
    driver = _driver("misbehaves", rollout, limits)
    labels = ["ok", "raise", "hang", "edit", "turns"]
    tasks = [AgentTask(prompt="What is 2+2?", label=label, row={}, index=0, sample=j, trajectory_id=f"bad:{label}")
             for j, label in enumerate(labels)]
    started = time.perf_counter()
    try:
        batch = run_trajectories(tasks, driver, _generate(rollout), 3)
    finally:
        RELEASE.set()
        driver.close()
    wall = time.perf_counter() - started
    by = dict(zip(labels, batch.trajectories))

    assert by["ok"].error is None and len(by["ok"].turns) == 1 and by["ok"].agent_reward is None
    assert by["raise"].error == \
        "agent program tests.agents.test_gateway:misbehaves: raised RuntimeError: the agent crashed"
    assert "ran past 6 s" in by["hang"].error and len(by["hang"].turns) == 1
    assert wall < 6 + 20  # the hanging program cost its own time limit, not the run
    # A call past max_turns is refused and the trajectory truncated (not failed); its two turns stand.
    assert by["turns"].truncated and by["turns"].error is None and len(by["turns"].turns) == 2
    for label in ("raise", "hang"):  # a failed trajectory keeps its tokens but teaches nothing
        assert sum(by[label].to_generation(0).loss_mask) == 0 and by[label].turns

    edit, seen = by["edit"], SEEN["bad:edit"]
    assert edit.error is None and edit.agent_reward == 1.0 and len(edit.turns) == 1
    status, body = seen["401"]
    assert status == 401 and body["code"] == "invalid_api_key" and "API key" in body["message"]
    status, body = seen["edit"]
    assert status == 400 and body["code"] == "history_edited"
    assert "message 0 differs" in body["message"] and "Relax trains on token sequences" in body["message"]
    status, body = seen["media"]
    assert status == 400 and "'image_url'" in body["message"] and "text only" in body["message"]
    # The refused calls appended nothing: the trajectory is its prompt and its one turn.
    assert edit.turns == [(0, len(edit.response_ids))]


def test_a_program_that_cannot_be_imported_or_called_is_named_in_the_error(omni_backends):
    rollout, _ = omni_backends
    limits = AgentLimits(max_turns=2, max_tokens=200, max_new_tokens=12, tool_timeout_s=2, concurrency=8)
    with pytest.raises(ProgramError, match="module 'tests.agents.no_such_module' cannot be imported"):
        ProgramDriver(AgentSpec(gateway=GatewaySpec(program="tests.agents.no_such_module:run")), rollout, limits,
                      version=lambda: 0)
    with pytest.raises(ProgramError, match="'FOLLOW_UP' is a str, not a callable"):
        _driver("FOLLOW_UP", rollout, limits)
