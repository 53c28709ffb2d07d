"""Scoring a batch with every reward of a run: concurrently, within each reward's time limit.

The reward loop hands a batch of ``RewardSample``s to ``RewardScorer.score``. Every reward plugin
scores its share of the batch at the same time as the others: a plugin whose ``score`` is an
``async def`` runs on one event loop the scorer keeps in a background thread (so many slow network
or model calls overlap), any other in a thread pool. The scorer waits for each at most its
``timeout_s`` (``RewardSpec.timeout_s``); a plugin that overruns is abandoned (an async one is
cancelled; a thread cannot be stopped, so the plugin is not called again until that call returns).

A plugin that raises is asked again, sample by sample, to find the samples it cannot score, so
the error names them (one that raises ``relax.contracts.TransientError`` is not: its worker is
restarted under the role's ``fault_tolerance`` policy). What a failure does is the entry's ``on_error`` policy: ``fail``
raises
``RewardError`` (the run stops with it), ``zero`` scores the failed samples 0 and counts them, unless
they are more than ``max_error_frac`` of the entry's share of the batch (then ``RewardError`` too).

Routing: a sample may name the rewards that score it (``data.reward_key``): an entry's ``key`` (its
``id``, else its plugin name) or its plugin name, or a list of them. A sample without a route is
scored by every entry, and entries marked ``always`` score every sample.

This module imports only the standard library (no torch): it is tested without a run.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from relax.contracts import RewardSample, TransientError

#: How many failing samples an error message lists by id.
LISTED_IDS = 3


class RewardError(RuntimeError):
    """A reward could not score some samples and its policy is ``fail``."""


@dataclass
class RewardEntry:
    """One reward of the run, built: the plugin object and the spec's settings for it."""

    key: str
    """The entry's id (``RewardSpec.id``, else its plugin name): routing and metrics use it."""
    name: str
    """The plugin name."""
    plugin: Any
    weight: float = 1.0
    timeout_s: float | None = None
    on_error: str = "fail"
    max_error_frac: float = 0.5
    """Under ``zero``: the largest share of a batch it may fail on before the run stops."""
    always: bool = False
    pending: Future | None = field(default=None, repr=False)
    """A call that overran its timeout and is still running in a thread."""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(getattr(self.plugin, "score", None))


@dataclass
class Outcome:
    """What one entry made of its share of a batch."""

    scores: list[float | None]
    """Per sample of its share; None where the sample failed."""
    failures: list[tuple[int, str]]
    """(position in its share, what went wrong) of each failed sample."""
    seconds: float


@dataclass
class ScoreReport:
    """The scores of one batch: the weighted totals and each entry's part."""

    totals: list[float]
    """Per sample: the sum of weight x score over the entries that scored it."""
    scores: dict[str, list[float | None]]
    """Per entry key, per sample: its raw score (0 for a sample that failed under ``zero``), None
    where the entry did not score that sample (routing)."""
    errors: dict[str, int]
    """Per entry key: samples that failed and were scored 0."""
    seconds: dict[str, float]
    """Per entry key: wall time of its scoring."""

    def stats(self) -> dict[str, float]:
        """Flat per-entry statistics for the step's metrics: ``<key>/mean`` (over the samples it
        scored), ``<key>/count``, ``<key>/errors`` and ``<key>/time``."""
        out: dict[str, float] = {}
        for key, scores in self.scores.items():
            scored = [s for s in scores if s is not None]
            if scored:
                out[f"{key}/mean"] = sum(scored) / len(scored)
            out[f"{key}/count"] = float(len(scored))
            out[f"{key}/errors"] = float(self.errors.get(key, 0))
            out[f"{key}/time"] = self.seconds.get(key, 0.0)
        return out


