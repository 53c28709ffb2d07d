"""The calculator environment, the products data set, and the tiny model built for them
(``presets/tiny-agent-cpu.yaml``): its chat template, its token layout and its warm-up."""

from __future__ import annotations

import json
import random
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from relax.agents.chat import ChatTokens
from relax.agents.tool_calls import parse_tool_calls
from relax.contracts import AgentTask, Observation, PluginKind, ToolCall, Turn
from relax.registry import PluginEntry, check_contract
from relax_plugins.datasets.products import ProductsDataset
from relax_plugins.environments.calculator import CalculatorEnvironment
from relax_plugins.environments.tools import ToolError
from relax_plugins.models.tiny_lm import TOOL_CALL, TinyLM
from relax.config.loader import PRESETS_DIR

ROOT = Path(__file__).resolve().parents[2]
PRESET = PRESETS_DIR / "tiny-agent-cpu.yaml"


def _calculator(**options) -> CalculatorEnvironment:
    return CalculatorEnvironment(CalculatorEnvironment.Config(**options))


def _turn(*exprs: str, index: int = 0) -> Turn:
    calls = [ToolCall(name="calc", arguments={"expr": e}, id=f"call_{i}") for i, e in enumerate(exprs)]
    return Turn(index=index, text="".join(TOOL_CALL.format(expr=e) for e in exprs), tool_calls=calls, finished=True)


def _task(prompt: str = "347*58=", answer: str = "20126") -> AgentTask:
    return AgentTask(prompt=prompt, label=answer, row={"prompt": prompt, "answer": answer}, index=0, sample=0,
                     trajectory_id="t0")


# -- the calculator -------------------------------------------------------------------------------


def test_calculator_is_registered_and_matches_the_contract():
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = entry_points["relax.environments"]["calculator"]
    assert target == "relax_plugins.environments.calculator:CalculatorEnvironment"
    assert entry_points["relax.datasets"]["synthetic:products"] == "relax_plugins.datasets.products:ProductsDataset"
    entry = PluginEntry(PluginKind.environments, "calculator", target, "relax", "test")
    check_contract(PluginKind.environments, entry, CalculatorEnvironment)  # raises when a hook does not fit


def test_calculator_declares_one_tool_with_a_schema():
    [tool] = _calculator().tools()
    assert tool.name == "calc" and tool.description
    assert tool.parameters["required"] == ["expr"]
    assert tool.parameters["properties"]["expr"]["type"] == "string"
    openai = tool.to_openai()
    assert openai["type"] == "function" and openai["function"]["name"] == "calc"
    # The runtime's parser reads the warm-up's call and refuses one the schema does not allow.
    parsed = parse_tool_calls(TOOL_CALL.format(expr="347*58"), [tool])
    assert parsed.calls == [ToolCall(name="calc", arguments={"expr": "347*58"}, id="call_0")] and not parsed.errors
    wrong = parse_tool_calls('<tool_call>{"name":"calc","arguments":{"expr":3}}</tool_call>', [tool])
    assert not wrong.calls and "must be string" in wrong.errors[0]
    extra = parse_tool_calls('<tool_call>{"name":"calc","arguments":{"expr":"1","x":1}}</tool_call>', [tool])
    assert not extra.calls and "takes no argument" in extra.errors[0]


@pytest.mark.parametrize(("expr", "value"), [
    ("347*58", "20126"), (" (1+2)*3.5 ", "10.5"), ("7/2", "3.5"), ("10/4", "2.5"), ("1/3", "0.333333"),
    ("2**10", "1024"), ("2**-2", "0.25"), ("-(3-5)", "2"), ("0.1+0.2", "0.3"), ("6/3", "2"), ("-1e-9", "0"),
    ("123456789*987654321", "121932631112635269"),
])
def test_calculator_evaluates_exactly(expr, value):
    assert _calculator().evaluate(expr) == value


