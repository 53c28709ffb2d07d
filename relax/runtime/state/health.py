"""How a worker tells the controller it is alive and making progress.

A heartbeat alone cannot tell a worker stuck inside a generation from one that works: its thread
beats either way. So each beat also says what the worker is doing and since when it has been
*busy* (generating, scoring, training). Waiting on another role is not busy: that role's own beat
answers for it. The controller declares a worker hung when its beats stop for
``fault_tolerance.heartbeat_timeout_s`` (a frozen process or a lost node) or when one piece of
work has lasted longer than ``fault_tolerance.progress_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from relax.runtime.state.records import Beat


class Activity:
    """What a worker does right now: a label, and when its current piece of work began."""

    def __init__(self) -> None:
        self.label = "starting"
        self.busy_since: float | None = time.time()
        self.announce: Callable[[str, float | None], None] | None = None
        """Reports a state at once (set by ``Heartbeat``): for work that may kill the process, such
        as a reward plugin calling ``os._exit``, whose name must reach the controller before it runs."""

    @contextmanager
    def _state(self, label: str, busy: bool) -> Iterator[None]:
        before = self.label, self.busy_since
        self.label, self.busy_since = label, (time.time() if busy else None)
        try:
            yield
        finally:
            # Back to the enclosing state; its busy clock restarts, so a long wait inside a
            # piece of work never makes that work look stuck.
            self.label, self.busy_since = before[0], (time.time() if before[1] is not None else None)

    def busy(self, label: str, announce: bool = False) -> Any:
        """A piece of work (its duration counts against ``progress_timeout_s``). ``announce``: report
        it to the controller before it starts, not at the next heartbeat, so that a process that
        dies in it is reported with it (the driver's ``Fleet`` names the last activity of a dead worker)."""
        state = self._state(label, busy=True)
        if announce:
            return _announced(self, state)
        return state

    def waiting(self, label: str) -> Any:
        """A wait on another role (bounded by ``wait_timeout_s``, not by the progress timeout)."""
        return self._state(label, busy=False)


@contextmanager
def _announced(activity: Activity, state: Any) -> Iterator[None]:
    with state:
        if activity.announce is not None:
            activity.announce(activity.label, activity.busy_since)
        yield


class Heartbeat:
    """A daemon thread that reports a worker's ``Activity`` to ``RunState`` every ``interval_s``."""

    def __init__(self, state: Any, holder: str, activity: Activity, interval_s: float) -> None:
        self.state, self.holder, self.activity, self.interval_s = state, holder, activity, interval_s
        activity.announce = self.announce
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"relax-heartbeat-{holder}", daemon=True)
        self._thread.start()

    def announce(self, label: str, busy_since: float | None) -> None:
        """One beat now, waited for (a round trip), so that it is recorded even if the process dies
        right after; a controller that does not answer within a second is not waited for longer."""
        import ray

        try:
            ray.get(self.state.beat.remote(self.holder, label, busy_since), timeout=1.0)
        except Exception:  # the run is shutting down, or the controller is slow: the next beat says it
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.state.beat.remote(self.holder, self.activity.label, self.activity.busy_since)
            except Exception:  # the run is shutting down (RunState gone): nothing to report to
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


@dataclass(frozen=True)
class Verdict:
    """Why the controller considers a worker hung."""

    holder: str
    reason: str


def hung_workers(beats: dict[str, Beat], watched: dict[str, float], now: float,
                 heartbeat_timeout_s: float, progress_timeout_s: float) -> list[Verdict]:
    """Workers (of ``watched``: holder -> when it became ready) that are frozen or stuck.

    Pure, so the rule is unit-tested: no beat for ``heartbeat_timeout_s`` since the later of its
    last beat and its start, or busy with one thing for longer than ``progress_timeout_s``."""
    verdicts = []
    for holder, ready_at in watched.items():
        beat = beats.get(holder)
        last = max(ready_at, beat.at) if beat else ready_at
        if now - last > heartbeat_timeout_s:
            verdicts.append(Verdict(holder, f"no heartbeat for {now - last:.0f} s (fault_tolerance."
                                            f"heartbeat_timeout_s={heartbeat_timeout_s:g}): the process is "
                                            "frozen or its node is lost"))
        elif beat and beat.busy_since is not None and now - beat.busy_since > progress_timeout_s:
            # A reward plugin's call runs under its own label ("reward '<id>' (<plugin>) scoring ..."):
            # the hang is the reward's, and its own time limit is the fix.
            hint = "; give it a rewards[].timeout_s" if beat.activity.startswith("reward ") else ""
            verdicts.append(Verdict(holder, f"busy with {beat.activity} for {now - beat.busy_since:.0f} s "
                                            f"(fault_tolerance.progress_timeout_s={progress_timeout_s:g}): it "
                                            f"stopped making progress{hint}"))
    return verdicts
