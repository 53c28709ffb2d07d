"""Tool calls in a model turn: how each model family writes them (``roles.rollout.agent.
tool_call_format``), parsed out of the turn and rendered back, and why a call is refused.

One parser serves the environment driver and the gateway. A turn is parsed from its text decoded
with special tokens kept (``turn_text``): several families delimit calls with special tokens
(Mistral's ``[TOOL_CALLS]``, gpt-oss's ``<|call|>``, DeepSeek's ``<｜tool▁call▁begin｜>``) that the
sample's display text drops.

The formats (``FORMATS``):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>``.
- ``llama3_json`` (Llama 3.1-3.3): the turn is ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``), several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]NAME[ARGS]{...}`` per call.
- ``deepseek_v3`` (DeepSeek-V3, V3.1, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>
  NAME`` and the arguments in a json code fence (V3), or ``NAME<｜tool▁sep｜>{...}`` (V3.1).
- ``glm`` (GLM-4.5/4.6): ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
  </tool_call>``.
- ``harmony`` (gpt-oss): a message on the commentary channel addressed ``to=functions.NAME``,
  ``<|constrain|>json<|message|>{...}<|call|>``.

The XML-like formats (``qwen3_coder``, ``glm``) write argument values as text: a value is a string
where the tool's schema says so, otherwise it is read as JSON.

A call that cannot be used (a block that is not closed, a body that does not decode, no name, a
tool the environment does not declare, arguments that do not fit the tool's schema) is a refused
call: the model gets what was wrong as its observation and the trajectory goes on; it never reaches
the environment and never stops the run. ``tool_call_format: auto`` picks the format from the
model's chat template (``detect_format``).

Why not the ``renderers`` package (0.1.12): its parsers match delimiters by token id in the model's
own vocabulary and its renderers replace the model's chat template with hand-written Python, while
Relax renders with the model's own template and must parse whatever tokenizer the run has (tests
train tokenizers locally); it has no Mistral parser, and it pulls a pre-release
``prime-pydantic-config`` and ``openai-harmony``. docs/agents.md says more.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax.contracts import ToolCall, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

#: JSON-schema ``type`` names and the Python values that satisfy them.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


@dataclass
class ParsedTurn:
    """The tool calls of one turn: the well-formed ones, what was wrong with the others, and the
    turn's text outside its calls."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""
    """The turn's text with the tool calls (and the format's call delimiters) taken out."""
    format: str = "hermes"

    @property
    def attempted(self) -> int:
        """Calls the model tried to make, well-formed or not."""
        return len(self.calls) + len(self.errors)


@dataclass
class _Attempt:
    """One call as a format's extractor found it, before it is checked against the tools."""

    name: Any = None
    arguments: Any = None
    error: str = ""
    textual: bool = False
    """The argument values are text (XML-like formats): read each by the tool's schema."""


@dataclass(frozen=True)
class _Format:
    extract: Callable[[str], tuple[str, list[_Attempt]]]
    render: Callable[[list[ToolCall], str], str]
    example: str


# -- hermes ---------------------------------------------------------------------------------------


def _blocks(text: str, open_: str, close: str) -> tuple[str, list[tuple[str, bool]]]:
    """The bodies between ``open_`` and ``close`` (each with whether it was closed) and the text
    outside them."""
    bodies: list[tuple[str, bool]] = []
    outside, at = [], 0
    while True:
        start = text.find(open_, at)
        if start < 0:
            outside.append(text[at:])
            break
        outside.append(text[at:start])
        end = text.find(close, start + len(open_))
        if end < 0:
            bodies.append((text[start + len(open_):], False))
            break
        bodies.append((text[start + len(open_):end], True))
        at = end + len(close)
    return "".join(outside), bodies


