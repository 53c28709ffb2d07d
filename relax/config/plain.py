"""Spec files that need no omegaconf: plain data whose only interpolations name a scalar.

omegaconf defines what a spec file means (``extends:`` merging, ``${...}`` interpolation,
overrides), and importing it costs about 40 ms, a seventh of ``relax validate``. Most files are
plain data with at most an interpolation like ``output_dir: runs/${name}``; for those,
``resolve_plain`` gives what omegaconf gives (``OmegaConf.to_container(OmegaConf.create(data),
resolve=True)``) without it. Anything else makes it answer None, and the loader goes through
omegaconf, which also words the errors: an ``extends``, a key that is not a string, a value that
is not JSON-like (a YAML date), and every interpolation but ``${a.b}`` (absolute, through mappings,
to a string, number or boolean that is not itself an interpolation or ``???``) with no ``$``,
``\\``, ``{`` or ``}`` in the text around it (escapes, resolvers such as ``${oc.env:...}``, relative
and nested interpolations, references to a section, a list item, a null or a missing key).
tests/spec/test_plain_specs.py checks that the two agree wherever this answers.
"""

from __future__ import annotations

import re
from typing import Any

#: ``${a.b.c}``: an absolute interpolation of a node reached through mappings.
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\}")
#: Characters whose meaning around an interpolation is omegaconf's grammar's to decide.
_GRAMMAR = frozenset("${}\\")
#: omegaconf's marker of a missing value: interpolating it is an error omegaconf words.
_MISSING = "???"


class _NeedsOmegaconf(Exception):
    """The file holds something only omegaconf can resolve (or report)."""


def resolve_plain(data: dict[str, Any]) -> dict[str, Any] | None:
    """``data`` (a spec file as YAML or JSON loaded it) with its interpolations resolved, or None
    when it needs omegaconf (see the module docstring)."""
    if data.get("extends") is not None:
        return None
    try:
        return _resolve(data, data)
    except _NeedsOmegaconf:
        return None


def _resolve(value: Any, root: dict[str, Any]) -> Any:
    kind = type(value)
    if kind is dict:
        if any(type(key) is not str for key in value):
            raise _NeedsOmegaconf
        return {key: _resolve(item, root) for key, item in value.items()}
    if kind is list:
        return [_resolve(item, root) for item in value]
    if kind is str:
        return _interpolate(value, root) if "${" in value else value
    if value is None or kind in (int, float, bool):
        return value
    raise _NeedsOmegaconf


def _interpolate(text: str, root: dict[str, Any]) -> Any:
    """A string holding ``${a.b}`` interpolations: the value itself when the string is one
    interpolation (its type kept), else the text with each value's ``str`` put in its place."""
    pieces = _REFERENCE.split(text)  # text, reference, text, ..., text
    around, references = pieces[0::2], pieces[1::2]
    if any(char in _GRAMMAR for part in around for char in part):
        raise _NeedsOmegaconf
    values = [_scalar_at(reference, root) for reference in references]
    if around == ["", ""]:
        return values[0]
    return "".join(part + str(value) for part, value in zip(around, values)) + around[-1]


def _scalar_at(reference: str, root: dict[str, Any]) -> str | int | float | bool:
    node: Any = root
    for key in reference.split("."):
        if type(node) is not dict or key not in node:
            raise _NeedsOmegaconf
        node = node[key]
    if type(node) not in (str, int, float, bool) or (type(node) is str and ("${" in node or node == _MISSING)):
        raise _NeedsOmegaconf
    return node
