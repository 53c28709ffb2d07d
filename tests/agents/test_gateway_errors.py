"""The gateway refuses clearly: every refusal has the API's error shape and a 4xx status, and no
malformed body on any route gets a 500 (a derandomized hypothesis fuzz over all four routes).

Live trajectories behind the real gateway and real HTTP, the tiny omni tokenizer and template; the
model's turns are scripted (what the model says does not matter to a refusal)."""

from __future__ import annotations

import copy
import itertools
import json
import queue
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.agents.gateway import ProgramDriver
from relax.agents.runner import AgentLimits, run_trajectories
from relax.contracts import AgentTask, Generation
from relax.spec.models import AgentSpec, GatewaySpec

KEYS: queue.Queue = queue.Queue()
#: Set when a test is done with its trajectories: their programs return.
DONE = threading.Event()
ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"]


def holds_its_key(task: AgentTask, base_url: str, api_key: str) -> None:
    """Hand the trajectory's key and URL to the test and wait; the test makes the calls."""
    KEYS.put((base_url, api_key))
    DONE.wait(300)


def _scripted(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(prompts, seed):
        ids = tokenizer("ok", add_special_tokens=False)["input_ids"] + [im_end]
        return [Generation(prompt_index=i, prompt_ids=p.ids, response_ids=ids, logprobs=[-0.5] * len(ids),
                           text="ok", finished=True) for i, p in enumerate(prompts)]

    return generate


class _Live:
    """``count`` trajectories held open while a test calls the gateway with their keys."""

    def __init__(self, backend, count: int, max_turns: int = 1000) -> None:
        limits = AgentLimits(max_turns=max_turns, max_tokens=100_000, max_new_tokens=8, tool_timeout_s=300,
                             concurrency=count)
        agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_errors:holds_its_key"),
                          max_turns=max_turns, max_tokens=limits.max_tokens)
        self.driver = ProgramDriver(agent, backend, limits, version=lambda: 0, max_prompt_tokens=128)
        tasks = [AgentTask(prompt="hi", label="", row={}, index=0, sample=j, trajectory_id=f"live:{j}")
                 for j in range(count)]
        DONE.clear()
        self.result: dict = {}
        self.thread = threading.Thread(target=lambda: self.result.update(
            batch=run_trajectories(tasks, self.driver, _scripted(backend.tokenizer), 0)), daemon=True)
        self.thread.start()
        self.keys = [KEYS.get(timeout=60) for _ in range(count)]

    def close(self) -> None:
        DONE.set()
        self.thread.join(60)
        self.driver.close()


@pytest.fixture
def live(omni_backends):
    rollout, _ = omni_backends
    lives: list[_Live] = []

    def start(count: int = 1, backend=None, max_turns: int = 1000) -> _Live:
        lives.append(_Live(backend or rollout, count, max_turns))
        return lives[-1]

    yield start
    for one in lives:
        one.close()


def _assert_shaped(route: str, status: int, body: dict) -> None:
    assert 400 <= status < 500, (status, body)
    if route == "/v1/messages":
        assert body["type"] == "error" and isinstance(body["error"]["message"], str) and body["error"]["type"]
    else:
        assert isinstance(body["error"]["message"], str) and body["error"]["type"]