@pytest.mark.parametrize(("expr", "reason"), [
    ("__import__('os').system('true')", "not allowed"),
    ("().__class__", "not allowed"),
    ("abs(-1)", "not allowed"),
    ("x+1", "not allowed"),
    ("'a'*3", "not a number"),
    ("True+1", "not a number"),
    ("3%2", "operator Mod is not allowed"),
    ("1<2", "not allowed"),
    ("9**9**9", "exponent"),
    ("2**1000", "exponent"),
    ("2**0.5", "whole number"),
    ("10**60*10**10", "digits"),
    ("1e300*1e300", "digits"),
    ("1/0", "division by zero"),
    ("0**-1", "division by zero"),
    ("1+", "cannot parse"),
    ("", "empty"),
    ("1+" * 150 + "1", "characters"),
])
def test_calculator_refuses_what_it_must_not_evaluate(expr, reason):
    with pytest.raises(ToolError, match=reason):
        _calculator(max_expression_chars=200).evaluate(expr)


@pytest.mark.parametrize("expr", ["(" * 300 + "1" + ")" * 300, "-" * 5000 + "1", "+".join(["1"] * 3000)])
def test_deep_expressions_are_refused_not_crashed(expr):
    env = _calculator(max_expression_chars=10_000)
    try:
        assert env.evaluate(expr) in ("1", "-1", "3000")
    except ToolError as exc:
        assert "nested" in str(exc) or "cannot parse" in str(exc)


def test_bounds_are_options():
    assert _calculator(max_exponent=2000, max_result_digits=400).evaluate("2**1000").startswith("10715086")
    with pytest.raises(ToolError, match="characters"):
        _calculator(max_expression_chars=5).evaluate("347*58")
    assert _calculator(decimals=2).evaluate("2/3") == "0.67"
    with pytest.raises(ValueError, match="max_expression_chars"):
        CalculatorEnvironment.Config(max_expression_chars=0)


def test_a_turn_gives_one_observation_and_errors_are_text():
    env = _calculator()
    state = env.start(_task())
    observation = env.step(state, _turn("347*58", "1/0", "2+"))
    assert isinstance(observation, Observation) and not observation.done and observation.role == "tool"
    lines = observation.content.split("\n")
    assert lines[0] == "20126"
    assert lines[1] == "error: division by zero"
    assert lines[2].startswith("error: cannot parse")
    assert observation.info == {"tool": "calc", "tool_calls": 3, "tool_errors": 2}
    assert state["calls"] == 3


def test_calls_past_the_turn_limit_are_not_run():
    env = _calculator(max_calls_per_turn=1)
    observation = env.step(env.start(_task()), _turn("1+1", "2+2"))
    assert observation.content.split("\n") == ["2", "error: at most 1 tool calls per turn; this one was not run"]
    assert observation.info["tool_errors"] == 1


def test_arguments_the_tool_does_not_take_are_an_error_observation():
    env = _calculator()
    turn = Turn(0, "", [ToolCall(name="calc", arguments={"expr": "1", "base": 2})], True)
    observation = env.step(env.start(_task()), turn)
    assert observation.content.startswith("error: bad arguments for calc") and observation.info["tool_errors"] == 1


def test_a_turn_without_calls_ends_the_trajectory():
    env = _calculator()
    state = env.start(_task())
    observation = env.step(state, Turn(index=1, text="20126", tool_calls=[], finished=True))
    assert observation.done and observation.content == ""
    cut = env.step(state, Turn(index=0, text="<tool_call>{", tool_calls=[], finished=False))
    assert cut.done


def test_trajectories_step_concurrently():
    env = _calculator()
    rng = random.Random(0)
    problems = [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(400)]

    def trajectory(problem):
        a, b = problem
        state = env.start(_task(f"{a}*{b}=", str(a * b)))
        first = env.step(state, _turn(f"{a}*{b}", f"{a}+{b}"))
        last = env.step(state, Turn(index=1, text=first.content.split("\n")[0], tool_calls=[], finished=True))
        return first.content, last.done, state["calls"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(trajectory, problems))
    assert results == [(f"{a * b}\n{a + b}", True, 2) for a, b in problems]


# -- the data set ---------------------------------------------------------------------------------


