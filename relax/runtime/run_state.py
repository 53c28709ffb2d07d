"""The run's small control-plane service: policy versions, data-ready signals, per-step reports.

One async Ray actor per run. It never carries sample data (that goes through the bus) nor weight
bytes (those stay in the object store; it holds only references). Roles block on it instead of
polling: the rollout waits here for the policy version the staleness bound requires, a consumer
waits for a partition's field to be announced before it reads the bus, and the controller waits
for each step's reports.
"""

from __future__ import annotations

import asyncio
from typing import Any


class RunState:
    """Versions, signals and reports of one run (use as ``ray.remote(RunState)``)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._version = -1
        self._weights: list[Any] = []
        self._ready: set[tuple[str, str]] = set()
        self._reports: dict[int, dict[str, dict[str, Any]]] = {}
        self._stopped = False
        self._failure: str | None = None

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _wait(self, predicate, timeout_s: float) -> bool:
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: predicate() or self._stopped), timeout_s)
            except TimeoutError:
                return False
        return predicate()

    # -- weights ------------------------------------------------------------------------------

    async def publish(self, version: int, weights: list[Any]) -> None:
        """The actor's new policy: ``weights`` is ``[ObjectRef]`` (a list, so it is not resolved)."""
        self._version, self._weights = version, weights
        await self._notify()

    async def wait_version(self, min_version: int, timeout_s: float) -> tuple[int, list[Any]] | None:
        """The newest published version once it is at least ``min_version``; None on timeout or stop."""
        ok = await self._wait(lambda: self._version >= min_version, timeout_s)
        return (self._version, self._weights) if ok else None

    # -- data-ready signals ---------------------------------------------------------------------

    async def announce(self, partition: str, field: str) -> None:
        """Every row of ``partition`` now holds ``field``."""
        self._ready.add((partition, field))
        await self._notify()

    async def wait_ready(self, partition: str, field: str, timeout_s: float) -> bool:
        return await self._wait(lambda: (partition, field) in self._ready, timeout_s)

    async def finish(self, partition: str, role: str, consumers: int) -> bool:
        """``role`` is done reading ``partition``; True for the last of its ``consumers`` roles,
        which then clears the partition (so no reader finds its rows gone)."""
        self._ready.add((partition, f"done:{role}"))
        done = sum(1 for p, f in self._ready if p == partition and f.startswith("done:"))
        return done >= consumers

    async def forget(self, partition: str) -> None:
        """Drop a finished partition's signals."""
        self._ready = {key for key in self._ready if key[0] != partition}

    # -- per-step reports -----------------------------------------------------------------------

    async def report(self, step: int, role: str, stats: dict[str, Any]) -> None:
        self._reports.setdefault(step, {})[role] = stats
        await self._notify()

    async def wait_reports(self, step: int, roles: list[str], timeout_s: float) -> dict[str, dict[str, Any]] | None:
        """The reports of every role for ``step`` once all have arrived; None on timeout or stop."""
        ok = await self._wait(lambda: all(r in self._reports.get(step, {}) for r in roles), timeout_s)
        return self._reports.pop(step, None) if ok else None

    # -- stopping --------------------------------------------------------------------------------

    async def stop(self, failure: str | None = None) -> None:
        """Ask every role to stop at its next wait; ``failure`` says why, if it is one."""
        self._stopped = True
        self._failure = self._failure or failure
        await self._notify()

    async def stopped(self) -> bool:
        return self._stopped
