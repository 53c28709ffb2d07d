"""Spec errors: each names a dotted path, what is wrong and what to do; they travel together.

A module of its own, below every layer that reports a problem in a spec: loading it
(``relax.config``), checking it (``relax.spec``), finding its plugins (``relax.registry``) and
planning it (``relax.plan``) all raise these, and none of them has to import another for that.
``relax.errors.translate`` turns pydantic's validation errors (a spec's or a plugin's ``Config``)
into these.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


def override(key: str, value: Any) -> str:
    """One command-line override, ``key=value``, its value written as the override grammar reads
    it back: ``true``/``false``, ``null``, numbers as Python writes them, text as it is. ``key``
    may be an issue's path: list indices (``rewards[0].name``) become the grammar's ``rewards.0.name``."""
    key = re.sub(r"\[(\d+)\]", r".\1", key)
    return f"{key}={_value_text(value)}"


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    return str(value)


def deletion(key: str) -> str:
    """The override that deletes a key (``~data.media_keys.video``), leaving its default."""
    return "~" + re.sub(r"\[(\d+)\]", r".\1", key)


def overrides(**changes: Any) -> tuple[str, ...]:
    """``override`` for each keyword, with ``__`` standing for a dot: ``overrides(algorithm__kl_coef=0)``
    is ``("algorithm.kl_coef=0",)``."""
    return tuple(override(key.replace("__", "."), value) for key, value in changes.items())


def fix_text(fix: Iterable[str]) -> str:
    """A fix as the command line takes it: its overrides, space-separated."""
    return " ".join(fix)


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a run spec.

    ``path`` is dotted with list indices in brackets (``rewards[0].options.target``); an empty path
    means the spec as a whole (or the command line).
    """

    path: str
    message: str
    remedy: str = ""
    """What to do, in words (a remedy that is no change to the spec, such as installing a package,
    is only this)."""
    fix: tuple[str, ...] = ()
    """The remedy as command-line overrides (``key=value``, the grammar of ``relax.config.overrides``)
    that, added to the command line, make this problem go away without bringing another; empty when
    the remedy is no single change to the spec."""

    def __str__(self) -> str:
        text = self.described()
        return f"{text} (fix: {fix_text(self.fix)})" if self.fix else text

    def described(self) -> str:
        """Where, what and the remedy in words, without the fix."""
        where = self.path or "<spec>"
        text = f"{where}: {self.message}"
        return f"{text}; {self.remedy}" if self.remedy else text


class SpecError(Exception):
    """Every problem found in a spec, raised once with all of them (exit code 2 in the CLI)."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = sorted(set(issues), key=lambda i: (i.path, i.message))
        super().__init__(self.render())

    def render(self, command: Sequence[str] | None = None) -> str:
        """Every issue, one a line. ``command``: the command line that met them, as its words
        (``relax validate tiny-cpu placement.mode=colocate``: the program, the command, the spec,
        then its overrides); an issue with a fix is then followed by that command line with the
        fix's overrides in place of any that set the same keys, to copy as it is."""
        count = len(self.issues)
        lines = [f"{count} problem{'s' if count != 1 else ''} in the run spec:"]
        for issue in self.issues:
            if command is None or not issue.fix:
                lines.append(f"  - {issue}")
            else:
                lines += [f"  - {issue.described()}", f"    fix: {command_with_fix(command, issue.fix)}"]
        return "\n".join(lines)


def override_key(item: str) -> str:
    """The key an override sets or deletes (``+a.b=1`` -> ``a.b``)."""
    return item.lstrip("+~").partition("=")[0]


def command_with_fix(command: Sequence[str], fix: Iterable[str]) -> str:
    """``command`` (program, command, spec, overrides...) with ``fix`` added after its overrides,
    leaving out those of its overrides that set a key the fix sets (a key the fix deletes keeps
    them: the deletion, after them, removes what the file or they set); quoted for a POSIX shell."""
    fix = list(fix)
    keys = {override_key(item) for item in fix if not item.startswith("~")}
    head, given = list(command[:3]), list(command[3:])
    kept = [item for item in given if override_key(item) not in keys]
    return " ".join(shlex.quote(word) for word in [*head, *kept, *fix])


def join_path(*parts: str | int) -> str:
    """Join path parts: names with dots, integers as ``[i]`` (``rewards[0].name``)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "":
            out += f".{part}" if out else str(part)
    return out
