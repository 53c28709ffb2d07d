"""Tool-call formats: each family's turn renders and parses back to the same calls (several per
turn, unicode), malformed turns are refused with what is wrong, and ``auto`` reads the format
from a chat template."""

from __future__ import annotations

import pytest

from relax.agents.tool_calls import (FORMATS, detect_format, parse_tool_calls, render_tool_calls)
from relax.contracts import ToolCall, ToolSpec

TOOLS = [
    ToolSpec("search", "Search the web.", {"type": "object", "properties": {"query": {"type": "string"},
                                                                             "limit": {"type": "integer"}},
                                           "required": ["query"]}),
    ToolSpec("calc", "Evaluate.", {"type": "object", "properties": {"expr": {"type": "string"},
                                                                     "exact": {"type": "boolean"},
                                                                     "weights": {"type": "array"}},
                                   "required": ["expr"], "additionalProperties": False}),
]

CALLS = [
    ToolCall("search", {"query": "Zürich 天气 \"quoted\" <tag> 🌧", "limit": 3}),
    ToolCall("calc", {"expr": "347*58\nline two", "exact": True, "weights": [1, 2.5, {"k": "é"}]}),
    ToolCall("search", {"query": "{not json} [x]"}),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_render_then_parse_gives_the_calls_back(fmt: str) -> None:
    for calls in (CALLS[:1], CALLS):
        parsed = parse_tool_calls(render_tool_calls(calls, fmt), TOOLS, fmt)
        assert parsed.errors == []
        assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]
        assert parsed.content == ""


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "llama3_json"])
def test_text_beside_calls_is_the_content(fmt: str) -> None:
    text = render_tool_calls(CALLS[:2], fmt, content="Let me look that up — ünïcode.")
    parsed = parse_tool_calls(text, TOOLS, fmt)
    assert [c.name for c in parsed.calls] == ["search", "calc"]
    assert parsed.content == "Let me look that up — ünïcode."


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_plain_answer_has_no_calls(fmt: str) -> None:
    parsed = parse_tool_calls("The answer is 20126.", TOOLS, fmt)
    assert parsed.calls == [] and parsed.errors == [] and parsed.content == "The answer is 20126."


