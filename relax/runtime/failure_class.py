"""Which failures of a role are worth a restart: errors by class.

A restart helps when the failure came from outside the role's own code and data: its process (or a
peer's) died, it hung, the run's machinery between processes (Ray, the bus, a collective) broke,
the network failed, or a plugin said so by raising ``relax.contracts.TransientError``. It does not
help with a mistake: a misspelled column (``KeyError``), a bad option or value (``ValueError``,
``TypeError``), a plugin's bug (``AttributeError``, ``IndexError``, ...). Those fail the same way
on every try, so the run stops at once with the message instead of restarting the worker three
times and printing it four (``fault_tolerance.roles`` budgets are for the first kind).

``repeats_on_retry`` decides from the exception itself, in the worker that caught it (where its
traceback and chain still exist): a mistake class anywhere in its chain (a ``RuntimeError`` a plugin
raised from a ``KeyError`` counts), raised by code that is not the run's machinery, and no
transient failure in the chain. Anything else (``RuntimeError``, ``OSError``, Ray's errors)
keeps the policy's restart, as before: a wrong "transient" costs a few restarts, a wrong "mistake"
costs the run, so the mistake list is short and explicit. Agentic trajectories that end by
failures past ``agent.max_failed_frac`` (``InfraFailureLimit``) stop the run too. A full disk
(``ENOSPC``/``EDQUOT``,
``DiskFull``) repeats too: it stops the run naming the file, instead of a resume that fills it again. Process deaths and
hangs never reach
here (the controller sees them from Ray and the heartbeats).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from relax.agents.outcomes import InfraFailureLimit
from relax.contracts import TransientError

#: ``errno`` values of a disk (or quota) that is full: a retry, a restart or a resume writes to the
#: same disk and fails the same way, so they stop the run with the file named.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Free bytes under which a failed write is taken for a full disk when the library that wrote it
#: raised something other than ``OSError`` (``torch.save`` raises a ``RuntimeError``).
NEARLY_FULL_BYTES = 16 * 1024 * 1024


class DiskFull(OSError):
    """A write that failed because its disk is full; the message names the file and what to do."""

    def __init__(self, path: Path | str, what: str = "") -> None:
        doing = f" ({what})" if what else ""
        super().__init__(errno.ENOSPC, f"disk full: cannot write {path}{doing}; free space on that disk (or give "
                                       "trainer.output_dir on another one), then relax run --resume")
        self.filename = str(path)

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full(exc: BaseException) -> OSError | None:
    """The full-disk ``OSError`` in ``exc``'s chain, or None."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS), None)


def as_disk_full(exc: BaseException, path: Path, what: str = "") -> DiskFull | None:
    """``DiskFull`` naming ``path`` when ``exc`` (raised while writing it) came from a full disk: an
    ``ENOSPC``/``EDQUOT`` in its chain, or, for a library that words it otherwise, less than
    ``NEARLY_FULL_BYTES`` left on that disk; None otherwise."""
    if disk_full(exc) is None:
        try:
            folder = next(p for p in (path, *path.parents) if p.exists())
            if shutil.disk_usage(folder).free >= NEARLY_FULL_BYTES:
                return None
        except (OSError, StopIteration):
            return None
    return DiskFull(path, what)

#: Exceptions that a retry reproduces: bugs, bad data, bad options. ``ValueError`` covers
#: ``UnicodeDecodeError``, ``json.JSONDecodeError`` and pydantic's ``ValidationError``.
MISTAKES: tuple[type[BaseException], ...] = (
    LookupError, ValueError, TypeError, AttributeError, NameError, ImportError, AssertionError,
    NotImplementedError, ArithmeticError)

#: Failures of the world outside the role's code; one anywhere in the chain makes a failure transient.
TRANSIENT: tuple[type[BaseException], ...] = (TransientError, ConnectionError, TimeoutError)

#: Modules of the run's machinery between processes: an exception raised inside them (a collective
#: whose peer died, a bus whose storage actor went away) is a failure of the run, not of the role's
#: code, whatever its class.
MACHINERY = ("ray", "torch.distributed", "zmq", "transfer_queue", "tensordict", "relax.bus",
             "relax.weight_group")


def repeats_on_retry(exc: BaseException) -> bool:
    """Whether ``exc`` (caught in a role's step loop) would happen again on a restarted worker."""
    chain = list(_chain(exc))
    if disk_full(exc) is not None:  # the same disk on the next try
        return True
    if any(isinstance(e, InfraFailureLimit) for e in chain):  # the same broken environment on the next try
        return True
    if any(_transient(e) for e in chain):
        return False
    return any(isinstance(e, MISTAKES) and not _raised_in_machinery(e) for e in chain)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, TRANSIENT):
        return True
    # Ray's own errors (an actor or object lost, a task cancelled), without importing Ray here.
    return any(cls.__module__.startswith("ray.") for cls in type(exc).__mro__)


def _raised_in_machinery(exc: BaseException) -> bool:
    """Whether the frame that raised ``exc`` (the innermost of its traceback) is in ``MACHINERY``."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return any(module == name or module.startswith(name + ".") for name in MACHINERY)
