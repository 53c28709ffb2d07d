"""The gateway's APIs through the official clients: streamed chat completions, the Responses API
and Anthropic Messages drive a multi-turn, tool-using trajectory, and what the trainer trains on is
what the program read, token for token.

The model's turns are forced (``forced``): a scripted text per turn, its tokens scored by the tiny
omni policy itself (a teacher-forced forward), so each turn carries the policy's true log-probs and
the trainer's recomputation must match them, while the tool calls the programs see are known. The
gateway, the real ``openai`` and ``anthropic`` clients, the template and the trainer are real. The
programs are module-level functions, referenced as ``tests.agents.test_gateway_apis:<name>``."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch

from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.algo.batch import TrainBatch
from relax.contracts import AgentTask, Generation
from relax.media import dumps_context
from relax.roles import Column
from relax.runtime.worker.rows import rollout_columns
from relax.spec.models import AgentSpec, GatewaySpec
from tests.agents.client_loops import ANTHROPIC_TOOL, CHAT_TOOL, RESPONSES_TOOL, streamed_chat

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
SCRIPT = [CALL, "It is 42."]
#: What each program received, by trajectory id.
SEEN: dict[str, dict] = {}


def _openai(base_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def chat_program(task: AgentTask, base_url: str, api_key: str) -> None:
    """The usual tool loop of an OpenAI-client agent, streamed (label "stream") or not; the
    assistant message with tool calls is sent back with ``content: null``."""
    client, stream = _openai(base_url, api_key), task.label == "stream"
    messages: list = [{"role": "developer", "content": "Use the tools."}, {"role": "user", "content": task.prompt}]
    turns = []
    while True:
        turn = streamed_chat(client, messages, stream)
        turns.append(turn)
        if not turn["calls"]:
            break
        messages.append({"role": "assistant", "content": turn["content"], "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in turn["calls"]]})
        for call_id, _, arguments in turn["calls"]:
            args = json.loads(arguments)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": str(args["a"] * args["b"])})
        if not stream:  # a client that re-serializes its history: whitespace is not an edit
            messages[1] = {"role": "user", "content": f"  {task.prompt}\n"}
    SEEN[task.trajectory_id] = {"turns": turns}


ASYNC_CLIENTS: dict[str, openai.AsyncOpenAI] = {}
LOOPS: set[int] = set()


async def async_chat_program(task: AgentTask, base_url: str, api_key: str) -> None:
    """The tool loop as an ``async def`` program with one async client for all trajectories (they
    run on the gateway's one event loop)."""
    import asyncio

    LOOPS.add(id(asyncio.get_running_loop()))
    shared = ASYNC_CLIENTS.setdefault(base_url, openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0))
    client = shared.with_options(api_key=api_key)
    messages: list = [{"role": "developer", "content": "Use the tools."}, {"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    SEEN[task.trajectory_id] = {"answer": second.choices[0].message.content}


def responses_program(task: AgentTask, base_url: str, api_key: str) -> None:
    """The Responses API's tool loop with previous_response_id: the first call streamed, the second not."""
    client = _openai(base_url, api_key)
    include = ["message.output_text.logprobs"]
    events, first = [], None
    with client.responses.create(model="m", instructions="Use the tools.", input=task.prompt,
                                 tools=[RESPONSES_TOOL], stream=True, include=include) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "response.completed":
                first = event.response
    (call,) = [item for item in first.output if item.type == "function_call"]
    args = json.loads(call.arguments)
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[RESPONSES_TOOL],
                                     instructions="Use the tools.", include=include,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": str(args["a"] * args["b"])}])
    SEEN[task.trajectory_id] = {"events": events, "call": (call.name, args), "answer": second.output_text,
                                "logprobs": [t.logprob for t in second.output[0].content[0].logprobs]}


def messages_program(task: AgentTask, base_url: str, api_key: str) -> None:
    """The Anthropic tool loop: streamed tool_use, a tool_result block, then an unstreamed answer."""
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": task.prompt}]
    with client.messages.stream(model="m", max_tokens=64, system="Use the tools.", messages=messages,
                                tools=[ANTHROPIC_TOOL]) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    (use,) = [block for block in first.content if block.type == "tool_use"]
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": str(use.input["a"] * use.input["b"])}]}]
    second = client.messages.create(model="m", max_tokens=64, system="Use the tools.", messages=messages,
                                    tools=[ANTHROPIC_TOOL])
    SEEN[task.trajectory_id] = {"kinds": kinds, "stop": [first.stop_reason, second.stop_reason],
                                "call": (use.name, use.input), "answer": second.content[0].text,
                                "usage": [first.usage.output_tokens, second.usage.output_tokens]}


def forced(rollout, script: list[str]):
    """A generate function whose turn k is ``script[k]`` and ``<|im_end|>``, with the policy's own
    log-probs of those tokens (one forward over prompt and turn, at the run's temperature 1, over the
    tokens the rollout samples from)."""
    tokenizer = rollout.tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(prompts, seed):
        out = []
        for i, prompt in enumerate(prompts):
            turn = tokenizer.decode(prompt.ids, skip_special_tokens=False).count("<|im_start|>assistant") - 1
            ids = tokenizer(script[turn], add_special_tokens=False)["input_ids"] + [im_end]
            with torch.no_grad():
                logits = rollout.model(input_ids=torch.tensor([prompt.ids + ids])).logits[0].float()
            logits[:, rollout.suppressed] = float("-inf")  # the media placeholders are never sampled
            logp = torch.log_softmax(logits[len(prompt.ids) - 1:-1], dim=-1)
            chosen = logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()
            out.append(Generation(prompt_index=i, prompt_ids=prompt.ids, response_ids=ids, logprobs=chosen,
                                  text=script[turn], finished=True))
        return out

    return generate


def _run(rollout, program: str, labels: list[str]):
    limits = AgentLimits(max_turns=3, max_tokens=400, max_new_tokens=100, tool_timeout_s=60, concurrency=8)
    agent = AgentSpec(gateway=GatewaySpec(program=f"tests.agents.test_gateway_apis:{program}"),
                      max_turns=limits.max_turns, max_tokens=limits.max_tokens)
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 3, max_prompt_tokens=128)
    tasks = [AgentTask(prompt="What is 6*7?", label=label, row={}, index=0, sample=j,
                       trajectory_id=f"{program}:{label}") for j, label in enumerate(labels)]
    try:
        batch = run_trajectories(tasks, driver, forced(rollout, SCRIPT), 0)
    finally:
        driver.close()
    for t in batch.trajectories:
        assert t.error is None, t.error
        assert len(t.turns) == 2 and t.tool_calls == 1 and t.final_text == SCRIPT[1]
    return tasks, batch.trajectories


def _trained_on(trainer, tasks, trajectories) -> TrainBatch:
    """The trajectories as the trainer's batch; its recomputed log-probs equal the recorded ones."""
    gens = [t.to_generation(i) for i, t in enumerate(trajectories)]
    columns = rollout_columns(gens, [task.prompt for task in tasks], [task.label for task in tasks], 0)
    columns[Column.advantages] = torch.ones(len(gens))
    columns[Column.media] = [dumps_context(task.prompt, [], tokens_given=True) for task in tasks]
    train = TrainBatch.from_columns(columns, [3] * len(gens))
    for i, t in enumerate(trajectories):
        real = train.attention_mask[i].bool()
        assert train.input_ids[i][real].tolist() == t.ids
    mask = train.response_mask.bool()
    recomputed = trainer.compute_logprobs(train)
    assert torch.allclose(recomputed[mask], train.rollout_logprobs[mask], atol=1e-4)
    return train


def test_streamed_chat_completions_drive_a_tool_loop_with_the_tokens_of_an_unstreamed_one(omni_backends):
    rollout, trainer = omni_backends
    tasks, (plain, streamed) = _run(rollout, "chat_program", ["plain", "stream"])
    assert streamed.ids == plain.ids and streamed.loss_mask == plain.loss_mask
    assert streamed.logprobs == pytest.approx(plain.logprobs)
    # The developer message is rendered as one (this ChatML template renders any role).
    prompt = rollout.tokenizer.decode(streamed.prompt_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>developer\nUse the tools.<|im_end|>\n")
    seen = {label: SEEN[f"chat_program:{label}"]["turns"] for label in ("plain", "stream")}
    for label, t in (("plain", plain), ("stream", streamed)):
        first, second = seen[label]
        assert first["content"] is None and first["finish"] == "tool_calls"
        assert [(name, json.loads(args)) for _, name, args in first["calls"]] == [("multiply", {"a": 6, "b": 7})]
        assert first["calls"][0][0].startswith("call_")
        assert second == {**second, "content": SCRIPT[1], "calls": [], "finish": "stop"}
        # What the program read, token for token, is what was recorded (log-probs and counts).
        for (start, end), turn in zip(t.turns, (first, second)):
            assert turn["logprobs"] == pytest.approx(t.logprobs[start:end], abs=1e-6)
            assert turn["usage"] == end - start
    _trained_on(trainer, tasks, [plain, streamed])


def test_the_responses_api_with_previous_response_id_and_streamed_events(omni_backends):
    rollout, trainer = omni_backends
    tasks, (t,) = _run(rollout, "responses_program", ["r"])
    seen = SEEN["responses_program:r"]
    assert seen["call"] == ("multiply", {"a": 6, "b": 7}) and seen["answer"] == SCRIPT[1]
    assert seen["events"][:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.done" in seen["events"] and seen["events"][-1] == "response.completed"
    start, end = t.turns[1]
    assert seen["logprobs"] == pytest.approx(t.logprobs[start:end], abs=1e-6)  # the stop token too
    text = rollout.tokenizer.decode(t.ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nUse the tools.<|im_end|>\n<|im_start|>user\nWhat is 6*7?")
    assert text.endswith(f"{CALL}<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
                         f"{SCRIPT[1]}<|im_end|>")
    _trained_on(trainer, tasks, [t])


def test_anthropic_messages_with_tool_use_and_tool_result_blocks(omni_backends):
    rollout, trainer = omni_backends
    tasks, (t,) = _run(rollout, "messages_program", ["m"])
    seen = SEEN["messages_program:m"]
    assert seen["call"] == ("multiply", {"a": 6, "b": 7}) and seen["answer"] == SCRIPT[1]
    assert seen["stop"] == ["tool_use", "end_turn"]
    assert seen["kinds"][0] == "message_start" and seen["kinds"][-1] == "message_stop"
    assert seen["usage"] == [end - start for start, end in t.turns]
    text = rollout.tokenizer.decode(t.ids, skip_special_tokens=False)
    assert text.endswith(f"{CALL}<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
                         f"{SCRIPT[1]}<|im_end|>")
    _trained_on(trainer, tasks, [t])


def test_async_programs_share_one_event_loop_and_one_client(omni_backends):
    rollout, _ = omni_backends
    LOOPS.clear()
    _, sync = _run(rollout, "chat_program", ["stream"])
    _, trajectories = _run(rollout, "async_chat_program", ["a", "b", "c"])
    assert len(LOOPS) == 1 and len(ASYNC_CLIENTS) == 1
    for label, t in zip("abc", trajectories):
        assert SEEN[f"async_chat_program:{label}"]["answer"] == SCRIPT[1]
        assert t.ids == sync[0].ids  # the same conversation, the same tokens
