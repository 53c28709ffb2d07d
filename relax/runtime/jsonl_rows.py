"""The run folder's jsonl files of step rows (``metrics.jsonl``, ``eval.jsonl``, ``samples.jsonl``),
read back whole.

Each file is appended one row per line while a run goes on, so a crash or a full disk can leave its
last line cut short; readers skip such a line rather than fail, and the next write (or a resume)
carries on after the last whole row. One parser serves every such file, so they all agree on what a
whole row is. Standard library only: ``relax samples`` and ``relax plan``'s readers need no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse_rows(text: str) -> list[dict[str, Any]]:
    """The whole JSON rows of jsonl ``text`` that have a ``step`` (made an int); a line cut short by
    a crash, or one without a step, is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
            row["step"] = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        rows.append(row)
    return rows


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The whole rows of the jsonl file at ``path`` (``parse_rows``)."""
    return parse_rows(Path(path).read_text(errors="replace"))
