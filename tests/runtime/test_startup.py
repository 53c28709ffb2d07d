"""The start-up clock: phases add up to the time since the process started, in order, and stop at
the first step."""

from __future__ import annotations

import json
import time

import pytest

from relax.runtime.startup import PHASES, StartupClock


def test_phases_split_the_time_since_the_start_and_stop_at_the_first_step(tmp_path) -> None:
    clock = StartupClock(time.time() - 2.0)  # the process started 2 s ago
    clock.mark("imports")
    time.sleep(0.05)
    clock.mark("ray")
    clock.mark("first_step")
    total = clock.total_s
    assert clock.phases["imports"] >= 2.0 and clock.phases["ray"] >= 0.05
    time.sleep(0.02)
    clock.mark("workers")  # a resume's start-up after the first step is not counted
    assert clock.total_s == total and "workers" not in clock.phases
    assert clock.line().startswith(f"start-up: {total:.1f} s to the first step (imports ")
    clock.write(tmp_path)
    record = json.loads((tmp_path / "startup.json").read_text())
    assert list(record["phases_s"]) == ["imports", "ray", "first_step"]


def test_a_run_that_ends_before_a_step_says_so_and_unknown_phases_are_refused() -> None:
    clock = StartupClock()
    clock.mark("imports")
    assert "no step finished" in clock.line()
    with pytest.raises(ValueError, match="unknown start-up phase 'warmup'"):
        clock.mark("warmup")
    assert PHASES[0] == "imports" and PHASES[-1] == "first_step"
