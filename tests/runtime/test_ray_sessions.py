"""Ending the processes an embedded Ray leaves behind (``relax.runtime.driver.ray_sessions``), with real
processes: a child that ignores SIGTERM stands for a Ray worker hung in its own exit handler."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from relax.runtime.driver.ray_sessions import end_processes, own_processes

#: A process that ignores SIGTERM and sleeps: only SIGKILL ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
#: A process with a child of its own, both ending on SIGTERM.
PARENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
          "print('ready', flush=True); time.sleep(120)")


def _start(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_own_processes_lists_children_and_grandchildren() -> None:
    parent = _start(PARENT)
    try:
        pids = {p.pid for p in own_processes()}
        grandchildren = psutil.Process(parent.pid).children()
        assert parent.pid in pids
        assert grandchildren and grandchildren[0].pid in pids
    finally:
        end_processes([psutil.Process(parent.pid), *psutil.Process(parent.pid).children()], grace_s=1.0)
        parent.wait(5)


def test_end_processes_terminates_kills_the_stubborn_and_skips_the_gone() -> None:
    polite = _start(PARENT)
    stubborn = _start(STUBBORN)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    processes = [psutil.Process(polite.pid), *psutil.Process(polite.pid).children(), psutil.Process(stubborn.pid)]
    grandchild = processes[1]
    started = time.monotonic()
    ended = end_processes(processes, grace_s=1.0)
    took = time.monotonic() - started
    assert sorted(ended) == sorted([polite.pid, grandchild.pid, stubborn.pid])
    assert not any(p.is_running() for p in processes)  # (end_processes reaped them: psutil waits on children)
    assert took >= 1.0  # SIGTERM did not end the stubborn one: it had its grace, then SIGKILL
    # A process that ended is not signalled again (nor is a pid reused since: psutil checks its start).
    assert end_processes(processes, grace_s=1.0) == []


def test_end_processes_does_not_wait_out_the_grace_when_all_end_on_sigterm() -> None:
    polite = _start(PARENT)
    processes = [psutil.Process(polite.pid), *psutil.Process(polite.pid).children()]
    started = time.monotonic()
    assert len(end_processes(processes, grace_s=30.0)) == 2
    assert time.monotonic() - started < 10.0
    polite.wait(5)


def test_end_processes_without_grace_kills_at_once() -> None:
    stubborn = _start(STUBBORN)
    process = psutil.Process(stubborn.pid)
    started = time.monotonic()
    assert end_processes([process], grace_s=0) == [stubborn.pid]
    assert stubborn.wait(5) == -9 and time.monotonic() - started < 5.0  # SIGKILL, not SIGTERM
