"""Records of the embedded Ray sessions that ``relax run`` starts, so that the processes of a driver
that was killed (``kill -9``, an OOM kill, a lost terminal) do not outlive it for good.

A driver that ends normally, on Ctrl-C or on SIGTERM stops its Ray itself, and then kills whatever
of it still runs (``own_processes`` taken before, ``end_processes`` after): workers linger 1-3 s
after ``ray.shutdown`` on their own, and a Ray 2.60 worker can hang for good in the core worker's
own exit handler (a lock taken twice while its event loop shuts down, seen here once in about ten
runs), keeping half a gigabyte. A driver killed outright cannot: Ray's GCS, raylet, dashboard and
runtime-env agents and idle workers go on running. So each embedded run writes a small record
(its pid and start time, the Ray session folder, the pids of the processes Ray started) into the
state folder, and removes it when it stops its Ray. The next ``relax run`` reads the records first:
a record whose driver is gone names processes to end.

Processes are found by identity, never by name: each is recorded with its pid, its start time
(``psutil.Process.create_time``) and the session folder it belongs to, and cleanup ends only a
process whose pid *and* start time match its entry, in an entry whose session folder is the
record's (and not empty), plus that process's descendants (children the kernel links to it: the
workers a recorded raylet started later). A command line that merely mentions the session folder
ends nothing: an unrelated process that happens to name it (an editor, ``tail -f`` of a log, a
shell) is left alone, and so is everything when a record's session folder is empty. While the
driver runs, the record is rewritten every ``REFRESH_S`` with the processes below it then, so
workers started after ``ray.init`` are recorded too.

The state folder is ``$RELAX_STATE_DIR``, else ``$XDG_STATE_HOME/relax``, else
``~/.local/state/relax``; the records live in its ``ray-sessions/``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Where a run's state folder is taken from, first match wins.
STATE_DIR_ENV = "RELAX_STATE_DIR"
#: How long a leftover process gets to end on SIGTERM before it is killed.
TERMINATE_GRACE_S = 3.0
#: How often a live driver rewrites its record with the processes below it.
REFRESH_S = 15.0


def state_dir() -> Path:
    """Relax's per-user state folder (see the module docstring)."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "relax"


def sessions_dir() -> Path:
    return state_dir() / "ray-sessions"


@dataclass
class ProcessEntry:
    """One process of a recorded session, by identity."""

    pid: int
    started: float
    """Its start time (``psutil``): a pid alone may have been reused by now."""
    session_dir: str
    """The Ray session folder it was started for (the record's)."""


@dataclass
class SessionRecord:
    """One embedded Ray session and the driver that owns it."""

    driver_pid: int
    driver_started: float
    """The driver's start time (``psutil``): a pid alone may have been reused by now."""
    session_dir: str
    """Ray's session folder."""
    processes: list[ProcessEntry] = field(default_factory=list)
    """The processes below the driver (Ray's) when the record was last written."""
    _stop: threading.Event | None = field(default=None, repr=False, compare=False)

    @property
    def path(self) -> Path:
        return sessions_dir() / f"{self.driver_pid}-{int(self.driver_started)}.json"

    def write(self) -> None:
        data = {"driver_pid": self.driver_pid, "driver_started": self.driver_started,
                "session_dir": self.session_dir, "processes": [asdict(p) for p in self.processes]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(data) + "\n")
        temporary.replace(self.path)  # a reader never sees half a record


def _started(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _below_me(session_dir: str) -> list[ProcessEntry]:
    import psutil

    entries = []
    for child in psutil.Process().children(recursive=True):
        try:
            entries.append(ProcessEntry(child.pid, child.create_time(), session_dir))
        except psutil.NoSuchProcess:
            continue
    return entries


def record_session(session_dir: str, refresh_s: float = REFRESH_S) -> SessionRecord:
    """Write the record of this driver's embedded Ray (call right after ``ray.init`` started it):
    every process below the driver now is one of Ray's. The record is rewritten every
    ``refresh_s`` (0: never) until ``forget_session``, with the processes below the driver then."""
    import psutil

    me = psutil.Process()
    record = SessionRecord(os.getpid(), me.create_time(), session_dir, _below_me(session_dir))
    record.write()
    if refresh_s > 0:
        stop = threading.Event()
        record._stop = stop

        def refresh() -> None:
            while not stop.wait(refresh_s):
                try:
                    record.processes = _below_me(session_dir)
                    if not stop.is_set():
                        record.write()
                except Exception:  # a full disk or a vanished folder: the last record stands
                    continue

        threading.Thread(target=refresh, name="relax-session-record", daemon=True).start()
    return record


def forget_session(record: SessionRecord | None) -> None:
    """Remove the record once this driver stopped its Ray."""
    if record is not None:
        if record._stop is not None:
            record._stop.set()
        record.path.unlink(missing_ok=True)


def _load(path: Path) -> SessionRecord | None:
    try:
        data = json.loads(path.read_text())
        session_dir = str(data["session_dir"])
        entries = [ProcessEntry(int(e["pid"]), float(e["started"]), str(e["session_dir"]))
                   for e in data.get("processes", [])]
        # A record of an earlier Relax: pid -> start time, all of the record's session.
        entries += [ProcessEntry(int(k), float(v), session_dir) for k, v in data.get("pids", {}).items()]
        return SessionRecord(int(data["driver_pid"]), float(data["driver_started"]), session_dir, entries)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def session_processes(record: SessionRecord) -> list:
    """The live processes of a recorded session: each recorded one that is still the same process
    (same pid and start time) in an entry of the record's own, non-empty session folder, and its
    descendants (workers and agents the raylet started after the record was written). Never a
    process found by its command line."""
    import psutil

    found: dict[int, psutil.Process] = {}
    if not record.session_dir:
        return []
    for entry in record.processes:
        if entry.session_dir != record.session_dir or _started(entry.pid) != entry.started:
            continue
        try:
            process = psutil.Process(entry.pid)
            found[entry.pid] = process
            found.update({c.pid: c for c in process.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def own_processes() -> list:
    """Every process below this one now: for a driver with an embedded Ray, Ray's daemons, agents
    and workers (taken before Ray is stopped: a worker whose raylet is gone is no one's child)."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def end_processes(processes: list, grace_s: float = TERMINATE_GRACE_S) -> list[int]:
    """End each process still running (the same process: pid and start time): SIGTERM, then
    SIGKILL to those that did not end within ``grace_s``, and wait for them to go; with no grace,
    SIGKILL at once, not waited for (a killed process that is not our child is gone only once
    init reaps it: a second or more here). The pids that had to be ended."""
    import psutil

    running = [p for p in processes if p.is_running()]
    alive = running
    if grace_s > 0:
        for process in running:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(running, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    if grace_s > 0:
        psutil.wait_procs(alive, timeout=TERMINATE_GRACE_S)
    return [p.pid for p in running]


def clean_orphaned_sessions() -> list[str]:
    """End the processes of every recorded session whose driver is gone and drop its record; the
    session folders of the sessions cleaned. A record of a live driver (another run) is left alone."""
    folder = sessions_dir()
    if not folder.is_dir():
        return []
    cleaned = []
    for path in sorted(folder.glob("*.json")):
        record = _load(path)
        if record is None:  # unreadable: nothing can be done with it
            path.unlink(missing_ok=True)
            continue
        if _started(record.driver_pid) == record.driver_started:
            continue  # its driver still runs
        processes = session_processes(record)
        end_processes(processes)
        path.unlink(missing_ok=True)
        if processes:
            cleaned.append(record.session_dir)
    return cleaned
