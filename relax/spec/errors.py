"""Spec errors: each names a dotted path, what is wrong and what to do; they travel together."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a run spec.

    ``path`` is dotted with list indices in brackets (``rewards[0].options.target``); an empty path
    means the spec as a whole (or the command line).
    """

    path: str
    message: str
    remedy: str = ""

    def __str__(self) -> str:
        where = self.path or "<spec>"
        text = f"{where}: {self.message}"
        return f"{text}; {self.remedy}" if self.remedy else text


class SpecError(Exception):
    """Every problem found in a spec, raised once with all of them (exit code 2 in the CLI)."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = sorted(set(issues), key=lambda i: (i.path, i.message))
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.issues)
        head = f"{count} problem{'s' if count != 1 else ''} in the run spec:"
        return "\n".join([head, *(f"  - {issue}" for issue in self.issues)])


def join_path(*parts: str | int) -> str:
    """Join path parts: names with dots, integers as ``[i]`` (``rewards[0].name``)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "":
            out += f".{part}" if out else str(part)
    return out
