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

It resolves under the character caps of ``relax.config.interpolation_budget``: each value's size is
summed from its pieces before they are joined, so a file of ``${a}${a}...`` refers to a long ``a``
is refused (``SpecError`` naming the key) without being built.
"""

from __future__ import annotations

import re
from typing import Any

from relax.config.interpolation_budget import (
    MAX_RESOLVED_CHARS,
    MAX_SPEC_RESOLVED_CHARS,
    dotted,
    too_large,
)

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
        return _Resolver(data).resolve(data, ())
    except _NeedsOmegaconf:
        return None


class _Resolver:
    """One file's resolution, with the characters its interpolations have produced so far."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.expanded = 0
        self.found: dict[str, str | int | float | bool] = {}

    def resolve(self, value: Any, path: tuple[Any, ...]) -> Any:
        kind = type(value)
        if kind is dict:
            if any(type(key) is not str for key in value):
                raise _NeedsOmegaconf
            return {key: self.resolve(item, (*path, key)) for key, item in value.items()}
        if kind is list:
            return [self.resolve(item, (*path, index)) for index, item in enumerate(value)]
        if kind is str:
            return self.interpolate(value, path) if "${" in value else value
        if value is None or kind in (int, float, bool):
            return value
        raise _NeedsOmegaconf

    def interpolate(self, text: str, path: tuple[Any, ...]) -> Any:
        """A string holding ``${a.b}`` interpolations: the value itself when the string is one
        interpolation (its type kept), else the text with each value's ``str`` put in its place,
        once its size is known to be within the caps."""
        pieces = _REFERENCE.split(text)  # text, reference, text, ..., text
        around, references = pieces[0::2], pieces[1::2]
        if any(char in _GRAMMAR for part in around for char in part):
            raise _NeedsOmegaconf
        values = [self.scalar_at(reference) for reference in references]
        if around == ["", ""]:
            return values[0]
        texts = [str(value) for value in values]
        size = sum(map(len, around)) + sum(map(len, texts))
        if size > MAX_RESOLVED_CHARS:
            raise too_large(dotted(path), size, MAX_RESOLVED_CHARS)
        self.expanded += size
        if self.expanded > MAX_SPEC_RESOLVED_CHARS:
            raise too_large(dotted(path), self.expanded, MAX_SPEC_RESOLVED_CHARS,
                            "the interpolated values of the whole spec (up to this key)")
        return "".join(part + value for part, value in zip(around, texts)) + around[-1]

    def scalar_at(self, reference: str) -> str | int | float | bool:
        """``_scalar_at``, once per reference (a file may name one long value many times)."""
        found = self.found.get(reference)
        if found is None:
            found = self.found[reference] = _scalar_at(reference, self.root)
        return found


def _scalar_at(reference: str, root: dict[str, Any]) -> str | int | float | bool:
    node: Any = root
    for key in reference.split("."):
        if type(node) is not dict or key not in node:
            raise _NeedsOmegaconf
        node = node[key]
    if type(node) not in (str, int, float, bool) or (type(node) is str and ("${" in node or node == _MISSING)):
        raise _NeedsOmegaconf
    return node
