"""Constrained decoding through the gateway: ``tool_choice`` and ``response_format`` are enforced
by a grammar on the real ``hf`` rollout (tiny omni model, llguidance), asked for with the official
``openai`` client, and the behaviour log-probs recorded are those of the masked distribution the
sampler drew from.

The default suite runs 12 calls of each kind (about 10 s); the ``constrained`` lane (``nox -s
constrained``, about 70 s) runs 100 each."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from relax.agents.constraints import Choice, grammar
from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.agents.wire_formats import GatewayError
from relax.contracts import AgentTask, ToolSpec
from relax.spec.models import AgentSpec, GatewaySpec

WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time in a zone.", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["zone"],
    "additionalProperties": False}}}
VERDICT = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                            "score": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["answer", "score"], "additionalProperties": False}

#: The reply each trajectory's program got, by trajectory id.
REPLIES: dict[str, dict] = {}


def asks(task: AgentTask, base_url: str, api_key: str) -> None:
    """One call asking for what ``task.label`` names; keeps the reply as the client parsed it."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": task.prompt}]
    extra: dict = {
        "required": dict(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False),
        "named": dict(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "clock"}},
                      parallel_tool_calls=False),
        "json_schema": dict(response_format={"type": "json_schema",
                                             "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}),
        "none": dict(tools=[WEATHER, CLOCK], tool_choice="none"),
    }[task.label]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=task.row.get("max_tokens", 96),
                                           logprobs=True, **extra)
    choice = reply.choices[0]
    REPLIES[task.trajectory_id] = {
        "finish": choice.finish_reason, "content": choice.message.content,
        "calls": [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []],
        "logprobs": [t.logprob for t in choice.logprobs.content]}


def _run(rollout, kinds: dict[str, int], seed: int = 5):
    limits = AgentLimits(max_turns=1, max_tokens=200, max_new_tokens=96, tool_timeout_s=300,
                         concurrency=sum(kinds.values()))
    agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_constraints:asks"),
                      max_turns=1, max_tokens=200)
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 0, max_prompt_tokens=128)
    tasks = [AgentTask(prompt="What now?", label=kind, row={}, index=0, sample=j, trajectory_id=f"{kind}:{j}")
             for kind, count in kinds.items() for j in range(count)]
    sampling = rollout.context.sampling
    try:
        batch = run_trajectories(tasks, driver, lambda prompts, s: rollout.generate_tokens(prompts, sampling, s), seed)
    finally:
        driver.close()
    return {task.trajectory_id: t for task, t in zip(tasks, batch.trajectories)}


def test_tool_choice_and_response_format_always_hold(omni_backends):
    _always_hold(omni_backends[0], 12)


@pytest.mark.constrained
def test_tool_choice_and_response_format_hold_in_100_calls_each(omni_backends):
    _always_hold(omni_backends[0], 100)


def _always_hold(rollout, calls: int) -> None:
    """``calls`` calls each of required, named and json_schema (and 4 of none), all in one batch."""
    REPLIES.clear()
    trajectories = _run(rollout, {"required": calls, "named": calls, "json_schema": calls, "none": 4})
    assert all(t.error is None for t in trajectories.values()), [t.error for t in trajectories.values() if t.error]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
    names = {"required": set(), "named": set()}
    for key, reply in REPLIES.items():
        kind = key.split(":")[0]
        if kind in names:
            assert reply["finish"] == "tool_calls" and len(reply["calls"]) == 1, reply
            (name, arguments), = reply["calls"]
            jsonschema.validate(arguments, schemas[name])
            names[kind].add(name)
        elif kind == "json_schema":
            assert reply["finish"] == "stop" and not reply["calls"], reply
            jsonschema.validate(json.loads(reply["content"]), VERDICT)
        else:
            assert not reply["calls"] and "<tool_call>" not in (reply["content"] or ""), reply
    assert names["named"] == {"clock"}
    assert names["required"] <= {"weather", "clock"} and names["required"]
    assert len(REPLIES) == 3 * calls + 4


def test_the_recorded_log_probs_are_those_of_the_masked_distribution_sampled_from(omni_backends):
    """Replaying the grammar over the recorded tokens and masking the model's own logits gives the
    recorded behaviour log-probs; the unmasked model gives others (the trainer's, which the
    importance ratio corrects: docs/agents.md)."""
    from relax_plugins.rollout.grammars import RowGrammars

    rollout, _ = omni_backends
    REPLIES.clear()
    trajectories = _run(rollout, {"json_schema": 2, "named": 2}, seed=9)
    tools = [ToolSpec(name=t["function"]["name"], description="", parameters=t["function"]["parameters"])
             for t in (WEATHER, CLOCK)]
    texts = {"json_schema": grammar(Choice(), VERDICT, [], "hermes", "hf", rollout.tokenizer),
             "named": grammar(Choice("named", "clock", False), None, tools, "hermes", "hf", rollout.tokenizer)}
    model = rollout.model
    differs = 0.0
    for key, traj in trajectories.items():
        prompt, response = traj.prompt_ids, traj.response_ids
        assert REPLIES[key]["logprobs"] == pytest.approx(traj.logprobs, abs=1e-6)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
        rows = RowGrammars(rollout._grammar_tokenizer, [texts[key.split(":")[0]]])
        masked = []
        for step, token in enumerate(response):
            masked.append(rows.restrict(logits[step:step + 1], [True])[0])
            rows.advance([token], [True])
        masked_lp = torch.log_softmax(torch.stack(masked), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        plain_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        recorded = torch.tensor(traj.logprobs)
        assert torch.allclose(masked_lp, recorded, atol=2e-3), (masked_lp - recorded).abs().max()
        differs = max(differs, float((plain_lp - recorded).abs().max()))
    assert differs > 0.1  # the mask is in effect: the unmasked model's log-probs are not the recorded ones


def test_what_a_grammar_cannot_express_is_refused_naming_the_parameter_format_and_backend(omni_backends):
    rollout, _ = omni_backends
    tool = ToolSpec(name="f", description="", parameters={"type": "object", "properties": {}})
    with pytest.raises(GatewayError) as bad:
        grammar(Choice("required"), None, [tool], "qwen3_coder", "hf", rollout.tokenizer)
    assert bad.value.status == 400 and bad.value.param == "tool_choice"
    assert "'qwen3_coder'" in bad.value.message and "'hf'" in bad.value.message
    with pytest.raises(GatewayError) as bad:
        grammar(Choice("named", "g"), None, [tool], "hermes", "hf", rollout.tokenizer)
    assert bad.value.param == "tool_choice" and "'g'" in bad.value.message
    with pytest.raises(GatewayError) as bad:
        grammar(Choice(), {"type": "object", "properties": {"a": {"type": "nonsense"}}}, [], "hermes", "hf",
                rollout.tokenizer)
    assert bad.value.param == "response_format" and "llguidance" in bad.value.message
    # none on a format that opens calls with <tool_call> is a grammar; auto without a format is none
    assert grammar(Choice("none"), None, [tool], "glm", "hf", rollout.tokenizer) is not None
    assert grammar(Choice(), None, [tool], "qwen3_coder", "hf", rollout.tokenizer) is None
