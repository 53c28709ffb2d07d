"""Checkpoints: written into a temporary folder and renamed into place, so a crash never leaves a
half-written one that ``--resume`` would pick up.

``<output_dir>/checkpoints/step-<n>/`` holds the trainer's own state (model and optimizer, via the
plugin's ``save``) and ``meta.json`` (the step; the data position and the sampling seeds are pure
functions of the step, see ``relax.runtime.worker.data``). The built-in trainers' ``trainer/`` folder is a
Hugging Face model folder, so ``AutoModelForCausalLM.from_pretrained(".../step-<n>/trainer")``
loads it.

``<output_dir>/export/step-<n>/`` (``trainer.export_every``) is the model alone, for people and
other tools: the checkpoint's ``trainer/`` folder without the training state (optimizer, trainer
state), hard-linked from the checkpoint of the same step when there is one (no second write),
else written by the trainer's ``save``. Both are readable by others (folders 0755, files 0644): a
temporary folder is created 0700, which would hide them from anyone but their writer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from relax.runtime.failure_class import as_disk_full

CHECKPOINTS = "checkpoints"
EXPORT = "export"
META = "meta.json"
#: Files of the built-in trainers' ``save`` folder that are training state, not the model: an
#: export leaves them out (``sharded``: a sharded torch trainer's model and optimizer shards).
TRAINING_STATE_FILES = frozenset({"optimizer.pt", "trainer_state.json", "sharded"})
FOLDER_MODE, FILE_MODE = 0o755, 0o644


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names its file and what to do."""


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
        open_permissions(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except Exception as exc:
        full = as_disk_full(exc, staging, f"the checkpoint of step {step}")
        if full is not None:
            raise full from exc
        raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    for old in checkpoints_to_remove(list_checkpoints(output_dir), keep, last_metrics_step(output_dir)):
        shutil.rmtree(old, ignore_errors=True)
    return final


def open_permissions(folder: Path) -> None:
    """Make a written folder readable by others: folders 0755, files 0644 (a ``tempfile.mkdtemp``
    folder is 0700)."""
    folder.chmod(FOLDER_MODE)
    for parent, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(parent, name), FOLDER_MODE)
        for name in files:
            os.chmod(os.path.join(parent, name), FILE_MODE)


def export_model(output_dir: Path, step: int, trainer: Any, checkpoint: Path | None = None) -> Path | None:
    """Write ``<output_dir>/export/step-<step>/``: the model in ``save_pretrained`` layout with its
    tokenizer or processor, and no training state. With ``checkpoint`` (this step's, just written)
    its ``trainer/`` files are hard-linked (copied where links are refused); else the trainer's
    ``save`` writes them. A LoRA run's export is the PEFT adapter folder (what its checkpoint holds),
    plus ``merged/`` (the merged model) when the adapter's ``export_merged`` is on. Atomic like a checkpoint. Every rank
    of a trainer calls it (``save`` may
    be collective); None on a rank where ``save`` wrote nothing (only rank 0 writes)."""
    root = output_dir / EXPORT
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    staging = Path(tempfile.mkdtemp(prefix=f".step-{step}.", dir=root))
    try:
        source = checkpoint / "trainer" if checkpoint is not None else None
        if source is None or not source.is_dir():
            trainer.save(str(staging / "saved"))
            source = staging / "saved"
            if not source.is_dir():
                return None
        model = staging / "model"
        model.mkdir()
        for path in sorted(source.rglob("*")):
            rel = path.relative_to(source)
            if rel.parts[0] in TRAINING_STATE_FILES:
                continue
            if path.is_dir():
                (model / rel).mkdir(parents=True, exist_ok=True)
                continue
            (model / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, model / rel)
            except OSError:  # another file system, or links not allowed
                shutil.copy2(path, model / rel)
        merged = getattr(trainer, "save_merged_model", None)  # a LoRA adapter's export_merged: merged/ beside it
        if merged is not None:
            merged(str(model / "merged"))
        open_permissions(model)
        if final.exists():
            shutil.rmtree(final)
        os.replace(model, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def checkpoints_to_remove(found: list[tuple[int, Path]], keep: int, last_row: int | None) -> list[Path]:
    """All but the newest ``keep`` checkpoints, except the newest one whose step already has its
    metrics row: the actor saves a step before the driver writes its row (and may save several
    before a slow or dying driver catches up), and ``resume_checkpoint`` resumes only from a step
    with its row, so removing that one could leave a resume nothing to start from but step 0."""
    covered = [c for c in found if last_row is not None and c[0] <= last_row]
    spare = covered[-1][1] if covered else None
    return [path for _, path in found[:-keep] if path != spare]


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first; ``CheckpointError`` for one whose ``meta.json`` is not
    what ``save_checkpoint`` wrote."""
    root = checkpoint_root(output_dir)
    found = []
    if root.is_dir():
        for path in root.glob("step-*"):
            if (path / META).is_file():
                found.append((read_step(path / META), path))
    return sorted(found)


def read_step(meta: Path) -> int:
    """The step a checkpoint's ``meta.json`` records (``CheckpointError`` naming the file when it
    is unreadable, not JSON, or has no whole ``step``)."""
    remedy = (f"remove the folder {meta.parent} to resume from an older checkpoint, or run without --resume "
              "to start fresh")
    try:
        value = json.loads(meta.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"checkpoint file {meta} is corrupt ({type(exc).__name__}: {exc}); {remedy}") from None
    step = value.get("step") if isinstance(value, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint file {meta} has no step count (\"step\": {step!r}); {remedy}")
    return step


def resume_checkpoint(output_dir: Path) -> tuple[int, Path] | None:
    """The checkpoint a resume starts from: the newest one whose step already has its row in
    ``metrics.jsonl``. The actor saves a step's checkpoint just before it reports the step, and the
    driver writes the row once every role has reported; a driver that dies in between leaves a
    checkpoint past the last row, and resuming from it would leave those steps' rows out for good.
    None when no checkpoint has its row (the run starts over, so that every step has one row); the
    newest when the run folder has no ``metrics.jsonl`` at all (nothing to keep whole)."""
    found = list_checkpoints(output_dir)
    if not (output_dir / "metrics.jsonl").is_file():
        return found[-1] if found else None
    last = last_metrics_step(output_dir)
    covered = [c for c in found if last is not None and c[0] <= last]
    return covered[-1] if covered else None


def last_metrics_step(output_dir: Path) -> int | None:
    """The step of the last complete row of ``metrics.jsonl`` (a row cut short by a crash is not
    one), or None."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    # Read from the end, a growing tail at a time: the actor asks at every checkpoint, and a long
    # run's file holds a row per step (parsing all of it made each save slower than the last).
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        tail = 1 << 16
        while True:
            start = max(0, size - tail)
            f.seek(start)
            lines = f.read(size - start).split(b"\n")
            if start > 0:
                lines = lines[1:]  # may begin mid-row
            for line in reversed(lines):
                try:
                    return int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue
            if start == 0:
                return None
            tail *= 4


def restore_rng(path: Path) -> None:
    import torch

    meta = json.loads((path / META).read_text())
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
