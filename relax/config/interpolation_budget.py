"""How much ``${...}`` interpolation may expand: caps, and a check that holds *before* resolving.

Like YAML aliases (``relax.config.bounded_yaml``), interpolations let a small file describe a huge
one: ``b: ${a}${a}${a}``, ``c: ${b}${b}${b}``, ... grows by a factor per level, and omegaconf
resolves without memoising, so the *time* grows the same way even when the text does not
(``a: ""``). A 2 KB file kept ``relax validate`` busy for minutes; a 1 MB one asked for 5 GB.

So the resolved spec is budgeted:

- ``MAX_RESOLVED_CHARS``: the most characters one resolved value may hold;
- ``MAX_SPEC_RESOLVED_CHARS``: the most the whole resolved spec may hold;
- ``MAX_RESOLUTION_STEPS``: the most lookups (``${...}`` references and resolver calls) that
  resolving the whole spec may make, counted as omegaconf makes them (without memoising), which is
  what bounds its time;
- ``MAX_INTERPOLATION_DEPTH``: how long a chain of references may be (omegaconf recurses per link and
  dies with a ``RecursionError`` past about sixty).

``check_budget`` computes, for every interpolating value of an omegaconf tree, its resolved size and
its lookups from omegaconf's own parse of the text, walking the references itself with memoisation
(so the check is linear in the file, whatever the file expands to), and refuses before omegaconf's
resolver runs. It also names reference cycles. Sizes are upper bounds (escapes and quotes count as
written; a section interpolated into text counts its keys and values plus a few characters each),
so a value is never refused for being under a cap, only possibly for being at most a few percent
under it.

Three forms are refused because their expansion cannot be known before resolving: a key built by an
interpolation (``${a.${b}}``), a resolver name built by one, and ``oc.decode``/``oc.create`` of text
that may hold ``$`` (which would resolve interpolations made at resolve time), as is ``oc.create`` of
text at all (it parses YAML outside the alias cap). The plain path (``relax.config.plain``) applies
the same character caps as it resolves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax.errors import SpecError, SpecIssue

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: Characters one resolved value may hold (a spec file holds at most 2 MiB; a value a thousandth
#: of that is already a large prompt).
MAX_RESOLVED_CHARS = 1024 * 1024
#: Characters the whole resolved spec may hold.
MAX_SPEC_RESOLVED_CHARS = 8 * 1024 * 1024
#: Lookups resolving the spec may make (omegaconf takes about a quarter of a millisecond each).
MAX_RESOLUTION_STEPS = 5_000
#: References one value may chain through (``a: ${b}``, ``b: ${c}``, ...).
MAX_INTERPOLATION_DEPTH = 32

REMEDY = "interpolate fewer or smaller values (a run spec's values are small); see docs/security.md"


def dotted(path: tuple[Any, ...]) -> str:
    """A path as ``SpecIssue`` writes it: dotted, list indices in brackets."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def too_large(path: str, size: int, cap: int, what: str = "a resolved value") -> SpecError:
    """The error for a value (or the spec, ``path`` empty) past a character cap."""
    return SpecError([SpecIssue(path, f"its ${{...}} interpolations expand to {size} characters, more than "
                                      f"the {cap} {what} may hold", REMEDY)])


@dataclass
class _Estimate:
    size: int
    """Characters of the resolved value (an upper bound)."""
    steps: int
    """Lookups omegaconf makes to resolve it."""
    dollar: bool
    """Whether the resolved text may hold ``$`` (and so ``${``, if decoded)."""


class _Refused(Exception):
    """A value past a cap; ``path``: the value where it was found, when not the one being checked."""

    def __init__(self, message: str, remedy: str = REMEDY, path: tuple[Any, ...] | None = None) -> None:
        super().__init__(message)
        self.message, self.remedy, self.path = message, remedy, path


_ABSENT = object()


