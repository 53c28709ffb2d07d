"""Run the tiny CPU preset from a bench script and return its metrics rows (shared by the benches)."""

from __future__ import annotations

from pathlib import Path

from relax.testing import tiny_run


def run_tiny(name: str, root: Path, overrides: list[str]) -> list[dict]:
    """Train the tiny preset with ``overrides`` under ``root/name``; the rows of its metrics.jsonl.
    The benches keep the preset's steps and tracing unless ``overrides`` change them."""
    code, rows, printed = tiny_run(root, name, "trainer.steps=60", "tracing.exporter=jsonl",
                                   "trainer.checkpoint_every=0", *overrides)
    if code != 0:
        raise SystemExit(f"the {name} run failed (exit {code}):\n{printed[-2000:]}")
    return rows
