"""Turn pydantic's validation errors into ``SpecIssue``s with dotted paths and remedies.

Used for the spec itself and for each plugin's ``Config``, so that both read the same way.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from relax.errors import SpecIssue, deletion, join_path, override


def closest(word: str, choices: typing.Iterable[str]) -> str | None:
    """The choice a misspelt ``word`` most likely meant, or None when none is close."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def typo_of(word: str, choices: typing.Iterable[str]) -> str | None:
    """The choice ``word`` is a typo of: the closest one, if it is at most a quarter of the word's
    letters (at least one) away by edits; else None. A fix sets it (a misspelling mended), where a
    merely similar name (``length_penalty`` for ``overlong_penalty``) is only mentioned."""
    close = closest(word, choices)
    if close is None or _edits(word, close) > max(1, len(word) // 4):
        return None
    return close


def _plain_value(value: Any) -> bool:
    """Whether a value can move to another key as one override: a number, a boolean or a word
    (a mapping would replace a whole section; text with spaces or brackets needs quoting)."""
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, str) and re.fullmatch(r"[\w./:@-]+", value) is not None


def _edits(a: str, b: str) -> int:
    """The insertions, deletions, substitutions and swaps of two neighbouring letters that turn
    ``a`` into ``b`` (optimal string alignment distance: ``stpes`` is one from ``steps``)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """A "did you mean" hint for a misspelt name, or a list of the valid ones."""
    choices = sorted(choices)
    close = closest(word, choices)
    if close is not None:
        return f"did you mean '{close}'?"
    if not choices:
        return "this section takes no keys"
    return "valid keys: " + ", ".join(choices)


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the last element of ``loc`` (following nested fields)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or _is_model(current) is False:
            current = _unwrap_container(current)
            if isinstance(part, int):
                continue
        if not _is_model(current):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = field.annotation
    current = _unwrap_container(current)
    return current if _is_model(current) else None


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _unwrap_container(tp: Any) -> Any:
    """Strip Optional[...] and list[...] until a model (or something else) is left."""
    for _ in range(4):
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else tp
            if len(args) != 1:
                return tp
        elif origin in (list, tuple):
            tp = typing.get_args(tp)[0]
        else:
            return tp
    return tp


def _literal_choices(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    owner = _model_at(model, loc[:-1]) if loc else None
    if owner is None or not isinstance(loc[-1], str):
        return []
    field = owner.model_fields.get(loc[-1])
    if field is None:
        return []
    return [str(a) for a in typing.get_args(_unwrap_container(field.annotation))]


_REMEDIES = {
    "missing": "add it",
    "int_parsing": "give a whole number",
    "int_type": "give a whole number",
    "int_from_float": "give a whole number",
    "float_parsing": "give a number",
    "float_type": "give a number",
    "bool_parsing": "give true or false",
    "bool_type": "give true or false",
    "string_type": "give a string",
    "dict_type": "give a mapping (key: value)",
    "list_type": "give a list",
    "model_type": "give a mapping of this section's keys",
    "model_attributes_type": "give a mapping of this section's keys",
    "too_short": "give at least one entry",
    "greater_than": "raise it",
    "greater_than_equal": "raise it",
    "less_than": "lower it",
    "less_than_equal": "lower it",
    "string_pattern_mismatch": "use letters, digits, '.', '_' and '-' only",
}

#: Errors of a value past an inclusive bound, and the key of that bound in the error's context: the
#: bound itself is the fix.
BOUND_KINDS = {"greater_than_equal": "ge", "less_than_equal": "le"}


def issues_from_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: str = ""
) -> list[SpecIssue]:
    """One ``SpecIssue`` per pydantic error, with its path under ``prefix`` and a remedy."""
    issues = []
    for err in exc.errors(include_url=False):
        kind = err["type"]
        loc = tuple(err["loc"])
        # Unions and tagged types add their own names to the location; keep only real keys. The
        # last element of an unknown-key error is the user's own key, whatever it looks like.
        kept = loc[-1:] if kind == "extra_forbidden" else ()
        loc = tuple(p for p in loc[: len(loc) - len(kept)] if isinstance(p, int) or not str(p).startswith(
            ("function-", "list[", "dict[", "literal[", "tuple["))) + kept
        path = join_path(prefix, *loc) if prefix else join_path(*loc)
        if kind == "extra_forbidden":
            owner = _model_at(model, loc[:-1])
            keys = owner.model_fields.keys() if owner is not None else []
            meant = typo_of(str(loc[-1]), keys)
            fix: tuple[str, ...] = ()
            if meant is not None and _plain_value(err.get("input")):
                parent = join_path(prefix, *loc[:-1]) if prefix else join_path(*loc[:-1])
                fix = (deletion(path), override(join_path(parent, meant), err["input"]))
            issues.append(SpecIssue(path, "unknown key", did_you_mean(str(loc[-1]), keys), fix))
            continue
        if kind == "literal_error":
            choices = _literal_choices(model, loc)
            value = err.get("input")
            hint = did_you_mean(str(value), choices) if choices else ""
            if choices and hint.startswith("valid keys"):
                hint = "use one of: " + ", ".join(choices)
            elif choices:
                hint = f"{hint} (one of: {', '.join(choices)})"
            meant = typo_of(str(value), choices) if choices else None
            issues.append(SpecIssue(path, f"{value!r} is not allowed", hint,
                                    (override(path, meant),) if meant is not None else ()))
            continue
        message = err["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        if kind != "missing" and "input" in err and not isinstance(err["input"], (dict, list)):
            message = f"{err['input']!r}: {message[0].lower()}{message[1:]}"
        bound = err.get("ctx", {}).get(BOUND_KINDS.get(kind, ""))
        fix = (override(path, bound),) if isinstance(bound, (int, float)) and not isinstance(bound, bool) else ()
        issues.append(SpecIssue(path, message, _REMEDIES.get(kind, ""), fix))
    return issues
