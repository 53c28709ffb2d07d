"""Chat templates (Jinja) rendered within bounds of nesting, time and output size.

A chat template is code from a file or a model folder. Jinja's sandbox already stops it from
reaching Python's internals, but not from eating memory (``{{ 'x' * 2000000000 }}`` takes 4 GB in
9 s), running for hours (nested loops, a macro that calls itself twice) or crashing the parser with
a ``RecursionError`` (a few hundred nested ``{% if %}``). Three bounds hold here:

- **Nesting** (``check_nesting``): the template's tokens are counted, without recursion, before
  anything parses it; blocks and brackets may nest ``MAX_TEMPLATE_NESTING`` deep. Any other form
  deep enough to exhaust Python's stack while parsing or compiling is reported the same way.
- **Output size and time, in process** (``BoundedEnvironment``): the sandbox's hooks for ``*``,
  ``**`` and ``+`` refuse a result past ``MAX_TEMPLATE_OUTPUT_CHARS`` *before* computing it; every
  call, attribute or item lookup, filter and output chunk checks the size of what it produced and a
  deadline (``MAX_RENDER_SECONDS``). These hooks are cheap (one comparison each), so every render
  goes through them. They cannot see everything (a loop with no lookup in its body, ``~`` joins),
  which is why there is a third bound:
- **Hard limits, in a subprocess, at validate time** (``probe``): the template is parsed and
  rendered with sample messages in a child process under ``RLIMIT_AS`` and a wall-clock timeout, so
  any bomb the sample input sets off is an error (``SpecIssue`` naming the file) rather than a hang
  or an out-of-memory machine. A subprocess per render would cost milliseconds per prompt, so the
  run renders in process, behind the hooks above, with a template validation has probed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: How deeply blocks (``{% for %}``, ``{% if %}``, ...) and brackets may nest (models' own templates
#: nest fewer than ten).
MAX_TEMPLATE_NESTING = 64
#: Characters a render, or any value made while rendering, may hold (a prompt is a few KiB).
MAX_TEMPLATE_OUTPUT_CHARS = 4 * 1024 * 1024
#: Seconds a render may take (a model's template renders a prompt in well under a millisecond).
MAX_RENDER_SECONDS = 5.0
#: Memory the validate-time probe's process may map.
PROBE_MEMORY_BYTES = 1024 * 1024 * 1024
#: Wall-clock seconds the validate-time probe may take (start-up included).
PROBE_TIMEOUT_S = 20.0

#: Messages the probe renders (what a rollout and an agent send).
PROBE_CONVERSATIONS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
)

_OPENERS = frozenset({"for", "if", "macro", "call", "filter", "block", "with", "autoescape", "trans", "generation"})
_BRACKETS = {"lparen": 1, "lbracket": 1, "lbrace": 1, "rparen": -1, "rbracket": -1, "rbrace": -1}


class TemplateBoundError(TemplateError):
    """A template past one of this module's bounds; the message says which."""


def check_nesting(source: str, limit: int = MAX_TEMPLATE_NESTING) -> None:
    """``TemplateBoundError`` when blocks or brackets nest deeper than ``limit`` (by the lexer's
    tokens, so a template that would crash the parser is refused before it is parsed)."""
    env = _environment()
    blocks = brackets = 0
    statement: list[str] = []
    in_block = False
    for lineno, kind, value in env.lex(source):
        if kind == "block_begin":
            in_block, statement = True, []
            continue
        if kind == "block_end":
            in_block = False
            head = statement[0] if statement else ""
            if head in _OPENERS or (head == "set" and "=" not in statement):
                blocks += 1
            elif head.startswith("end"):
                blocks = max(0, blocks - 1)
            if blocks > limit:
                raise TemplateBoundError(f"blocks nest more than {limit} deep (line {lineno})")
            continue
        if in_block and kind in ("name", "assign"):
            statement.append("=" if kind == "assign" else value)
        brackets = max(0, brackets + _BRACKETS.get(kind, 0))
        if brackets > limit:
            raise TemplateBoundError(f"brackets nest more than {limit} deep (line {lineno})")


class _Deadline(threading.local):
    until: float = float("inf")


_DEADLINE = _Deadline()


def _sized(value: Any) -> Any:
    """``value``, after checking the deadline and that it is not past the output cap."""
    if time.monotonic() > _DEADLINE.until:
        raise TemplateBoundError(f"rendering takes more than {MAX_RENDER_SECONDS:g} s")
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_TEMPLATE_OUTPUT_CHARS:
        raise TemplateBoundError(f"it makes a value of {len(value)} items, more than the "
                                 f"{MAX_TEMPLATE_OUTPUT_CHARS} a render may")
    return value