def _json_call(body: str, args_keys: tuple[str, ...] = ("arguments",)) -> _Attempt:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return _Attempt(error=f"its body is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(call, dict):
        return _Attempt(error=f"expected a JSON object with name and arguments, got {type(call).__name__}")
    arguments = next((call[k] for k in args_keys if k in call), {})
    return _Attempt(name=call.get("name"), arguments=arguments)


def _tagged_calls(text: str, parse_body: Callable[[str], _Attempt]) -> tuple[str, list[_Attempt]]:
    """The text outside ``<tool_call>`` blocks, and one attempt per block: ``parse_body`` of a closed
    block's body, an error for a block never closed. The formats that wrap each call in these tags
    (hermes, qwen3_coder, glm) differ only in what a body holds."""
    content, bodies = _blocks(text, OPEN, CLOSE)
    return content, [parse_body(body) if closed else _Attempt(error=f"{OPEN} is never closed with {CLOSE}")
                     for body, closed in bodies]


def _hermes_extract(text: str) -> tuple[str, list[_Attempt]]:
    return _tagged_calls(text, lambda body: _json_call(body.strip()))


def _hermes_render(calls: list[ToolCall], content: str) -> str:
    blocks = [f'{OPEN}\n{json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)}\n{CLOSE}'
              for c in calls]
    return "\n".join(([content] if content else []) + blocks)


# -- qwen3_coder ----------------------------------------------------------------------------------

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(</parameter>|$)", re.DOTALL)


def _strip_newline(value: str) -> str:
    """A value between tags without the one newline the template writes on each side."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _qwen3_coder_call(body: str) -> _Attempt:
    function = _FUNCTION.search(body)
    if function is None:
        return _Attempt(error="it has no <function=NAME> ... </function>")
    if not function.group(3):
        return _Attempt(error="<function=...> is never closed with </function>")
    arguments: dict[str, str] = {}
    for parameter in _PARAMETER.finditer(function.group(2)):
        if not parameter.group(3):
            return _Attempt(error=f"<parameter={parameter.group(1)}> is never closed with </parameter>")
        arguments[parameter.group(1).strip()] = _strip_newline(parameter.group(2))
    return _Attempt(name=function.group(1).strip(), arguments=arguments, textual=True)


def _qwen3_coder_extract(text: str) -> tuple[str, list[_Attempt]]:
    return _tagged_calls(text, _qwen3_coder_call)


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _qwen3_coder_render(calls: list[ToolCall], content: str) -> str:
    blocks = []
    for c in calls:
        params = "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n" for k, v in c.arguments.items())
        blocks.append(f"{OPEN}\n<function={c.name}>\n{params}</function>\n{CLOSE}")
    return "\n".join(([content] if content else []) + blocks)


# -- llama3_json ----------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def _llama3_extract(text: str) -> tuple[str, list[_Attempt]]:
    body = text.strip()
    for end in _LLAMA_ENDS:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].strip()
    elif not (body.startswith("{") and '"name"' in body):
        return text, []  # a plain answer: Llama writes a call as the whole turn
    out: list[_Attempt] = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            call, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as exc:
            out.append(_Attempt(error=f"its body is not valid JSON ({exc.msg} at character {exc.pos})"))
            break
        out.append(_json_call(json.dumps(call), ("parameters", "arguments")))
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return "", out


def _llama3_render(calls: list[ToolCall], content: str) -> str:
    if content:
        raise ValueError("llama3_json writes a tool call as the whole turn; a turn with calls has no other text")
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)


# -- mistral --------------------------------------------------------------------------------------

MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_ENDS = ("</s>",)


def _mistral_extract(text: str) -> tuple[str, list[_Attempt]]:
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return text, []
    content, rest = text[:at], text[at:]
    for end in _MISTRAL_ENDS:
        rest = rest.rstrip().removesuffix(end)
    decoder = json.JSONDecoder()
    out: list[_Attempt] = []
    for part in rest.split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if part.startswith("["):  # v3: a JSON list of calls
            try:
                calls, _ = decoder.raw_decode(part)
            except json.JSONDecodeError as exc:
                out.append(_Attempt(error=f"the list after {MISTRAL_CALLS} is not valid JSON "
                                          f"({exc.msg} at character {exc.pos})"))
                continue
            if not isinstance(calls, list):
                out.append(_Attempt(error=f"expected a JSON list of calls after {MISTRAL_CALLS}"))
                continue
            for call in calls:
                out.append(_json_call(json.dumps(call)) if isinstance(call, dict) else
                           _Attempt(error=f"expected a JSON object with name and arguments, got {type(call).__name__}"))
        elif MISTRAL_ARGS in part:  # v11+: NAME[ARGS]{...}
            name, _, args = part.partition(MISTRAL_ARGS)
            try:
                arguments, _ = decoder.raw_decode(args.strip())
            except json.JSONDecodeError as exc:
                out.append(_Attempt(error=f"the arguments of {name.strip()!r} are not valid JSON "
                                          f"({exc.msg} at character {exc.pos})"))
                continue
            out.append(_Attempt(name=name.strip(), arguments=arguments))
        else:
            out.append(_Attempt(error=f"{MISTRAL_CALLS} is followed by neither a JSON list of calls nor "
                                      f"NAME{MISTRAL_ARGS}{{...}}"))
    return content, out


def _mistral_render(calls: list[ToolCall], content: str) -> str:
    body = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls], ensure_ascii=False)
    return f"{content}{MISTRAL_CALLS}{body}"


# -- deepseek_v3 ----------------------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def _deepseek_extract(text: str) -> tuple[str, list[_Attempt]]:
    at = text.find(DS_CALLS_BEGIN)
    first = text.find(DS_CALL_BEGIN)
    if at < 0 and first < 0:
        return text, []
    start = at if at >= 0 else first
    content, region = text[:start], text[start:]
    region = region.split(DS_CALLS_END)[0]
    _, bodies = _blocks(region, DS_CALL_BEGIN, DS_CALL_END)
    out = []
    for body, closed in bodies:
        if not closed:
            out.append(_Attempt(error=f"{DS_CALL_BEGIN} is never closed with {DS_CALL_END}"))
            continue
        head, sep, tail = body.partition(DS_SEP)
        if not sep:
            out.append(_Attempt(error=f"the call has no {DS_SEP} between its name and its arguments"))
            continue
        if head.strip() == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
            name, _, args = tail.partition("\n")
            fence = _FENCE.match(args.strip())
            args = fence.group(1) if fence else args
        else:  # V3.1: NAME<sep>{...}
            name, args = head, tail
        attempt = _json_args(args)
        if not attempt.error:
            attempt.name = name.strip()
        out.append(attempt)
    return content, out


def _json_args(text: str) -> _Attempt:
    try:
        return _Attempt(arguments=json.loads(text))
    except json.JSONDecodeError as exc:
        return _Attempt(error=f"its arguments are not valid JSON ({exc.msg} at character {exc.pos})")


def _deepseek_render(calls: list[ToolCall], content: str) -> str:
    blocks = "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{c.name}\n```json\n"
                       f"{json.dumps(c.arguments, ensure_ascii=False)}\n```{DS_CALL_END}" for c in calls)
    return f"{content}{DS_CALLS_BEGIN}{blocks}{DS_CALLS_END}"


# -- glm ------------------------------------------------------------------------------------------

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_call(body: str) -> _Attempt:
    name, key, rest = body.partition("<arg_key>")
    rest = key + rest
    name = name.strip()
    if not name or "\n" in name or "{" in name:
        return _Attempt(error="it does not start with the tool's name (write NAME, then "
                              "<arg_key>KEY</arg_key><arg_value>VALUE</arg_value> per argument)")
    arguments = {m.group(1).strip(): m.group(2) for m in _ARG.finditer(rest)}
    if _ARG.sub("", rest).strip():
        return _Attempt(error=f"the arguments of {name!r} are not all <arg_key>KEY</arg_key>"
                              "<arg_value>VALUE</arg_value> pairs")
    return _Attempt(name=name, arguments=arguments, textual=True)


def _glm_extract(text: str) -> tuple[str, list[_Attempt]]:
    return _tagged_calls(text, _glm_call)


def _glm_render(calls: list[ToolCall], content: str) -> str:
    blocks = ["".join([f"{OPEN}{c.name}\n"] + [f"<arg_key>{k}</arg_key>\n<arg_value>{_value_text(v)}</arg_value>\n"
                                                for k, v in c.arguments.items()] + [CLOSE]) for c in calls]
    return "".join([content] + blocks)


# -- harmony --------------------------------------------------------------------------------------

H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_CALL, H_END, H_RETURN, H_CONSTRAIN = "<|call|>", "<|end|>", "<|return|>", "<|constrain|>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def _harmony_extract(text: str) -> tuple[str, list[_Attempt]]:
    if H_MESSAGE not in text:
        return text, []
    content: list[str] = []
    out: list[_Attempt] = []
    # Messages: a header up to <|message|>, a body up to <|call|>, <|end|>, <|return|> or the next
    # <|start|> (the generation's stop token may have been cut off).
    pieces = re.split(r"(<\|call\|>|<\|end\|>|<\|return\|>|<\|start\|>)", text)
    message = ""
    messages: list[tuple[str, str]] = []
    for piece in pieces:
        if piece in (H_CALL, H_END, H_RETURN, H_START):
            if message.strip():
                messages.append((message, piece))
            message = ""
            continue
        message += piece
    if message.strip():
        messages.append((message, ""))
    for message, end in messages:
        header, sep, body = message.partition(H_MESSAGE)
        if not sep:
            content.append(message)
            continue
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            if "to=" in header:
                out.append(_Attempt(error="its recipient is not functions.NAME"))
            elif "analysis" not in header:
                content.append(body)
            continue
        if end in (H_END, H_RETURN):
            out.append(_Attempt(error=f"a call to functions.{recipient.group(1)} ends with {end}, not {H_CALL}"))
            continue
        attempt = _json_args(body.strip())
        if not attempt.error:
            attempt.name = recipient.group(1)
        out.append(attempt)
    return "".join(content).strip(), out


def _harmony_render(calls: list[ToolCall], content: str) -> str:
    parts = [f"{H_CHANNEL}final{H_MESSAGE}{content}{H_END}"] if content else []
    parts += [f"{H_CHANNEL}commentary to=functions.{c.name} {H_CONSTRAIN}json{H_MESSAGE}"
              f"{json.dumps(c.arguments, ensure_ascii=False)}{H_CALL}" for c in calls]
    return H_START.join(f"assistant{p}" if i else p for i, p in enumerate(parts))


_FORMATS: dict[str, _Format] = {
    "hermes": _Format(_hermes_extract, _hermes_render, f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}'),
    "qwen3_coder": _Format(_qwen3_coder_extract, _qwen3_coder_render,
                           f"{OPEN}<function=NAME><parameter=KEY>VALUE</parameter></function>{CLOSE}"),
    "llama3_json": _Format(_llama3_extract, _llama3_render, '{"name": ..., "parameters": {...}} as the whole turn'),
    "mistral": _Format(_mistral_extract, _mistral_render, f'{MISTRAL_CALLS}[{{"name": ..., "arguments": {{...}}}}]'),
    "deepseek_v3": _Format(_deepseek_extract, _deepseek_render,
                           f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}NAME\\n```json\\n{{...}}\\n```"
                           f"{DS_CALL_END}{DS_CALLS_END}"),
    "glm": _Format(_glm_extract, _glm_render, f"{OPEN}NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>{CLOSE}"),
    "harmony": _Format(_harmony_extract, _harmony_render,
                       f"{H_CHANNEL}commentary to=functions.NAME {H_CONSTRAIN}json{H_MESSAGE}{{...}}{H_CALL}"),
}
#: The tool-call formats, by the name ``roles.rollout.agent.tool_call_format`` gives them.
FORMATS: tuple[str, ...] = tuple(_FORMATS)


def _format(fmt: str) -> _Format:
    try:
        return _FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}; the formats are: {', '.join(FORMATS)} "
                         "(or auto, resolved from the chat template)") from None


def parse_tool_calls(text: str, tools: list[ToolSpec], fmt: str = "hermes") -> ParsedTurn:
    """The tool calls in a turn's text (``turn_text``), checked against the declared ``tools``."""
    form = _format(fmt)
    declared = {t.name: t for t in tools}
    content, attempts = form.extract(text)
    out = ParsedTurn(content=content.strip(), format=fmt)
    for i, attempt in enumerate(attempts):
        problem = attempt.error or _check_call(attempt, declared)
        if problem:
            out.errors.append(f"tool call {i + 1}: {problem}; write {form.example}")
            continue
        arguments = _arguments(attempt, declared[attempt.name])
        out.calls.append(ToolCall(name=attempt.name, arguments=arguments, id=f"call_{i}"))
    return out


def render_tool_calls(calls: list[ToolCall], fmt: str, content: str = "") -> str:
    """A model turn in format ``fmt`` that makes ``calls`` (after ``content``, where the format
    allows text beside calls): what ``parse_tool_calls`` reads back as these calls."""
    return _format(fmt).render(list(calls), content)


def _arguments(attempt: _Attempt, tool: ToolSpec) -> dict[str, Any]:
    arguments = attempt.arguments if attempt.arguments is not None else {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if attempt.textual:
        properties = (tool.parameters or {}).get("properties", {}) or {}
        arguments = {k: _typed(v, (properties.get(k) or {}).get("type")) for k, v in arguments.items()}
    return arguments


def _typed(value: str, wanted: Any) -> Any:
    """A textual argument value read by its schema type: a string stays text, anything else is JSON
    (a value that does not decode stays text, so the schema check names the mismatch)."""
    names = wanted if isinstance(wanted, list) else [wanted]
    if "string" in names:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _check_call(attempt: _Attempt, declared: dict[str, ToolSpec]) -> str:
    """What is wrong with a decoded call, or "" when it can be made."""
    name = attempt.name
    if not isinstance(name, str) or not name:
        return "it has no \"name\" string"
    if name not in declared:
        return f"no tool named {name!r}; the tools are: {', '.join(sorted(declared)) or 'none'}"
    arguments = attempt.arguments if attempt.arguments is not None else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    attempt.arguments = arguments
    return check_arguments(_arguments(attempt, declared[name]), declared[name])


def check_arguments(arguments: dict[str, Any], tool: ToolSpec) -> str:
    """What is wrong with ``arguments`` for ``tool``'s schema (required keys, unknown keys when
    ``additionalProperties`` is false, the ``type`` of each property), or ""."""
    schema = tool.parameters or {}
    properties: dict[str, Any] = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name!r} needs the argument(s) {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(properties))
        if extra:
            return f"{tool.name!r} takes no argument(s) {', '.join(extra)}; it takes {', '.join(sorted(properties))}"
    for key, value in arguments.items():
        wanted = (properties.get(key) or {}).get("type")
        if wanted is None:
            continue
        names = wanted if isinstance(wanted, list) else [wanted]
        allowed = tuple(t for n in names for t in _TYPES.get(n, (object,)))
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and "boolean" not in names):
            return f"argument {key!r} of {tool.name!r} must be {' or '.join(names)}, got {type(value).__name__}"
    return ""


