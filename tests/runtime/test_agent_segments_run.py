"""Segments trained, in a live ``relax run`` of the tiny agent preset behind the gateway (real local
Ray, the real TransferQueue bus, separate mode: the rows travel through the bus and the ledger): a
program that summarizes its history at its third call makes two segments per trajectory, and every
step trains both rows of each of its 128 trajectories, each sample counted once.

In the faults lane (``nox -s faults``), beside the other live gateway runs: about a minute."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_agent_run import local_ray, run  # noqa: F401 - the module's Ray fixture

pytestmark = [pytest.mark.faults, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_a_program_that_summarizes_trains_both_segments_of_every_trajectory(local_ray, tmp_path: Path) -> None:  # noqa: F811
    code, rows, printed = run(tmp_path, "segments", "trainer.steps=2", "roles.rollout.agent.environment=null",
                              "roles.rollout.agent.gateway.program=tests.agents.segment_programs:summarizes_at_turn_3")
    assert code == 0 and len(rows) == 2, printed
    for row in rows:
        assert row["agent/failed"] == 0 and row["agent/segments_mean"] == 2.0, row
        # 128 samples a step, each trained once, in two rows (the trainer saw 256 sequences); the
        # ledger counts samples too (the rollout may be a step ahead: max_staleness 1), not rows
        assert row["samples/consumed"] == 128 * row["step"]
        assert row["samples/produced"] in (128 * row["step"], 128 * min(row["step"] + 1, len(rows)))
        assert row["train/tokens"] > 0