class _Budget:
    """The estimator over one tree (``OmegaConf.to_container(cfg, resolve=False)``)."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.memo: dict[tuple[Any, ...], _Estimate] = {}
        self.active: list[tuple[Any, ...]] = []

    # --- the tree --------------------------------------------------------------------------------

    def lookup(self, path: tuple[Any, ...]) -> Any:
        node = self.tree
        for part in path:
            if isinstance(node, dict):
                if part in node:
                    node = node[part]
                    continue
                if isinstance(part, str) and part.lstrip("-").isdigit() and int(part) in node:
                    node = node[int(part)]
                    continue
                return _ABSENT
            if isinstance(node, list) and (isinstance(part, int) or part.lstrip("-").isdigit()) \
                    and -len(node) <= int(part) < len(node):
                node = node[int(part)]
                continue
            return _ABSENT
        return node

    def target(self, key: str, here: tuple[Any, ...]) -> tuple[Any, ...]:
        """The absolute path of ``key`` (omegaconf's form: ``a.b``, ``a[0]``, ``.sibling``,
        ``..uncle``) written in the value at ``here``."""
        dots = len(key) - len(key.lstrip("."))
        key = key[dots:]
        base = here[:-1] if dots else ()
        if dots > 1:
            base = base[:max(0, len(base) - (dots - 1))]
        parts: list[Any] = []
        for piece in key.replace("[", ".").replace("]", "").split("."):
            if piece:
                parts.append(piece)
        return (*base, *parts)

    # --- values ----------------------------------------------------------------------------------

    def node(self, path: tuple[Any, ...]) -> _Estimate:
        """The estimate of the node at ``path`` (memoised; cycles and over-long chains refused)."""
        known = self.memo.get(path)
        if known is not None:
            return known
        if path in self.active:
            chain = " -> ".join(dotted(p) or "<spec>" for p in (*self.active[self.active.index(path):], path))
            raise _Refused(f"its interpolations refer back to themselves: {chain}",
                           "break the cycle: one of these values must be written out")
        if len(self.active) >= MAX_INTERPOLATION_DEPTH:
            raise _Refused(f"its interpolations chain through more than {MAX_INTERPOLATION_DEPTH} references",
                           "refer to the value itself rather than through a chain of references")
        self.active.append(path)
        try:
            value = self.lookup(path)
            estimate = self.value(value, path)
        finally:
            self.active.pop()
        self.memo[path] = estimate
        return estimate

    def value(self, value: Any, path: tuple[Any, ...]) -> _Estimate:
        if value is _ABSENT:  # omegaconf words the error for a missing key
            return _Estimate(0, 1, False)
        if isinstance(value, dict):
            items = list(value.items())
            total = _Estimate(2, 0, False)
            for key, _ in items:
                child = self.node((*path, key))
                total = _add(total, child, len(str(key)) + 6)
            return total
        if isinstance(value, list):
            total = _Estimate(2, 0, False)
            for index in range(len(value)):
                total = _add(total, self.node((*path, index)), 2)
            return total
        if isinstance(value, str):
            if "${" not in value:
                return _Estimate(len(value), 0, "$" in value)
            return self.text(value, path)
        return _Estimate(len(str(value)), 0, False)

    def text(self, text: str, path: tuple[Any, ...]) -> _Estimate:
        from omegaconf.errors import GrammarParseError
        from omegaconf.grammar_parser import parse

        try:
            tree = parse(text)
        except GrammarParseError:  # omegaconf words the syntax error when it resolves
            return _Estimate(len(text), 0, True)
        estimate = self.parsed(tree, path)
        if estimate.size > MAX_RESOLVED_CHARS:
            raise _Refused(f"its ${{...}} interpolations expand to {estimate.size} characters, more than the "
                           f"{MAX_RESOLVED_CHARS} a resolved value may hold", path=path)
        if estimate.steps > MAX_RESOLUTION_STEPS:
            raise _Refused(f"resolving its ${{...}} interpolations takes {estimate.steps} lookups, more than "
                           f"the {MAX_RESOLUTION_STEPS} a spec may take", path=path)
        return estimate

    def parsed(self, ctx: Any, path: tuple[Any, ...]) -> _Estimate:
        """A parse-tree context: terminals count as written, interpolations as what they resolve to."""
        from antlr4 import TerminalNode
        from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as P

        if isinstance(ctx, TerminalNode):
            text = ctx.symbol.text if ctx.symbol.type != -1 else ""
            return _Estimate(len(text), 0, "$" in text)
        if isinstance(ctx, P.InterpolationNodeContext):
            return self.reference(ctx, path)
        if isinstance(ctx, P.InterpolationResolverContext):
            return self.resolver(ctx, path)
        total = _Estimate(0, 0, False)
        for child in ctx.getChildren():
            total = _add(total, self.parsed(child, path), 0)
        return total

    def reference(self, ctx: Any, path: tuple[Any, ...]) -> _Estimate:
        from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as P

        if any(isinstance(key, P.ConfigKeyContext) and isinstance(key.getChild(0), P.InterpolationContext)
               for key in ctx.getChildren()):
            raise _Refused(f"{ctx.getText()} builds its key with an interpolation, whose expansion cannot be "
                           "bounded before resolving", "write the key out")
        key = ctx.getText()[2:-1]
        found = self.node(self.target(key, path))
        return _Estimate(found.size, found.steps + 1, found.dollar)

    def resolver(self, ctx: Any, path: tuple[Any, ...]) -> _Estimate:
        from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as P

        name_ctx = ctx.getChild(1)
        if any(isinstance(child, P.InterpolationContext) for child in name_ctx.getChildren()):
            raise _Refused(f"{ctx.getText()} builds a resolver name with an interpolation", "write the name out")
        name = name_ctx.getText()
        args: list[tuple[Any, _Estimate]] = []
        sequence = ctx.getChild(3)
        if isinstance(sequence, P.SequenceContext):
            for child in sequence.getChildren():
                if isinstance(child, P.ElementContext):
                    args.append((child, self.parsed(child, path)))
        inputs = _Estimate(0, 1, False)
        for _, estimate in args:
            inputs = _add(inputs, estimate, 0)
        static = [_static_text(element) for element, _ in args]
        if name == "oc.env" and static and static[0] is not None:
            found = os.environ.get(static[0])
            if found is not None:
                return _Estimate(len(found), inputs.steps, "$" in found)
            return inputs
        if name in ("oc.select", "oc.dict.keys", "oc.dict.values", "oc.deprecated") and static \
                and static[0] is not None:
            target = self.target(static[0], path)
            if self.lookup(target) is not _ABSENT:
                found = self.node(target)
                return _Estimate(found.size + inputs.size, found.steps + inputs.steps, found.dollar or inputs.dollar)
            return inputs
        if name in ("oc.decode", "oc.create"):
            if name == "oc.create" and any(isinstance(element.getChild(0), (P.PrimitiveContext, P.QuotedValueContext))
                                           for element, _ in args):
                raise _Refused(f"{ctx.getText()} creates a value from text, which is parsed outside the spec's "
                               "size caps", "write the mapping or list itself")
            if inputs.dollar:
                raise _Refused(f"{ctx.getText()} decodes text that may hold '$', so it could make interpolations "
                               "whose expansion cannot be bounded before resolving", "write the value itself")
        return inputs


def _add(total: _Estimate, part: _Estimate, extra: int) -> _Estimate:
    return _Estimate(total.size + part.size + extra, total.steps + part.steps, total.dollar or part.dollar)


def _static_text(element: Any) -> str | None:
    """An argument's text when it holds no interpolation (quotes dropped), else None."""
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as P

    stack = [element]
    while stack:
        ctx = stack.pop()
        if isinstance(ctx, P.InterpolationContext):
            return None
        if hasattr(ctx, "getChildren"):
            stack.extend(ctx.getChildren())
    text = element.getText()
    return text[1:-1] if isinstance(element.getChild(0), P.QuotedValueContext) else text