def test_products_are_deterministic_and_correct():
    data = ProductsDataset(ProductsDataset.Config(size=64, seed=3))
    again = ProductsDataset(ProductsDataset.Config(size=64, seed=3))
    other = ProductsDataset(ProductsDataset.Config(size=64, seed=4))
    items = [data[i] for i in range(64)]
    assert items == [again[i] for i in range(64)]
    assert items != [other[i] for i in range(64)]
    assert len(data) == 64 and data[-1] == data[63] and ProductsDataset.columns == ("prompt", "answer")
    for item in items:
        left, right = item["prompt"].removesuffix("=").split("*")
        assert item["prompt"].endswith("=") and len(left) == 3 and len(right) == 2
        assert int(item["answer"]) == int(left) * int(right)
    with pytest.raises(IndexError):
        data[64]
    mixed = ProductsDataset(ProductsDataset.Config(size=200, left_digits=[2, 4], right_digits=[1]))
    lengths = {len(mixed[i]["prompt"].split("*")[0]) for i in range(200)}
    assert lengths == {2, 4}
    with pytest.raises(ValueError, match="between 1 and 9"):
        ProductsDataset.Config(left_digits=[0])


# -- the tiny model of the task -------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_model() -> Path:
    """The tiny model exactly as the preset builds it (about half a minute on one core)."""
    options = yaml.safe_load(PRESET.read_text())["model"]["options"]
    assert options["task"] == "calculator"
    model = TinyLM(TinyLM.Config(**options))
    # The runtime's cache: a run of the preset (tests/runtime/test_agent_run.py) finds it built.
    from relax.runtime.model_files import cache_dir

    return Path(model.materialize(cache_dir()))


@pytest.fixture(scope="module")
def agent_tokenizer(agent_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(agent_model)


def test_template_renders_compact_messages(agent_tokenizer):
    tools = [t.to_openai() for t in _calculator().tools()]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "347*58="},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expr": "347*58"}}}]},
        {"role": "tool", "name": "calc", "content": "20126"},
        {"role": "assistant", "content": [{"type": "text", "text": "20126"}]},
    ]
    text = agent_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == ("T:calc\nS:be brief\nU:347*58=\nA:" + TOOL_CALL.format(expr="347*58") + "<eos>R:20126\nA:20126<eos>")
    # A call given with its arguments as a JSON string (the OpenAI wire form) renders the same.
    messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"expr": "347*58"}, separators=(",", ":"))
    assert agent_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == text
    prompt = agent_tokenizer.apply_chat_template(messages[1:2], tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt == "T:calc\nU:347*58=\nA:"
    with pytest.raises(Exception, match="no chat role"):
        agent_tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_template_only_appends(agent_tokenizer):
    tools = [t.to_openai() for t in _calculator().tools()]
    conversation = [
        {"role": "user", "content": "12*34="},
        {"role": "assistant", "content": TOOL_CALL.format(expr="12*34")},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "checking"},
        {"role": "user", "content": "sure?"},
        {"role": "assistant", "content": "408"},
    ]
    for size in range(1, len(conversation)):
        before = agent_tokenizer.apply_chat_template(conversation[:size], tools=tools, tokenize=False)
        with_prompt = agent_tokenizer.apply_chat_template(conversation[:size], tools=tools, tokenize=False,
                                                          add_generation_prompt=True)
        after = agent_tokenizer.apply_chat_template(conversation[:size + 1], tools=tools, tokenize=False)
        assert after.startswith(before) and with_prompt.startswith(before)
        if conversation[size]["role"] == "assistant":
            assert after.startswith(with_prompt)


def test_tool_call_tokens_keep_turns_short(agent_tokenizer):
    call = TOOL_CALL.format(expr="347*58")
    ids = agent_tokenizer(call, add_special_tokens=False)["input_ids"]
    assert len(ids) == 10  # wrapper, fixed JSON, six characters, closing JSON, wrapper
    assert agent_tokenizer.decode(ids, skip_special_tokens=True) == call
    assert agent_tokenizer.decode(ids + [agent_tokenizer.eos_token_id], skip_special_tokens=True) == call


