"""The start-up clock: phases add up to the time since the process started, in order, and stop at
the first step; parts that ran at once are kept with their own start and end and said to overlap;
the shutdown runs from the last step to the end. Work started in the background hands back its
value or its exception."""

from __future__ import annotations

import json
import threading
import time

import pytest

from relax.runtime.driver.controller import bus_fits_beside
from relax.runtime.startup import PARTS, PHASES, InBackground, StartupClock


def test_phases_split_the_time_since_the_start_and_stop_at_the_first_step(tmp_path) -> None:
    clock = StartupClock(time.time() - 2.0)  # the process started 2 s ago
    clock.mark("imports")
    time.sleep(0.05)
    clock.mark("ray")
    clock.step_finished()
    total = clock.total_s
    assert clock.phases["imports"] >= 2.0 and clock.phases["ray"] >= 0.05
    time.sleep(0.02)
    clock.mark("launch")  # a resume's start-up after the first step is not counted
    clock.part("workers", time.time() - 0.01)
    assert clock.total_s == total and "launch" not in clock.phases and "workers" not in clock.parts
    assert clock.line().startswith(f"start-up: {total:.1f} s to the first step (imports ")
    clock.write(tmp_path)
    record = json.loads((tmp_path / "startup.json").read_text())
    assert list(record["phases_s"]) == ["imports", "ray", "first_step"]
    assert record["shutdown_s"] is None  # the run has not stopped yet


def test_a_run_that_ends_before_a_step_says_so_and_unknown_phases_are_refused() -> None:
    clock = StartupClock()
    clock.mark("imports")
    clock.stopped()
    assert "no step finished" in clock.line() and "shutdown" not in clock.line()
    with pytest.raises(ValueError, match="unknown start-up phase 'warmup'"):
        clock.mark("warmup")
    with pytest.raises(ValueError, match="unknown start-up part 'warmup'"):
        clock.part("warmup", time.time())
    assert PHASES[0] == "imports" and PHASES[-1] == "first_step"
    assert set(PARTS.values()) <= set(PHASES)


def test_parts_keep_their_own_times_and_the_line_says_whether_the_bus_ran_beside_the_workers(tmp_path) -> None:
    t0 = time.time() - 10.0
    beside = StartupClock(t0)
    beside.mark("imports")
    beside.mark("ray")
    beside.part("runtime_imports", t0 + 1.0, t0 + 3.0)
    beside.part("bus", t0 + 4.0, t0 + 9.0)
    beside.part("placement", t0 + 4.0, t0 + 4.5)
    beside.part("workers", t0 + 4.5, t0 + 9.5)
    beside.mark("launch")
    beside.step_finished()
    assert "ray 0.0 [runtime imports 2.0 alongside]" in beside.line()
    assert "launch" in beside.line() and "[bus 5.0 alongside placement 0.5, workers 5.0]" in beside.line()
    beside.write(tmp_path)
    parts = json.loads((tmp_path / "startup.json").read_text())["parts"]
    assert parts["bus"] == {"phase": "launch", "start_s": pytest.approx(4.0), "end_s": pytest.approx(9.0),
                            "s": pytest.approx(5.0)}
    assert parts["runtime_imports"]["phase"] == "ray"

    first = StartupClock(t0)
    first.part("bus", t0 + 4.0, t0 + 9.0)
    first.part("placement", t0 + 9.0, t0 + 9.5)
    first.part("workers", t0 + 9.5, t0 + 14.0)
    first.mark("launch")
    assert "[bus 5.0 then placement 0.5, workers 4.5]" in first.line()


def test_the_shutdown_runs_from_the_last_step_to_the_stop(tmp_path) -> None:
    clock = StartupClock()
    clock.mark("launch")
    clock.step_finished()
    time.sleep(0.05)
    clock.step_finished()  # later steps move the start of the shutdown
    time.sleep(0.05)
    clock.stopped()
    assert 0.05 <= clock.shutdown_s < 0.1 + 0.5
    assert clock.line().endswith(f"; shutdown {clock.shutdown_s:.1f} s")
    clock.write(tmp_path)
    assert json.loads((tmp_path / "startup.json").read_text())["shutdown_s"] == pytest.approx(clock.shutdown_s)


def test_background_work_hands_back_its_value_or_its_exception_and_is_recorded_as_a_part() -> None:
    clock = StartupClock()
    release = threading.Event()
    work = InBackground(lambda: release.wait(5) and 42, name="test", clock=clock, part="bus")
    assert not work.finished and work.failed is None
    with pytest.raises(TimeoutError, match="relax-test did not finish within 0.05 s"):
        work.result(timeout_s=0.05)
    release.set()
    assert work.result() == 42 and work.finished and work.failed is None
    start, end = clock.parts["bus"]
    assert 0 <= start <= end

    def broken() -> None:
        raise RuntimeError("no bus today")

    failing = InBackground(broken, name="broken")
    with pytest.raises(RuntimeError, match="no bus today"):
        failing.result()
    assert isinstance(failing.failed, RuntimeError)


def test_the_bus_starts_beside_the_workers_only_where_both_fit_on_one_node() -> None:
    # the embedded Ray of the tiny preset: 8 logical CPUs, 2 reserved by the plan, 2 for the bus
    assert bus_fits_beside(nodes=1, free_cpus=8, reserved_cpus=2, bus_cpus=2)
    assert bus_fits_beside(nodes=1, free_cpus=4, reserved_cpus=2, bus_cpus=2)
    # too few for both: the bus starts first, and whichever lacks CPUs then says so
    assert not bus_fits_beside(nodes=1, free_cpus=3, reserved_cpus=2, bus_cpus=2)
    # several nodes: the bus's actors could take a pinned bundle's CPUs
    assert not bus_fits_beside(nodes=2, free_cpus=64, reserved_cpus=2, bus_cpus=2)


def test_a_bus_that_cannot_start_fails_the_run_at_once_with_its_reason(tmp_path, capsys) -> None:
    from relax import testing

    timeout_s = 600  # the workers would wait this long in Bus.attach for a bus that never comes
    with testing.local_ray():
        started = time.monotonic()
        code, rows, printed = testing.tiny_run(tmp_path, "nobus", "cluster.bus_node_resource=nowhere",
                                               f"fault_tolerance.wait_timeout_s={timeout_s}")
        took = time.monotonic() - started
    assert code == 1 and rows == [] and "start-up:" not in printed
    assert "no alive Ray node has the custom resource 'nowhere'" in capsys.readouterr().err
    assert took < timeout_s / 2  # it did not wait for the workers' attach timeout