class RewardScorer:
    """Scores batches with a run's reward entries (see the module docstring)."""

    def __init__(self, entries: Sequence[RewardEntry], max_threads: int | None = None) -> None:
        if not entries:
            raise ValueError("a run needs at least one reward; list one under rewards")
        self.entries = list(entries)
        keys = [e.key for e in self.entries]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"rewards {duplicates} are listed more than once; give each entry its own id")
        # Spare threads: a plugin that overran its timeout may still hold one.
        self._pool = ThreadPoolExecutor(max_workers=max_threads or 2 * len(self.entries) + 2,
                                        thread_name_prefix="relax-reward")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    # -- routing --------------------------------------------------------------------------------

    def routes(self, routes: Sequence[Any] | None, sample_ids: Sequence[str]) -> dict[str, list[int]]:
        """Which samples (by position) each entry scores."""
        count = len(sample_ids)
        if routes is None:
            return {e.key: list(range(count)) for e in self.entries}
        if len(routes) != count:
            raise ValueError(f"{len(routes)} reward routes for {count} samples; give one per sample")
        chosen: dict[str, list[int]] = {e.key: [] for e in self.entries}
        for i, route in enumerate(routes):
            for key in self._select(route, sample_ids[i]):
                chosen[key].append(i)
        return chosen

    def _select(self, route: Any, sample_id: str) -> list[str]:
        if route is None or route == "" or (isinstance(route, list | tuple) and not route):
            return [e.key for e in self.entries]
        names = [route] if isinstance(route, str) else list(route) if isinstance(route, list | tuple) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise RewardError(f"sample {sample_id}: its data.reward_key value {route!r} is neither a reward "
                              "name nor a list of names; give a string or a list of strings")
        keys = set()
        for name in names:
            matched = [e.key for e in self.entries if name in (e.key, e.name)]
            if not matched:
                known = ", ".join(sorted({e.key for e in self.entries} | {e.name for e in self.entries}))
                raise RewardError(f"sample {sample_id}: its data.reward_key value '{name}' names no reward of "
                                  f"this run (known: {known}); use a reward's id or plugin name")
            keys.update(matched)
        keys.update(e.key for e in self.entries if e.always)
        return [e.key for e in self.entries if e.key in keys]

    # -- scoring --------------------------------------------------------------------------------

    def score(self, samples: Sequence[RewardSample], routes: Sequence[Any] | None = None) -> ScoreReport:
        """Score a batch: every entry on its share, all at once; see the module docstring."""
        ids = [str(s.metadata.get("sample_id", i)) for i, s in enumerate(samples)]
        chosen = self.routes(routes, ids)
        started = time.monotonic()
        running: list[tuple[RewardEntry, list[int], Future | None, str | None]] = []
        for entry in self.entries:
            share = chosen[entry.key]
            if not share:
                continue
            if entry.pending is not None and not entry.pending.done():
                running.append((entry, share, None, f"it is still scoring an earlier batch that overran "
                                f"timeout_s={entry.timeout_s}"))
                continue
            entry.pending = None
            batch = [samples[i] for i in share]
            running.append((entry, share, self._submit(entry, batch), None))
        totals = [0.0] * len(samples)
        report = ScoreReport(totals=totals, scores={}, errors={}, seconds={})
        for entry, share, future, refused in running:
            outcome = self._collect(entry, share, future, refused, started)
            report.seconds[entry.key] = outcome.seconds
            column: list[float | None] = [None] * len(samples)
            if outcome.failures:
                self._on_failures(entry, share, outcome, ids)
                report.errors[entry.key] = len(outcome.failures)
            for position, index in enumerate(share):
                value = outcome.scores[position]
                value = 0.0 if value is None else value
                column[index] = value
                totals[index] += entry.weight * value
            report.scores[entry.key] = column
        return report

    def _submit(self, entry: RewardEntry, batch: list[RewardSample]) -> Future:
        if entry.is_async:
            return asyncio.run_coroutine_threadsafe(_score_async(entry, batch), self._event_loop())
        return self._pool.submit(_score_sync, entry, batch)

    def _collect(self, entry: RewardEntry, share: list[int], future: Future | None, refused: str | None,
                 started: float) -> Outcome:
        if future is None:
            return Outcome([None] * len(share), [(i, refused or "not run") for i in range(len(share))], 0.0)
        remaining = None if entry.timeout_s is None else max(0.0, started + entry.timeout_s - time.monotonic())
        try:
            return future.result(timeout=remaining)
        except FutureTimeout:
            future.cancel()  # cancels an async call; a thread that already started runs on
            if not future.done():
                entry.pending = future  # so it is not called again while that call runs
            why = f"timed out: no scores within timeout_s={entry.timeout_s}"
            return Outcome([None] * len(share), [(i, why) for i in range(len(share))], time.monotonic() - started)
        except _ContractError as exc:
            raise RewardError(f"reward '{entry.key}' ({entry.name}): {exc}") from None

    def _on_failures(self, entry: RewardEntry, share: list[int], outcome: Outcome, ids: list[str]) -> None:
        first, why = outcome.failures[0]
        if entry.on_error == "zero":
            frac = len(outcome.failures) / len(share)
            if frac > entry.max_error_frac:
                raise RewardError(f"reward '{entry.key}' ({entry.name}) failed on {len(outcome.failures)} of "
                                  f"{len(share)} samples ({frac:.0%}), more than rewards[].max_error_frac="
                                  f"{entry.max_error_frac:g} allows under on_error: zero; first failure (sample "
                                  f"{ids[share[first]]}): {why}; fix the plugin or its input, or raise "
                                  "max_error_frac")
            return
        failed = [ids[share[i]] for i, _ in outcome.failures]
        more = f" (and {len(failed) - 1} more: {', '.join(failed[1:1 + LISTED_IDS])}" \
               f"{', ...' if len(failed) > 1 + LISTED_IDS else ''})" if len(failed) > 1 else ""
        raise RewardError(f"reward '{entry.key}' ({entry.name}) failed on sample {ids[share[first]]}{more}: "
                          f"{why}; fix the plugin or its input, raise rewards[].timeout_s if it is slow, or set "
                          "rewards[].on_error: zero to score failing samples 0")

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="relax-reward-async", daemon=True).start()
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stop the event loop and the threads (a call still running in a thread is left to finish)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        self._pool.shutdown(wait=False, cancel_futures=True)