def test_the_runtime_layout_is_the_warm_ups(agent_tokenizer):
    from relax_plugins.models.tiny_lm_build import CalculatorLayout

    env = _calculator()
    chat = ChatTokens(agent_tokenizer, env.tools())
    prompt = chat.prompt("347*58=").ids
    assert agent_tokenizer.decode(prompt) == "T:calc\nU:347*58=\nA:"
    turn = _turn("347*58")
    observation = env.step(env.start(_task()), turn)
    following = chat.message(observation, [], model_stopped=agent_tokenizer.eos_token).ids
    assert agent_tokenizer.decode(following) == "R:20126\nA:"
    pieces = CalculatorLayout(agent_tokenizer).trajectory({"prompt": "347*58=", "answer": "20126"})
    call = agent_tokenizer(turn.text, add_special_tokens=False)["input_ids"] + [agent_tokenizer.eos_token_id]
    assert pieces == {"prompt": prompt, "call": call, "observation": following,
                      "answer": agent_tokenizer("20126", add_special_tokens=False)["input_ids"]
                      + [agent_tokenizer.eos_token_id]}


def test_built_model_matches_its_architecture(agent_model, agent_tokenizer):
    from relax.spec.architecture import ModelArchitecture, architecture_from_hf_config

    options = yaml.safe_load(PRESET.read_text())["model"]["options"]
    built = architecture_from_hf_config(json.loads((agent_model / "config.json").read_text()), "builtin:tiny-lm")
    declared = ModelArchitecture.model_validate(TinyLM(TinyLM.Config(**options)).architecture())
    assert built.model_dump() == declared.model_dump()
    assert declared.vocab_size == len(agent_tokenizer)


def test_warm_up_calls_the_tool_sometimes_and_copies_well(agent_model):
    report = json.loads((agent_model / "relax-build.json").read_text())
    # It starts a right call about a quarter of the time (RL has room to raise it) ...
    assert 0.1 <= report["tool_call_probability"] <= 0.3
    # ... copies the tool's result nearly always, and cannot multiply alone.
    assert report["copy_probability"] >= 0.8
    assert report["direct_accuracy"] < 0.01
    assert report["expected_accuracy"] <= 0.3


def test_sampled_trajectories_use_the_tool_and_get_right_answers(agent_model, agent_tokenizer):
    """End to end with the model, the template and the calculator, as the runtime does it: sample
    first turns, answer the calls, sample the answers; tool users are mostly right, others not."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(agent_model).eval()
    env = _calculator()
    chat = ChatTokens(agent_tokenizer, env.tools())
    data = ProductsDataset(ProductsDataset.Config(size=48, seed=7))
    eos = agent_tokenizer.eos_token_id

    def sample(prompts, max_new_tokens):
        width = max(map(len, prompts))
        ids = torch.tensor([[agent_tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=agent_tokenizer.pad_token_id,
                             eos_token_id=eos)
        return [row[width:].tolist() for row in out]

    torch.manual_seed(0)
    rows = [data[i] for i in range(len(data))]
    prompts = [chat.prompt(row["prompt"]).ids for row in rows]
    firsts = sample(prompts, 16)
    callers, direct_right = [], 0
    for row, prompt, first in zip(rows, prompts, firsts):
        first = first[:first.index(eos) + 1] if eos in first else first
        text = agent_tokenizer.decode(first, skip_special_tokens=True)
        parsed = parse_tool_calls(text, env.tools())
        if parsed.calls and first[-1] == eos:
            observation = env.step(env.start(_task(row["prompt"], row["answer"])),
                                   Turn(0, text, parsed.calls, True))
            following = chat.message(observation, [], model_stopped=agent_tokenizer.eos_token).ids
            callers.append((row, prompt + first + following))
        else:
            direct_right += text == row["answer"]
    assert 3 <= len(callers) <= 25, len(callers)
    answers = sample([ids for _, ids in callers], 8)
    right = sum(agent_tokenizer.decode(a, skip_special_tokens=True) == row["answer"]
                for (row, _), a in zip(callers, answers))
    assert right >= 0.6 * len(callers), (right, len(callers))
    assert direct_right <= 1
