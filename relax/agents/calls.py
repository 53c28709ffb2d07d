"""Environment calls with a time limit and a bound on how many run at once.

Each call runs on its own daemon thread, so a call that hangs costs its trajectory only: the
trajectory gets an ``EnvironmentFailure`` when the time limit passes, its slot is given back at
once, and the stuck thread is abandoned (Python cannot stop a thread; a daemon one does not keep
the process alive). ``async def`` hooks are run to completion on the call's thread.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any


class EnvironmentFailure(RuntimeError):
    """An environment call raised or ran past its time limit: the message says which and why, and
    ``kind`` the trajectory's outcome (``relax.agents.outcomes``): ``env_timeout`` past the limit,
    ``infra`` when what failed was the connection to a server (the environment's process or service
    went away), ``env_error`` otherwise."""

    def __init__(self, message: str, kind: str = "env_error") -> None:
        super().__init__(message)
        self.kind = kind


#: Exceptions that say a server or the connection to it went away (not the environment's logic).
CONNECTION_LOST: tuple[type[BaseException], ...] = (ConnectionError, EOFError)


class EnvironmentCalls:
    """Runs environment calls with ``timeout_s`` each, at most ``concurrency`` at once."""

    def __init__(self, name: str, timeout_s: float, concurrency: int) -> None:
        self.name, self.timeout_s = name, float(timeout_s)
        self._slots = threading.BoundedSemaphore(concurrency)
        self.abandoned = 0
        """Calls given up on after their time limit (their threads may still be running)."""

    def call(self, hook: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` within the time limit (waiting for a slot does not count): its result and
        the seconds it took. Raises ``EnvironmentFailure``."""
        self._slots.acquire()
        released = threading.Lock()

        def release() -> None:
            if released.acquire(blocking=False):
                self._slots.release()

        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                result = fn(*args)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
                box["result"] = result
            except BaseException as exc:  # reported to the trajectory, never raised on this thread
                box["error"] = exc
            finally:
                done.set()
                release()

        started = time.perf_counter()
        threading.Thread(target=run, name=f"env-{self.name}-{hook}", daemon=True).start()
        if not done.wait(self.timeout_s):
            release()
            self.abandoned += 1
            raise EnvironmentFailure(f"environment {self.name!r}: {hook} took longer than "
                                     f"roles.rollout.agent.tool_timeout_s={self.timeout_s:g} s; the trajectory "
                                     "ends here (raise the timeout if the tool is slow by nature)", kind="env_timeout")
        seconds = time.perf_counter() - started
        if "error" in box:
            exc = box["error"]
            kind = exc.kind if isinstance(exc, EnvironmentFailure) else \
                "infra" if isinstance(exc, CONNECTION_LOST) else "env_error"
            raise EnvironmentFailure(f"environment {self.name!r}: {hook} raised {type(exc).__name__}: {exc}",
                                     kind=kind) from exc
        return box["result"], seconds


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
