"""Which checkpoint a resume starts from: never one past the last metrics row, so no step's row
goes missing when the driver died between the actor's checkpoint and the step's row."""

from __future__ import annotations

import json
from pathlib import Path

from relax.runtime.checkpoint import META, checkpoint_root, resume_checkpoint


def make_run(folder: Path, checkpoints: list[int], rows: list[int], torn_last_row: bool = False) -> Path:
    for step in checkpoints:
        path = checkpoint_root(folder) / f"step-{step}"
        path.mkdir(parents=True)
        (path / META).write_text(json.dumps({"step": step}))
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s}) + "\n" for s in rows)
    (folder / "metrics.jsonl").write_text(text + ('{"step": 9' if torn_last_row else ""))
    return folder


def test_a_checkpoint_past_the_last_row_is_passed_over(tmp_path: Path) -> None:
    # the driver died after the actor saved step 6 and before it wrote row 6
    run = make_run(tmp_path, checkpoints=[4, 6], rows=[1, 2, 3, 4, 5])
    assert resume_checkpoint(run)[0] == 4


def test_the_newest_checkpoint_with_its_row_is_taken(tmp_path: Path) -> None:
    run = make_run(tmp_path, checkpoints=[4, 6], rows=[1, 2, 3, 4, 5, 6, 7], torn_last_row=True)
    assert resume_checkpoint(run)[0] == 6


def test_without_a_covered_checkpoint_none_unless_there_are_no_metrics(tmp_path: Path) -> None:
    # no checkpoint has its row: resuming from one would leave rows out, so the run starts over
    assert resume_checkpoint(make_run(tmp_path / "a", checkpoints=[6], rows=[1, 2])) is None
    assert resume_checkpoint(make_run(tmp_path / "b", checkpoints=[2], rows=[])) is None
    assert resume_checkpoint(make_run(tmp_path / "c", checkpoints=[], rows=[1])) is None
    # a folder without metrics.jsonl: nothing to keep whole, the newest checkpoint
    folder = make_run(tmp_path / "d", checkpoints=[2, 6], rows=[])
    (folder / "metrics.jsonl").unlink()
    assert resume_checkpoint(folder)[0] == 6


def test_the_last_row_is_found_from_the_end_of_a_long_file(tmp_path: Path) -> None:
    """Rows far longer than the first tail read, a torn last row and garbage before the rows: the
    step is the last complete row's, as a full parse would say."""
    from relax.runtime.checkpoint import last_metrics_step

    pad = "x" * 50_000
    rows = "".join(json.dumps({"step": s, "pad": pad}) + "\n" for s in range(1, 9))
    (tmp_path / "metrics.jsonl").write_text("not json\n" + rows + '{"step": 9, "pad": "' + pad)
    assert last_metrics_step(tmp_path) == 8
    (tmp_path / "metrics.jsonl").write_text("not json\n" + '{"pad": 1}\n' + "x" * 300_000)
    assert last_metrics_step(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}')
    assert last_metrics_step(tmp_path) == 3