def check_budget(cfg: DictConfig) -> None:
    """Refuse (``SpecError`` naming the key) a tree whose interpolations would expand past the caps
    of this module, before anything resolves them."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)
    budget = _Budget(tree)
    total = _Estimate(0, 0, False)
    stack: list[tuple[Any, ...]] = [()]
    while stack:
        path = stack.pop()
        value = budget.lookup(path)
        if isinstance(value, dict):
            stack.extend((*path, key) for key in value)
            total = _Estimate(total.size + sum(len(str(key)) for key in value), total.steps, False)
            continue
        if isinstance(value, list):
            stack.extend((*path, index) for index in range(len(value)))
            continue
        try:
            estimate = budget.node(path)
        except _Refused as exc:
            where = exc.path if exc.path is not None else path
            raise SpecError([SpecIssue(dotted(where), exc.message, exc.remedy)]) from None
        total = _add(total, estimate, 0)
        if total.size > MAX_SPEC_RESOLVED_CHARS:
            raise too_large(dotted(path), total.size, MAX_SPEC_RESOLVED_CHARS,
                            "the whole resolved spec (up to this key)")
        if total.steps > MAX_RESOLUTION_STEPS:
            raise SpecError([SpecIssue(dotted(path), f"resolving the spec's ${{...}} interpolations up to this key "
                                                     f"takes {total.steps} lookups, more than the "
                                                     f"{MAX_RESOLUTION_STEPS} a spec may take", REMEDY)])
