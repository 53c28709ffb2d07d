"""Turn pydantic's validation errors into ``SpecIssue``s with dotted paths and remedies.

Used for the spec itself and for each plugin's ``Config``, so that both read the same way.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from relax.spec.errors import SpecIssue, join_path


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """A "did you mean" hint for a misspelt name, or a list of the valid ones."""
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
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
            issues.append(SpecIssue(path, "unknown key", did_you_mean(str(loc[-1]), keys)))
            continue
        if kind == "literal_error":
            choices = _literal_choices(model, loc)
            value = err.get("input")
            hint = did_you_mean(str(value), choices) if choices else ""
            if choices and hint.startswith("valid keys"):
                hint = "use one of: " + ", ".join(choices)
            elif choices:
                hint = f"{hint} (one of: {', '.join(choices)})"
            issues.append(SpecIssue(path, f"{value!r} is not allowed", hint))
            continue
        message = err["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        if kind != "missing" and "input" in err and not isinstance(err["input"], (dict, list)):
            message = f"{err['input']!r}: {message[0].lower()}{message[1:]}"
        issues.append(SpecIssue(path, message, _REMEDIES.get(kind, "")))
    return issues