class _ContractError(Exception):
    """A plugin broke the reward contract (a wrong number of scores): a bug, whatever the policy."""


def _checked(entry: RewardEntry, batch: Sequence[RewardSample], scores: Any) -> list[float | str]:
    """Each score as a float, or a string saying why it is not a usable score."""
    try:
        values = list(scores)
    except TypeError:
        raise _ContractError(f"score returned {type(scores).__name__}, not a list of floats") from None
    if len(values) != len(batch):
        raise _ContractError(f"score returned {len(values)} scores for {len(batch)} samples; it must return "
                             "one per sample, in order")
    out: list[float | str] = []
    for value in values:
        try:
            number = float(value)
        except (TypeError, ValueError):
            out.append(f"score {value!r} is not a number")
            continue
        out.append(number if math.isfinite(number) else f"score {number} is not finite")
    return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _outcome(checked: list[float | str], seconds: float) -> Outcome:
    scores = [v if isinstance(v, float) else None for v in checked]
    failures = [(i, v) for i, v in enumerate(checked) if isinstance(v, str)]
    return Outcome(scores, failures, seconds)


def _score_sync(entry: RewardEntry, batch: list[RewardSample]) -> Outcome:
    started = time.monotonic()
    try:
        checked = _checked(entry, batch, entry.plugin.score(batch))
    except (_ContractError, TransientError):  # a bug whatever the policy; a retry of the worker
        raise
    except Exception as exc:
        if len(batch) == 1:
            checked = [_describe(exc)]
        else:  # find the samples it cannot score
            checked = []
            for sample in batch:
                try:
                    checked += _checked(entry, [sample], entry.plugin.score([sample]))
                except _ContractError:
                    raise
                except Exception as one:
                    checked.append(_describe(one))
    return _outcome(checked, time.monotonic() - started)


async def _score_async(entry: RewardEntry, batch: list[RewardSample]) -> Outcome:
    started = time.monotonic()
    try:
        checked = _checked(entry, batch, await entry.plugin.score(batch))
    except (_ContractError, TransientError):  # a bug whatever the policy; a retry of the worker
        raise
    except Exception as exc:
        if len(batch) == 1:
            checked = [_describe(exc)]
        else:
            checked = []
            for sample in batch:
                try:
                    checked += _checked(entry, [sample], await entry.plugin.score([sample]))
                except _ContractError:
                    raise
                except Exception as one:
                    checked.append(_describe(one))
    return _outcome(checked, time.monotonic() - started)
