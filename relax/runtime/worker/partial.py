"""Partial rollouts (``roles.rollout.partial``): generation that swaps weights mid-sequence and
fills the long tail of one step with the next step's samples.

A step's batch waits for its longest response. With a long-tailed length distribution most rows
are done early and the batch runs on for a few long ones. Here the rollout keeps generating the
*next* step's samples beside the tail of this one (the "lookahead" drafts), once the staleness
bound admits them: when this step's last sample ends, the generation pauses at that token and the
next step's samples, some finished, most part-way, wait for the next step, where only what is left
of them is generated. Whenever a newer policy version is published the generation also pauses at
a token boundary, the weights are swapped, and every unfinished sample continues under the new
policy from its tokens so far (its prefix is read again by the new weights).

The same pause keeps the batch dense: an engine that runs a batch to its longest row (``hf``'s
``generate``) keeps computing the rows that ended, so once most rows of a call have ended
(``COMPACT_DONE``, after ``COMPACT_MIN_TOKENS`` tokens) the call pauses and goes on with the
unfinished rows only (their prefixes are read again, one pass, far cheaper than carrying the ended
rows through the tail).

So a sample can hold tokens of several policy versions. Each token keeps the version that chose
it and its behaviour log-prob under that version (``Generation.token_versions``, ``logprobs``),
and a sample's staleness counts from its *oldest* token: a draft of step ``s + 1`` is started only
once the staleness policy admits the held version for step ``s + 1`` (``policy.admits``), the
bound the step's own samples meet, and later tokens are newer; drafts carried over are finished
only while the policy lets their oldest token continue (``policy.may_continue``). Nothing is dropped: every sample of a
step is generated
to its end before the step is emitted, and the data schedule, sample ids and the ledger are those
of a run without partial rollouts. A rollout that restarts loses its drafts and generates those
samples again from the start.

The batch of a step therefore depends on when weights arrived: partial rollouts trade bitwise
reproducibility for throughput (``docs/off-policy.md``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax.algo.staleness import StalenessPolicy
from relax.algo.stop_strings import StopStrings, response_text
from relax.contracts import Generation, TokenPrompt

#: A call pauses to drop its ended rows once this share of its rows has ended...
COMPACT_DONE = 0.5
#: ...and it has generated at least this many tokens (a pause costs a pass over the prefixes).
COMPACT_MIN_TOKENS = 4


@dataclass
class Draft:
    """One sample being generated, possibly over several calls and policy versions."""

    prompt_index: int
    prompt_ids: list[int]
    budget: int
    """Response tokens the sample may have in all (``sampling.max_new_tokens``)."""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per response token, the policy version that chose it."""
    finished: bool = False
    """It ended with a stop token."""
    calls: int = 0
    """Generation calls that extended it."""
    interrupted: bool = False
    """Paused unfinished by a weight swap or a step boundary, and continued later."""

    @property
    def done(self) -> bool:
        return self.finished or len(self.response_ids) >= self.budget

    def prompt(self) -> TokenPrompt:
        """What is left to generate: the prompt and the response so far, with the rest of the budget."""
        return TokenPrompt(ids=self.prompt_ids + self.response_ids,
                           max_new_tokens=self.budget - len(self.response_ids))

    def extend(self, generation: Generation, version: int, stops: StopStrings | None = None) -> None:
        """Append a call's tokens, chosen by policy ``version``. With ``stops`` (the sampling's stop
        strings), a stop string completed across the boundary of this call's tokens and the earlier
        ones (which the backend did not see as its response) ends the sample there: what follows
        is cut, as the backend cuts within a call."""
        before = len(self.response_ids)
        self.response_ids += generation.response_ids
        self.logprobs += generation.logprobs
        self.versions += [version] * len(generation.response_ids)
        self.finished = generation.finished
        self.calls += 1
        if stops and before:
            # Only the windows that reach back before this call's tokens are new to the check.
            at = stops.end(self.response_ids[:before + stops.window - 1], start=before)
            if at is not None:
                del self.response_ids[at:], self.logprobs[at:], self.versions[at:]
                self.finished = True

    def generation(self, text: Callable[[list[int], bool], str]) -> Generation:
        """The finished sample; ``text(response_ids, finished)`` decodes it (without its stop token
        or stop string)."""
        return Generation(prompt_index=self.prompt_index, prompt_ids=list(self.prompt_ids),
                          response_ids=list(self.response_ids), logprobs=list(self.logprobs),
                          text=text(list(self.response_ids), self.finished), finished=self.finished,
                          token_versions=list(self.versions))


def new_drafts(prompts: list[list[int]], n: int, budget: int) -> list[Draft]:
    """``n`` empty drafts per prompt, prompt-major (the order of ``generate``)."""
    return [Draft(prompt_index=i, prompt_ids=list(ids), budget=budget) for i, ids in enumerate(prompts)
            for _ in range(n)]


@dataclass
class PartialStats:
    """A step's partial-rollout figures (unit stats, summed over units)."""

    partial_samples: int = 0
    partial_interrupted: int = 0
    """Samples whose generation was paused and continued by a weight swap or a step boundary
    (not the pauses that drop ended rows)."""
    partial_versions: int = 0
    """Sum over the samples of the distinct policy versions of their tokens."""
    partial_calls: int = 0
    """Generation calls the step made."""
    partial_swaps: int = 0
    """Weight swaps in the middle of the step's generation."""