def _size_of_binop(operator: str, left: Any, right: Any) -> int:
    """The length of ``left <operator> right`` for sequences (and digits for ``**``), or 0."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                return len(seq) * max(count, 0)
    if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return (abs(left).bit_length() * right) // 3  # about the digits of the result
    return 0


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): rendered as its
    body, as transformers renders it when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (trim_blocks, lstrip_blocks, loop controls,
    ``tojson``, ``raise_exception``, ``strftime_now``), with size and time checks in the sandbox's
    hooks (see the module doc)."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded(f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: time.strftime(fmt)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = _size_of_binop(operator, left, right)
        if size > MAX_TEMPLATE_OUTPUT_CHARS:
            raise TemplateBoundError(f"'{operator}' would make a value of about {size} items, more than the "
                                     f"{MAX_TEMPLATE_OUTPUT_CHARS} a render may")
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_arguments(args, kwargs)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _sized(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _sized(super().getitem(obj, argument))

    def concat(self, chunks: Iterable[str]) -> str:  # type: ignore[override]
        out: list[str] = []
        total = 0
        for chunk in chunks:
            total += len(chunk)
            if total > MAX_TEMPLATE_OUTPUT_CHARS:
                raise TemplateBoundError(f"it renders more than {MAX_TEMPLATE_OUTPUT_CHARS} characters")
            _sized(chunk)
            out.append(chunk)
        return "".join(out)


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call with a number past the output cap (``'x'.ljust(10**9)``, ``center``,
    ``indent``): such an argument asks for a value that large."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEMPLATE_OUTPUT_CHARS:
            raise TemplateBoundError(f"a call asks for {value}, more than the {MAX_TEMPLATE_OUTPUT_CHARS} "
                                     "a render may make")


def _bounded(function: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return _sized(function(*args, **kwargs))

    for flag in ("jinja_pass_arg",):  # keep pass_context / pass_environment markers
        if hasattr(function, flag):
            setattr(bounded, flag, getattr(function, flag))
    return bounded


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=1)
def _environment() -> BoundedEnvironment:
    return BoundedEnvironment()


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """``source`` checked for nesting and compiled in the bounded environment (cached)."""
    check_nesting(source)
    try:
        return _environment().from_string(source)
    except RecursionError:
        raise TemplateBoundError("it nests too deeply to parse (expressions or blocks)") from None


def render(source: str, **variables: Any) -> str:
    """``source`` rendered with ``variables`` within the bounds (``TemplateBoundError`` past one)."""
    template = compile_template(source)
    _DEADLINE.until = time.monotonic() + MAX_RENDER_SECONDS
    try:
        return template.render(**variables)
    except RecursionError:
        raise TemplateBoundError("it recurses too deeply while rendering (a macro that calls itself?)") from None
    finally:
        _DEADLINE.until = float("inf")


def render_chat(source: str, messages: list[dict[str, Any]], tokenizer: Any = None,
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
    """A conversation through a chat template, with the variables transformers'
    ``apply_chat_template`` gives it (the tokenizer's special tokens, ``tools``, ``documents``)."""
    special = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    return render(source, **special, messages=messages, tools=tools, documents=None,
                  add_generation_prompt=add_generation_prompt)


def _probe_child() -> None:
    """The probe's child process: the template on stdin, the verdict as JSON on stdout."""
    source = sys.stdin.read()
    verdict: dict[str, Any] = {"ok": True}
    try:
        for messages in PROBE_CONVERSATIONS:
            try:
                render_chat(source, messages, add_generation_prompt=True)
            except TemplateBoundError:
                raise
            except Exception:  # noqa: BLE001 - the template's own refusal of an input is not a bound
                continue
    except TemplateBoundError as exc:
        verdict = {"ok": False, "error": str(exc)}
    except MemoryError:
        verdict = {"ok": False, "error": f"it needs more than {PROBE_MEMORY_BYTES // 2**20} MiB to render"}
    sys.stdout.write(json.dumps(verdict))


def probe(source: str) -> str | None:
    """Render ``source`` with sample messages in a child process under a memory limit and a
    timeout; the problem in words, or None when it renders within bounds."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (PROBE_MEMORY_BYTES, PROBE_MEMORY_BYTES))

    code = "from relax.chat_templates import _probe_child; _probe_child()"
    try:
        done = subprocess.run([sys.executable, "-c", code], input=source, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return f"it takes more than {PROBE_TIMEOUT_S:g} s to render a sample conversation"
    try:
        verdict = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"rendering a sample conversation failed (exit {done.returncode}: {tail[:200]})"
    return None if verdict.get("ok") else str(verdict.get("error"))
