"""How a metrics row is split for a tracker: numbers become scalars, strings become text.

Samples (``trainer.log_samples_every``) are a few rows of texts and rewards: a table
(``sample_table``) or Markdown (``samples_markdown``).

A row of ``metrics.jsonl`` holds numbers (most keys) and a few strings (``data/order``,
``samples/trained_hash``). Trackers plot numbers; strings are kept as text (TensorBoard text,
wandb history strings, MLflow tags). ``None`` (a value a step did not have) is left out, and
lists or mappings are kept as their JSON text, so no key is dropped without a reason.
"""

from __future__ import annotations

import json
from typing import Any


def split_row(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """``(scalars, texts)`` of a metrics row: ints, floats and bools as floats (NaN and infinities
    kept: a tracker shows a diverged loss as it is), strings as they are, lists and mappings as
    JSON; ``None`` values are skipped."""
    scalars: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, (bool, int, float)):
            scalars[key] = float(value)
        elif isinstance(value, str):
            texts[key] = value
        else:
            texts[key] = json.dumps(value, sort_keys=True, default=str)
    return scalars, texts


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested mapping as ``{"a.b.c": "value"}`` strings (how MLflow keeps a run's parameters)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def sample_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, data)`` of a sampled step's rows as one table: every key any row has, in the
    order they first appear; numbers and strings as they are, lists and mappings as JSON, a key a
    row lacks as None (an agentic key in a plain row, a reward the row was not routed to)."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    data = [[_cell(row.get(key)) for key in columns] for row in rows]
    return columns, data


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def samples_markdown(step: int, rows: list[dict[str, Any]]) -> str:
    """A sampled step's rows as Markdown (TensorBoard renders text summaries as Markdown): one
    heading per row with its rewards, then each text in a code block, as written."""
    parts = []
    for i, row in enumerate(rows, 1):
        figures = ", ".join(f"{key} {value:.4g}" for key, value in row.items()
                            if key.startswith("reward") and isinstance(value, (int, float)))
        parts.append(f"### step {step}, sample {i} ({row.get('sample_id')}, policy v{row.get('policy_version')}): "
                     f"{figures}")
        if "outcome" in row:
            parts.append(f"outcome: **{row['outcome']}**, {row.get('turns')} turn(s), "
                         f"{row.get('tool_calls')} tool call(s)")
        for key in ("prompt", "response", "label", "calls", "observations"):
            value = row.get(key)
            if value in (None, []):
                continue
            text = value if isinstance(value, str) else json.dumps(value, indent=1, default=str)
            fence = "````" if "```" in text else "```"  # a fence longer than any the text holds
            parts.append(f"**{key}**\n\n{fence}\n{text}\n{fence}")
    return "\n\n".join(parts)
