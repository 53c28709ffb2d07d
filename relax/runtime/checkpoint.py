"""Checkpoints: written into a temporary folder and renamed into place, so a crash never leaves a
half-written one that ``--resume`` would pick up.

``<output_dir>/checkpoints/step-<n>/`` holds the trainer's own state (model and optimizer, via the
plugin's ``save``) and ``meta.json`` (the step; the data position and the sampling seeds are pure
functions of the step, see ``relax.runtime.data``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
META = "meta.json"


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / CHECKPOINTS


def save_checkpoint(output_dir: Path, step: int, trainer: Any, keep: int) -> Path:
    """Write the checkpoint of ``step`` (steps done) atomically; keep the newest ``keep``."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    staging = Path(tempfile.mkdtemp(prefix=f".step-{step}.", dir=root))
    try:
        import torch  # here, not at import: ``relax run`` reads checkpoints before it imports torch

        trainer.save(str(staging / "trainer"))
        meta = {"step": step, "time": time.time(), "torch_rng": torch.get_rng_state().tolist()}
        (staging / META).write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old[1], ignore_errors=True)
    return final


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    found = []
    if root.is_dir():
        for path in root.glob("step-*"):
            if (path / META).is_file():
                found.append((json.loads((path / META).read_text())["step"], path))
    return sorted(found)


def resume_checkpoint(output_dir: Path) -> tuple[int, Path] | None:
    """The checkpoint a resume starts from: the newest one whose step already has its row in
    ``metrics.jsonl``. The actor saves a step's checkpoint just before it reports the step, and the
    driver writes the row once every role has reported; a driver that dies in between leaves a
    checkpoint one step past the last row, and resuming from it would leave that step's row out for
    good. Without such a checkpoint (no metrics yet, or older ones removed), the newest."""
    found = list_checkpoints(output_dir)
    last = last_metrics_step(output_dir)
    covered = [c for c in found if last is not None and c[0] <= last]
    return (covered or found or [None])[-1]


def last_metrics_step(output_dir: Path) -> int | None:
    """The step of the last complete row of ``metrics.jsonl`` (a row cut short by a crash is not
    one), or None."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text().splitlines():
        try:
            last = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return last


def restore_rng(path: Path) -> None:
    import torch

    meta = json.loads((path / META).read_text())
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