class PartialRollouts:
    """Generates a step's samples with pauses (``Draft`` s carried over calls) and keeps the next
    step's drafts between steps (see the module docstring).

    ``backend`` is a rollout backend whose ``generate_tokens`` takes ``pause`` (the ``pausable``
    trait). ``newer()`` says, without waiting, whether a policy version newer than the backend's is
    published; ``swap()`` loads the newest one into the backend."""

    def __init__(self, backend: Any, policy: StalenessPolicy, newer: Callable[[], bool],
                 swap: Callable[[], None]) -> None:
        self.backend, self.policy = backend, policy
        """``policy``: the staleness policy of the unit being generated (the rollout sets the one
        its lease was admitted under)."""
        self.newer, self.swap = newer, swap
        self.ahead: tuple[int, list[Draft]] | None = None
        """The next step's drafts, started beside this step's tail: (step, drafts)."""

    def sample(self, step: int, prompts: list[list[int]], n: int, sampling: Any, seed: int,
               next_prompts: Callable[[], list[list[int]]] | None) -> tuple[list[Generation], PartialStats]:
        """Every sample of ``step`` (``n`` per prompt of ``prompts``, token ids), prompt-major, each
        generated to its end; beside them, once admissible, the drafts of step + 1 (whose prompts
        ``next_prompts`` gives; None: no next step)."""
        budget = int(sampling.max_new_tokens)
        stop = tuple(getattr(sampling, "stop", ()) or ())
        stops = StopStrings(self.backend.tokenizer, stop) if stop else None
        own = self._take_ahead(step, prompts, n) or new_drafts(prompts, n, budget)
        ahead: list[Draft] | None = None
        stats = PartialStats()
        call = 0
        while True:
            active = [d for d in own if not d.done]
            if not active:
                break
            if self.newer():
                self.swap()
                stats.partial_swaps += call > 0
            if ahead is None and next_prompts is not None and self.policy.admits(step + 1, self.backend.version):
                ahead = new_drafts(next_prompts(), n, budget)
            rows = active + [d for d in ahead or () if not d.done]
            mine = len(active)
            asked = [0]
            interrupting = [False]

            def pause(done: list[bool]) -> bool:
                """This step's samples all ended, new weights are out, or most rows ended (compact)."""
                asked[0] += 1
                if all(done[:mine]) or self.newer():
                    interrupting[0] = True
                    return True
                return asked[0] >= COMPACT_MIN_TOKENS and sum(done) >= COMPACT_DONE * len(done) and not all(done)

            version = self.backend.version
            generations = self.backend.generate_tokens([d.prompt() for d in rows], sampling, seed + call, pause=pause)
            if len(generations) != len(rows):
                raise RuntimeError(f"generate_tokens returned {len(generations)} generations for {len(rows)} "
                                   "prompts; a rollout backend answers every prompt")
            for draft, generation in zip(rows, generations):
                draft.extend(generation, version, stops)
                draft.interrupted |= interrupting[0] and not draft.done
            call += 1
        if ahead is not None:
            self.ahead = (step + 1, ahead)
        stats.partial_calls = call
        stats.partial_samples = len(own)
        stats.partial_interrupted = sum(d.interrupted for d in own)
        stats.partial_versions = sum(len(set(d.versions)) for d in own)
        text = self._texts(stops)
        return [d.generation(text) for d in own], stats

    def _take_ahead(self, step: int, prompts: list[list[int]], n: int) -> list[Draft] | None:
        """The drafts started for ``step`` during the previous one, if they are for these prompts
        (a restarted or re-leased step starts afresh) and still within the bound (``max_staleness:
        auto`` may have narrowed it since they started: they are then generated again, under the
        newer weights; none of them was ever emitted)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] != step:
            return None
        drafts = ahead[1]
        if [d.prompt_ids for d in drafts[::n]] != [list(p) for p in prompts] or len(drafts) != n * len(prompts):
            return None
        oldest = min((v for d in drafts for v in d.versions), default=self.backend.version)
        return drafts if self.policy.may_continue(step, oldest) else None

    def _texts(self, stops: StopStrings | None) -> Callable[[list[int], bool], str]:
        """A sample's text from its tokens, as the backend decodes its own generations: without
        the stop token it ended on (one of the backend's ``stop_token_ids``, else its tokenizer's
        eos) and ending before its first stop string."""
        tokenizer = self.backend.tokenizer
        ends = getattr(self.backend, "stop_token_ids", None) or [tokenizer.eos_token_id]
        return lambda ids, finished: response_text(tokenizer, ids, finished, ends, stops)


class VersionWatch:
    """Tells, without waiting, whether a policy version newer than ``held()`` is published: a
    daemon thread long-polls ``poll(min_version, timeout_s)`` (``RunState.wait_version``) and
    remembers the newest version it saw, so the generation's per-token ``pause`` reads one int."""

    def __init__(self, poll: Callable[[int, float], int | None], held: Callable[[], int],
                 slice_s: float = 0.5) -> None:
        self.poll, self.held, self.slice_s = poll, held, slice_s
        self.seen = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-version-watch", daemon=True)
        self._thread.start()

    def newer(self) -> bool:
        return self.seen > self.held()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self.poll(max(self.seen, self.held()) + 1, self.slice_s)
            except Exception:  # the run is stopping (or RunState restarts): the loop's own calls will say
                if self._stop.wait(self.slice_s):
                    return
                continue
            if version is not None:
                self.seen = max(self.seen, version)

    def close(self) -> None:
        self._stop.set()