class NoGrammarRollout:
    """A rollout backend without constrained decoding (``constrained_decoding`` unset)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


def test_parameters_the_backend_cannot_enforce_are_refused_naming_the_parameter_and_backend(live, omni_backends):
    rollout, _ = omni_backends
    (base_url, key), = live(backend=NoGrammarRollout(rollout.tokenizer)).keys
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    hello = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    refused = [dict(tool_choice="required", tools=[tool]),
               dict(tool_choice={"type": "function", "function": {"name": "f"}}, tools=[tool]),
               dict(tool_choice="none", tools=[tool]),
               dict(response_format={"type": "json_object"}),
               dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})]
    for extra in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="m", messages=hello, **extra)
        param = next(iter(k for k in extra if k != "tools"))
        error = bad.value.body
        assert error["param"] == param and error["code"] == "unsupported_parameter"
        assert "rollout backend 'test_gateway_errors'" in error["message"]
        assert "constrained decoding" in error["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="m", input="hi", text={"format": {"type": "json_object"}})
    assert bad.value.body["param"] == "text.format"
    # tool_choice "auto" (or none without tools) and a text response_format ask for nothing to enforce: served.
    reply = client.chat.completions.create(model="m", messages=hello, tools=[tool], tool_choice="auto",
                                           response_format={"type": "text"})
    assert reply.choices[0].message.content == "ok"
    # A tool_choice the gateway cannot read is the request's error, whatever the backend.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=hello, tools=[tool], tool_choice="sometimes")
    assert bad.value.body["param"] == "tool_choice" and '"required"' in bad.value.body["message"]


def test_a_developer_message_on_a_template_without_that_role_is_rendered_as_system(live, omni_backends):
    """The tiny-lm template raises on any role but system, user, assistant and tool."""
    from relax_plugins.models.tiny_lm import CHAT_TEMPLATE

    rollout, _ = omni_backends
    tokenizer = copy.deepcopy(rollout.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    one = live(backend=SimpleNamespace(tokenizer=tokenizer))
    (base_url, key), = one.keys
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "developer", "content": "Be brief."},
                                                        {"role": "user", "content": "hi"}])
    one.close()
    (t,) = one.result["batch"].trajectories
    assert tokenizer.decode(t.prompt_ids, skip_special_tokens=False) == "S:Be brief.\nU:hi\nA:"


def test_refusals_have_the_api_error_shape(live):
    (base_url, key), = live().keys
    with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=30) as http:
        for route in ROUTES:
            reply = http.post(route, headers={"x-api-key": "wrong"}, json={})
            _assert_shaped(route, reply.status_code, reply.json())
            assert reply.status_code == 401
            reply = http.post(route, headers={"Authorization": f"Bearer {key}"}, content=b"{not json")
            _assert_shaped(route, reply.status_code, reply.json())
        reply = http.post("/v1/nothing", headers={"Authorization": f"Bearer {key}"}, json={})
        assert reply.status_code == 404 and "/v1/responses" in reply.json()["error"]["message"]
        reply = http.post("/v1/messages", headers={"x-api-key": key}, json={"messages": [
            {"role": "user", "content": "hi"}]})
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("max_tokens")


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False, width=16)
                     | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3), max_leaves=8)
_TEXT = st.one_of(st.text(max_size=8), st.none(), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "output_text", "image_url", "tool_result", "tool_use"])},
    optional={"text": _JSON, "content": _JSON, "id": _JSON, "name": _JSON, "input": _JSON,
              "tool_use_id": _JSON}), max_size=3), _JSON)
_CALL = st.fixed_dictionaries({}, optional={"id": _JSON, "type": _JSON, "function": st.fixed_dictionaries(
    {}, optional={"name": st.text(max_size=4) | _JSON, "arguments": st.sampled_from(["{}", '{"a": 1}', "[1]", "{"])
                  | _JSON})})
_MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "other"]) | _JSON,
    "content": _TEXT, "tool_calls": st.lists(_CALL, max_size=2) | _JSON, "tool_call_id": _JSON, "name": _JSON})
_TOOL = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["function", "custom", "web_search"]) | _JSON, "name": st.text(max_size=4) | _JSON,
    "function": st.fixed_dictionaries({}, optional={"name": st.text(max_size=4), "parameters": _JSON}),
    "parameters": _JSON, "input_schema": _JSON, "description": _JSON})
_ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "other"]),
    "role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _TEXT, "name": _JSON,
    "call_id": st.text(max_size=4) | _JSON, "arguments": _JSON, "output": _TEXT})
_BODY = st.fixed_dictionaries({}, optional={
    "model": _JSON, "messages": st.lists(_MESSAGE, max_size=4) | _JSON, "input": st.lists(_ITEM, max_size=3) | _TEXT,
    "prompt": st.text(max_size=8) | _JSON, "tools": st.lists(_TOOL, max_size=2) | _JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | _JSON, "response_format": _JSON,
    "stream": st.booleans() | _JSON, "stream_options": _JSON, "max_tokens": st.integers(-2, 40) | _JSON,
    "max_output_tokens": _JSON, "max_completion_tokens": _JSON, "logprobs": _JSON, "n": _JSON,
    "previous_response_id": _JSON, "instructions": _TEXT, "system": _TEXT, "include": _JSON, "text": _JSON,
    "echo": _JSON, "suffix": _JSON, "best_of": _JSON})


_PLAIN = st.sampled_from(["user", "assistant", "tool", "system"])
_NEAR = {
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": _PLAIN, "content": st.text(max_size=8)}), min_size=1, max_size=3) | st.lists(_MESSAGE, max_size=3)}),
    "/v1/responses": st.fixed_dictionaries({"input": st.text(min_size=1, max_size=8) | st.lists(_ITEM, max_size=3)}),
    "/v1/messages": st.fixed_dictionaries({"max_tokens": st.integers(1, 8), "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": _TEXT}),
        min_size=1, max_size=3)}),
    "/v1/completions": st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=8)}),
}
#: The statuses the fuzz got (it must reach the model too, not only the first checks).
STATUSES: list[int] = []


@st.composite
def _request(draw):
    """A route and a body: any JSON, or a body of every API's fields, or one near the route's own
    shape with fuzzed fields on top."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["json", "fields", "near", "near"]))
    if kind == "json":
        return route, draw(_JSON)
    if kind == "fields":
        return route, draw(_BODY)
    extra = draw(_BODY)
    for name in ("messages", "input", "prompt", "max_tokens") if draw(st.booleans()) else ():
        extra.pop(name, None)
    return route, {**extra, **draw(_NEAR[route])}


def test_malformed_bodies_on_every_route_get_a_4xx_never_a_500(live):
    keys = itertools.cycle(live(count=12).keys)

    @settings(max_examples=100, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(request=_request(), raw=st.none() | st.none() | st.binary(max_size=12))
    def one_request(request, raw):
        route, body = request
        base_url, key = next(keys)
        content = raw if raw is not None else json.dumps(body).encode()
        with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=30) as http:
            reply = http.post(route, headers={"Authorization": f"Bearer {key}", "x-api-key": key}, content=content)
        STATUSES.append(reply.status_code)
        if reply.status_code == 200:
            assert isinstance(body, dict) and raw is None
            if reply.headers["content-type"].startswith("text/event-stream"):
                assert reply.text.startswith(("data: ", "event: "))
            else:
                assert reply.json()
            return
        _assert_shaped(route, reply.status_code, reply.json())

    one_request()
    assert STATUSES.count(200) >= 10 and len(set(STATUSES)) > 1, sorted(set(STATUSES))
