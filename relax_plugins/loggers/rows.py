"""How a metrics row is split for a tracker: numbers become scalars, strings become text.

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
