"""Issue 20's first-week case: a spec that ``extends: tiny-cpu`` and names the user's own data file
validates and runs with no override tricks (the preset's ``options: {size: 4096}`` were the
synthetic data set's and are dropped with it: ``relax.config.loader.merge_child``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import testing


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def test_extends_tiny_cpu_with_a_jsonl_file_of_ones_own_runs(local_ray, tmp_path: Path) -> None:
    folder = tmp_path / "project"  # the data beside the spec, not in the working folder
    folder.mkdir()
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (folder / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = folder / "mine.yaml"
    spec.write_text("extends: tiny-cpu\nname: mine\n"
                    "data:\n  train: {source: sums.jsonl}\n  prompt_key: question\n")
    code, metrics, _ = testing.tiny_run(tmp_path, "mine", "trainer.steps=2", "algorithm.prompts_per_step=4",
                                        "algorithm.samples_per_prompt=2", preset=str(spec))
    assert code == 0
    assert [row["step"] for row in metrics] == [1, 2]
    assert all("reward/mean" in row for row in metrics), json.dumps(metrics[0])[:300]
