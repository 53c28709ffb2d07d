"""Helpers for testing plugins and runs end to end: the tiny preset with overrides, on a local Ray.

A plugin author checks a reward, a backend or an estimator in a real run with three lines::

    with local_ray():
        code, rows, printed = tiny_run(tmp_path, "my-reward", "rewards=[{name: my_reward}]")
    assert code == 0 and rows[-1]["reward/mean"] > 0

It imports ray and the runtime when called, never at import time.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Logical CPUs of a test Ray: TransferQueue's own actors need about 5 beyond the roles.
TEST_RAY_CPUS = 8


@contextlib.contextmanager
def local_ray(**options: Any) -> Iterator[None]:
    """A fresh local Ray for the block (runs inside it start and close their own bus and workers)."""
    import ray

    ray.init(address="local", num_cpus=TEST_RAY_CPUS, include_dashboard=False, log_to_driver=False, **options)
    try:
        yield
    finally:
        ray.shutdown()


def tiny_spec(out_dir: Path, name: str, *overrides: str, preset: str = "tiny-cpu") -> tuple[Any, Any, Path]:
    """``(spec, plan, base_dir)`` of a preset (3 steps, no tracing, output under ``out_dir/name``)
    with dotted ``overrides`` applied after those defaults."""
    from relax.config import load_spec_dict
    from relax.plan import make_plan
    from relax.spec import validate_spec

    raw, base = load_spec_dict(preset, [f"name={name}", f"trainer.output_dir={Path(out_dir) / name}",
                                        "trainer.steps=3", "tracing.exporter=none", *overrides])
    spec = validate_spec(raw, base_dir=base)
    return spec, make_plan(spec, base_dir=base), base


def tiny_run(out_dir: Path, name: str, *overrides: str, resume: bool = False,
             preset: str = "tiny-cpu") -> tuple[int, list[dict[str, Any]], str]:
    """Run a preset with overrides: ``(exit code, metrics.jsonl rows, progress printed)``."""
    from relax.runtime.launch import run_spec

    spec, plan, base = tiny_spec(out_dir, name, *overrides, preset=preset)
    out = io.StringIO()
    code = run_spec(spec, plan, base_dir=base, resume=resume, stream=out)
    metrics = Path(out_dir) / name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, rows, out.getvalue()