MALFORMED = {
    "hermes": ['<tool_call>{"name": "calc", "arguments": {"expr": "1"}', "<tool_call>{name: calc}</tool_call>",
               '<tool_call>["calc"]</tool_call>'],
    "qwen3_coder": ["<tool_call>\n<function=calc>\n<parameter=expr>\n1\n</function>\n</tool_call>",
                    "<tool_call>\n<parameter=expr>\n1\n</parameter>\n</tool_call>",
                    "<tool_call>\n<function=calc>\n<parameter=expr>\n1\n</parameter>\n"],
    "llama3_json": ['{"name": "calc", "parameters": {"expr": "1"', '<|python_tag|>calc(expr="1")'],
    "mistral": ['[TOOL_CALLS][{"name": "calc", "arguments": {"expr": "1"}', "[TOOL_CALLS]calc(1)",
                '[TOOL_CALLS]calc[ARGS]{"expr": 1', "[TOOL_CALLS][3]"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n{\"expr\": \n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calc {\"expr\": \"1\"}<｜tool▁call▁end｜>",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n{\"expr\": \"1\"}"],
    "glm": ["<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>1\n</tool_call>",
            "<tool_call>\n<arg_key>expr</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>calc\n<arg_key>expr</arg_key><arg_value>1</arg_value>"],
    "harmony": ["<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{\"expr\": <|call|>",
                "<|channel|>commentary to=calc <|constrain|>json<|message|>{\"expr\": \"1\"}<|call|>",
                "<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{\"expr\": \"1\"}<|end|>"],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_malformed_calls_are_refused_with_the_reason(fmt: str) -> None:
    for text in MALFORMED[fmt]:
        parsed = parse_tool_calls(text, TOOLS, fmt)
        assert parsed.calls == [], text
        assert len(parsed.errors) == 1, (text, parsed.errors)
        assert parsed.errors[0].startswith("tool call 1: ") and "write " in parsed.errors[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_that_do_not_fit_the_tools_are_refused(fmt: str) -> None:
    bad = [ToolCall("search", {"limit": 3}),                       # required query missing
           ToolCall("calc", {"expr": "1", "unit": "m"}),            # additionalProperties false
           ToolCall("nope", {"x": "1"}),                            # no such tool
           ToolCall("search", {"query": "q", "limit": "many"}),     # not an integer
           ToolCall("calc", {"expr": "2"})]                         # the one good call
    parsed = parse_tool_calls(render_tool_calls(bad, fmt), TOOLS, fmt)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calc", {"expr": "2"})]
    assert len(parsed.errors) == 4 and parsed.attempted == 5
    for error, needle in zip(parsed.errors, ("needs the argument(s) query", "takes no argument(s) unit",
                                             "no tool named 'nope'", "must be integer")):
        assert needle in error


def test_textual_formats_read_values_by_the_schema() -> None:
    # A string parameter keeps text that looks like JSON; a non-string one is read as JSON.
    for fmt in ("qwen3_coder", "glm"):
        text = render_tool_calls([ToolCall("search", {"query": "42", "limit": 7})], fmt)
        (call,) = parse_tool_calls(text, TOOLS, fmt).calls
        assert call.arguments == {"query": "42", "limit": 7}


def test_harmony_analysis_is_not_content_and_a_cut_stop_token_still_parses() -> None:
    text = ("<|channel|>analysis<|message|>I should search.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.search <|constrain|>json<|message|>{\"query\": \"q\"}")  # <|call|> stripped
    parsed = parse_tool_calls(text, TOOLS, "harmony")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"query": "q"})]
    assert parsed.content == ""


def test_deepseek_v31_and_mistral_v11_forms_parse() -> None:
    ds = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": \"ü\"}<｜tool▁call▁end｜>"
          "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
    assert [(c.name, c.arguments) for c in parse_tool_calls(ds, TOOLS, "deepseek_v3").calls] == [("search", {"query": "ü"})]
    mi = '[TOOL_CALLS]search[ARGS]{"query": "a"}[TOOL_CALLS]calc[ARGS]{"expr": "1"}</s>'
    assert [c.name for c in parse_tool_calls(mi, TOOLS, "mistral").calls] == ["search", "calc"]


def test_an_unknown_format_is_named() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'.*hermes, qwen3_coder"):
        parse_tool_calls("", TOOLS, "xml")


TEMPLATES = {
    "hermes": "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": ...}</tool_call>",
    "qwen3_coder": "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>",
    "llama3_json": '{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}<|eot_id|>',
    "mistral": "{{- '[TOOL_CALLS][' }}{% for t in message.tool_calls %}{{ t | tojson }}{% endfor %}",
    "deepseek_v3": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
    "glm": "<tool_call>{{ tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key><arg_value>",
    "harmony": "<|start|>assistant<|channel|>commentary to=functions.{{ name }} <|constrain|>json<|message|>",
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_reads_the_format_from_the_template(fmt: str) -> None:
    assert detect_format(TEMPLATES[fmt]) == fmt
    assert detect_format({"default": "{{ messages }}", "tool_use": TEMPLATES[fmt]}) == fmt


def test_auto_names_the_formats_when_the_template_has_none() -> None:
    with pytest.raises(ValueError, match="set roles.rollout.agent.tool_call_format to one of: hermes"):
        detect_format("{% for m in messages %}{{ m.content }}{% endfor %}")


def test_resolve_format_reads_auto_from_the_tokenizers_template_and_checks_a_name() -> None:
    from types import SimpleNamespace

    from relax.agents.tool_calls import resolve_format

    assert resolve_format("auto", SimpleNamespace(chat_template=TEMPLATES["glm"])) == "glm"
    assert resolve_format("mistral", SimpleNamespace(chat_template=TEMPLATES["glm"])) == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call format 'json'"):
        resolve_format("json", SimpleNamespace(chat_template=""))