def error_observation(errors: list[str]) -> str:
    """The observation a turn with unusable tool calls gets (the model sees what was wrong)."""
    return "error: " + "; ".join(errors)


def turn_text(tokenizer: Any, ids: list[int]) -> str:
    """A model turn's text for parsing its tool calls: decoded with special tokens kept (several
    formats delimit calls with them)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def resolve_format(fmt: str, tokenizer: Any) -> str:
    """The format a run parses: ``fmt``, or for ``auto`` the one the tokenizer's chat template
    writes (``detect_format``)."""
    if fmt != "auto":
        _format(fmt)
        return fmt
    return detect_format(getattr(tokenizer, "chat_template", None))


#: What marks each format in a chat template, most specific first (``detect_format``).
_TEMPLATE_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "to=functions.")),
    ("deepseek_v3", (DS_CALL_BEGIN,)),
    ("mistral", (MISTRAL_CALLS,)),
    ("glm", ("<arg_key>",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("hermes", (OPEN,)),
    ("llama3_json", ('"parameters"',)),
    ("llama3_json", (PYTHON_TAG,)),
)


def detect_format(template: Any) -> str:
    """The tool-call format a chat template writes (``tool_call_format: auto``); a template that
    writes none of them is an error naming the formats to choose from."""
    if isinstance(template, dict):  # several named templates: the tool_use one speaks for tools
        template = template.get("tool_use") or template.get("default") or "\n".join(map(str, template.values()))
    if isinstance(template, list):
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    text = str(template or "")
    for name, marks in _TEMPLATE_MARKS:
        if all(mark in text for mark in marks):
            return name
    raise ValueError("tool_call_format: auto could not tell the tool-call format from the model's chat template "
                     f"(it writes none of the known call markers); set roles.rollout.agent.tool_call_format to "
                     f"one of: {', '.join(FORMATS)}")
