"""Run the tiny CPU preset from a bench script and return its metrics rows (shared by the benches)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from relax.config import load_spec_dict
from relax.plan import make_plan
from relax.runtime.launch import run_spec
from relax.spec import validate_spec


def run_tiny(name: str, root: Path, overrides: list[str]) -> list[dict]:
    """Train the tiny preset with ``overrides`` under ``root/name``; the rows of its metrics.jsonl."""
    raw, base = load_spec_dict("tiny-cpu", [f"name={name}", f"trainer.output_dir={root / name}",
                                            "trainer.checkpoint_every=0", *overrides])
    spec = validate_spec(raw, base_dir=base)
    code = run_spec(spec, make_plan(spec, base_dir=base), base_dir=base, stream=sys.stderr)
    if code != 0:
        raise SystemExit(f"the {name} run failed (exit {code})")
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
