"""Running a unit's trajectories side by side, batching the model calls of those that wait for it.

Every trajectory advances on its own thread (a driver: an environment, or an agent program behind
the gateway). When it needs the model it hands its tokens to the ``GenerationBatcher`` and blocks;
the rollout's own thread serves the batcher: it waits until every live trajectory is either waiting
for the model or outside (in an environment call, or an agent program between its calls) and no new
request has come for a few milliseconds, or until a bound passes, and makes one ``generate_tokens``
call for all the requests at hand. A slow tool thus holds only its own trajectory: the others keep
being batched while it runs. Quiet is counted from the last request, not the first: a thousand agent
programs answering a batch come back one after another over a second or more (their clients' work
is serialised by the interpreter), and a batch sent ten milliseconds after the first of them would
hold a few dozen rows: generating 1,024 rows in batches of 16 took 4x the time of batches of 256
with the tiny agent model (``bench/gateway.py``).

A backend failure is not a trajectory's: every waiting trajectory is stopped and the failure is
raised on the rollout's thread (the unit is then generated again, as for any rollout failure).
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax.agents.calls import EnvironmentCalls, EnvironmentFailure
from relax.agents.chat import ChatTokens
from relax.agents.outcomes import check_failed_frac, count
from relax.agents.tool_calls import ParsedTurn, error_observation, parse_tool_calls, resolve_format, turn_text
from relax.agents.trajectory import Trajectory
from relax.contracts import AgentTask, Generation, Observation, TokenPrompt, Turn
from relax.media import MediaRef, MediaSet
from relax.telemetry import AGENT_TOOL_CALL, AGENT_TURN

#: The least the batcher may wait for more requests once one is waiting (after the unit's first
#: batch, which waits for every trajectory's first request): a bound for when requests keep coming
#: in. It grows to ``LINGER_SHARE`` of the last batch's generation time, so that a batch waits for
#: the trajectories still answering the previous one at most that share of the model's time.
LINGER_S = 0.05
#: The share of the last ``generate_tokens`` call's wall time a later batch may wait for requests
#: still coming in (see ``LINGER_S``).
LINGER_SHARE = 1.0
#: The seed stride of the batcher's generate calls: call ``c`` draws with the unit's seed plus
#: ``c x CALL_SEED_STRIDE``, so each call draws afresh. It is the unit stride of
#: ``relax.runtime.worker.sampling`` (7,919, the 1,000th prime): call ``c`` of unit ``u`` has the seed
#: of call 0 of unit ``u + c``, which generates other prompts; being prime, it shares no factor with
#: that module's round stride (104,729, also prime).
CALL_SEED_STRIDE = 7_919
#: How long no new request must come, with every live trajectory waiting or outside, before a batch
#: goes without the outside ones (a quick tool rejoins the batch; a slow one holds only its own
#: trajectory).
SETTLE_S = 0.01


class BackendFailure(RuntimeError):
    """The rollout backend failed while trajectories waited for it (not a trajectory's failure)."""


class GenerationBatcher:
    """Collects the model requests of live trajectories and serves them in batches."""

    def __init__(self, generate: Callable[[list[TokenPrompt], int], list[Generation]], seed: int,
                 linger_s: float = LINGER_S, settle_s: float = SETTLE_S) -> None:
        self._generate, self._seed, self._linger, self._settle = generate, seed, linger_s, settle_s
        self._cv = threading.Condition()
        self._pending: list[tuple[TokenPrompt, Future]] = []
        self._live = 0
        self._outside = 0
        self._failure: BaseException | None = None
        self._arrived = 0.0
        """When the last request came (``time.monotonic``)."""
        self._generate_s = 0.0
        """The wall time of the last ``generate_tokens`` call."""
        self._returning: OrderedDict[object, float] = OrderedDict()
        """Agent programs handed a reply that have neither called again nor ended, by token, with
        when (oldest first): a batch waits for those still within the linger of their reply."""
        self.calls = 0
        self.requests = 0

    # -- trajectory side ------------------------------------------------------------------------

    def request(self, prompt: TokenPrompt, token: object = None) -> Generation:
        """The model's next turn for ``prompt`` (blocks until the batch it joins is generated);
        ``token``: the trajectory's, when it was ``returning``."""
        future: Future = Future()
        with self._cv:
            if self._failure is not None:
                raise BackendFailure(str(self._failure)) from self._failure
            self._returning.pop(token, None)
            self._pending.append((prompt, future))
            self._arrived = time.monotonic()
            self._cv.notify_all()
        return future.result()

    def joined(self) -> None:
        with self._cv:
            self._live += 1

    def left(self) -> None:
        with self._cv:
            self._live -= 1
            self._cv.notify_all()

    def outside(self, delta: int) -> None:
        """A trajectory enters (+1) or leaves (-1) an environment call: it will not ask soon."""
        with self._cv:
            self._outside += delta
            self._cv.notify_all()

    def returning(self, token: object, back: bool = True) -> None:
        """An agent program was handed its reply (``back``) and will likely call again soon: the next
        batch waits for it, but only within the linger of that moment (a program that thinks longer,
        e.g. runs a slow tool, then counts as outside). ``back=False``: it ended, or called again."""
        with self._cv:
            self._returning.pop(token, None)
            if back:
                self._returning[token] = time.monotonic()
            self._cv.notify_all()

    def _slow_returning(self, now: float, linger: float) -> tuple[int, float]:
        """How many returning programs were handed their reply more than ``linger`` ago (counted as
        outside), and when the next one will be (inf: none)."""
        slow = 0
        for handed in self._returning.values():  # oldest first
            if now - handed < linger:
                return slow, handed + linger
            slow += 1
        return slow, float("inf")

    # -- the generating thread -------------------------------------------------------------------

    def serve(self) -> None:
        """Generate batches until no trajectory is live; raise the backend's failure, if any."""
        while True:
            with self._cv:
                while not self._pending and self._live > 0:
                    self._cv.wait()
                if not self._pending:
                    return
                first = time.monotonic()
                # The first batch waits for every trajectory's first request (they all start together,
                # rendering their prompts); later ones for at most the linger. Trajectories outside
                # get a moment of quiet to come back (most tools answer in milliseconds).
                linger = max(self._linger, LINGER_SHARE * self._generate_s) if self.calls else float("inf")
                while True:
                    now = time.monotonic()
                    if len(self._pending) >= self._live:
                        break
                    slow, next_slow = self._slow_returning(now, max(self._linger, LINGER_SHARE * self._generate_s))
                    quiet = now - self._arrived
                    if len(self._pending) + self._outside + slow >= self._live and quiet >= self._settle:
                        break
                    if now - first >= linger:
                        break
                    settled = self._arrived + self._settle  # a wake-up only while it is still ahead
                    wake = min(first + linger, settled if settled > now else float("inf"), next_slow) - now
                    self._cv.wait(None if wake == float("inf") else max(wake, 0.0))
                batch, self._pending = self._pending, []
            started = time.monotonic()
            try:
                generations = self._generate([p for p, _ in batch], self._seed + self.calls * CALL_SEED_STRIDE)
                if len(generations) != len(batch):
                    raise RuntimeError(f"generate_tokens returned {len(generations)} generations for "
                                       f"{len(batch)} prompts; a backend returns one per prompt, in order")
            except BaseException as exc:
                with self._cv:
                    self._failure = exc
                    stranded, self._pending = self._pending, []
                failure = BackendFailure(f"the rollout backend failed: {type(exc).__name__}: {exc}")
                for _, future in batch + stranded:
                    future.set_exception(failure)
                raise failure from exc
            self._generate_s = time.monotonic() - started
            self.calls += 1
            self.requests += len(batch)
            for (_, future), generation in zip(batch, generations):
                future.set_result(generation)


@dataclass
class AgentLimits:
    """The parts of ``roles.rollout.agent`` a driver needs (plain data, no spec)."""

    max_turns: int
    max_tokens: int
    max_new_tokens: int
    tool_timeout_s: float
    concurrency: int
    tool_call_format: str = "hermes"
    truncated: str = "score"
    max_failed_frac: float | None = None
    """A unit whose trajectories fail (infrastructure outcomes) more often than this stops the run
    (``relax.agents.outcomes.InfraFailureLimit``); None: never."""
    regenerate_failed: int = 0
    """How many times a trajectory an environment failed is run again from its start (0: never)."""


class Driver(Protocol):
    """What runs one trajectory: an environment, or an agent program behind the gateway."""

    def episode(self, task: AgentTask, batcher: GenerationBatcher) -> Trajectory: ...


@dataclass
class AgentBatch:
    """The trajectories of a unit, in task order, and how the unit went."""

    trajectories: list[Trajectory]
    stats: dict[str, float] = field(default_factory=dict)


def run_trajectories(tasks: list[AgentTask], driver: Driver,
                     generate: Callable[[list[TokenPrompt], int], list[Generation]], seed: int,
                     max_failed_frac: float | None = None) -> AgentBatch:
    """Run every task's trajectory on its own thread, serving their model calls in batches on this
    one. A trajectory's own failure is recorded on it (with its outcome); a backend failure is
    raised, and so is ``InfraFailureLimit`` when more than ``max_failed_frac`` of the
    trajectories failed (infrastructure outcomes), counted after their regenerations: an
    environment's failed trajectory is run again from its start up to ``regenerate_failed`` times
    (``AgentLimits``), on its own thread, its other trajectories going on meanwhile."""
    batcher = GenerationBatcher(generate, seed)
    results: list[Trajectory | BaseException | None] = [None] * len(tasks)
    budget = driver.limits.regenerate_failed if isinstance(driver, EnvironmentDriver) else 0
    regenerated = [0] * len(tasks)

    def run(i: int, task: AgentTask) -> None:
        try:
            traj = driver.episode(task, batcher)
            while traj.error is not None and regenerated[i] < budget:  # every driver failure is infrastructure's
                regenerated[i] += 1
                failed, traj = traj.error, driver.episode(task, batcher)
                traj.info = {**traj.info, "regenerated": regenerated[i], "last_failure": failed[:300]}
            results[i] = traj
        except BaseException as exc:  # a driver bug or a backend failure: raised below, on this thread
            results[i] = exc
        finally:
            batcher.left()

    threads = []
    started = time.perf_counter()
    for i, task in enumerate(tasks):
        batcher.joined()
        context = contextvars.copy_context()  # spans of the trajectory nest in the rollout batch's span
        thread = threading.Thread(target=context.run, args=(run, i, task), name=f"trajectory-{task.trajectory_id}",
                                  daemon=True)
        threads.append(thread)
        thread.start()
    try:
        batcher.serve()
    finally:  # on a backend failure every waiting trajectory got it: they all end
        for thread in threads:
            thread.join()
    wall = time.perf_counter() - started
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        first = next((f for f in failures if isinstance(f, BackendFailure)), failures[0])
        raise first
    trajectories = [r for r in results if isinstance(r, Trajectory)]
    default_failure = "env_error" if isinstance(driver, EnvironmentDriver) else "program_error"
    for t in trajectories:
        if t.error is not None and t.failure is None:
            t.failure = default_failure
    n = max(len(trajectories), 1)
    outcomes = count([t.outcome for t in trajectories])
    fmt = getattr(driver, "format", None) or getattr(getattr(driver, "limits", None), "tool_call_format", "hermes")
    stats = {"agent_turns": sum(len(t.turns) for t in trajectories) / n,
             "agent_tool_calls": sum(t.tool_calls for t in trajectories) / n,
             "agent_tool_errors": float(sum(t.tool_errors + (t.error is not None) for t in trajectories)),
             "agent_failed": float(sum(t.error is not None for t in trajectories)),
             "agent_env_s": sum(t.env_s for t in trajectories),
             "agent_truncated": sum(t.truncated for t in trajectories) / n,
             "agent_trajectories": float(len(trajectories)), "agent_generate_calls": float(batcher.calls),
             "agent_regenerated": float(sum(regenerated)),
             "agent_wall_s": wall,
             f"agent_malformed_calls/{fmt}": float(sum(t.malformed_calls for t in trajectories)),
             **{f"agent_outcome/{kind}": value for kind, value in outcomes.items()}}
    check_failed_frac(outcomes, max_failed_frac,
                         next((t.error for t in trajectories if t.error is not None), "") or "")
    return AgentBatch(trajectories=trajectories, stats=stats)


def observation_text(observation: Observation) -> str:
    """An observation's text as a person reads it in a sample (media items named by their type)."""
    if isinstance(observation.content, str):
        return observation.content
    return " ".join(str(item.get("text", "")) if item.get("type") == "text" else f"<{item.get('type')}>"
                    for item in observation.content)


class EnvironmentDriver:
    """Runs a trajectory against a ``relax.environments`` plugin: the prompt, then model turns and
    observations until the environment says done, a budget is spent, or the environment fails."""

    def __init__(self, environment: Any, name: str, chat: ChatTokens, limits: AgentLimits,
                 version: Callable[[], int], media: MediaSet | None = None, telemetry: Any = None,
                 prompt_media: Callable[[AgentTask], list[MediaRef]] | None = None) -> None:
        self.environment, self.name, self.chat, self.limits = environment, name, chat, limits
        self.version, self.media, self.telemetry = version, media, telemetry
        self.tools = list(environment.tools())
        self.calls = EnvironmentCalls(name, limits.tool_timeout_s, limits.concurrency)
        self.prompt_media = prompt_media
        tokenizer = chat.tokenizer
        self.tokenizer = tokenizer
        self._stop_text = lambda token: tokenizer.decode([token], skip_special_tokens=False)
        self.format = resolve_format(limits.tool_call_format, tokenizer)
        """The tool-call format of the model's turns (``auto`` resolved from its chat template)."""
        self._torn_down = False
        setup = getattr(environment, "setup", None)
        if callable(setup):  # per worker, before any trajectory: a failure stops the worker, named
            self.calls.call("setup", setup)

    def close(self) -> None:
        """The environment's per-worker ``teardown`` (once; what ``setup`` started)."""
        teardown = getattr(self.environment, "teardown", None)
        if callable(teardown) and not self._torn_down:
            self._torn_down = True
            self.calls.call("teardown", teardown)

    def _span(self, name: str, **attributes: Any) -> Any:
        if self.telemetry is None:
            return _NoSpan()
        return self.telemetry.span(name, **attributes)

    def episode(self, task: AgentTask, batcher: GenerationBatcher) -> Trajectory:
        limits = self.limits
        rendered = self.chat.prompt(task.prompt, self.prompt_media(task) if self.prompt_media else None)
        traj = Trajectory(prompt_ids=rendered.ids, prompt_media=rendered.media)
        state: Any = None
        try:
            state = self._call(traj, batcher, "start", self.environment.start, task, turn=None)
            for index in range(limits.max_turns):
                budget = min(limits.max_new_tokens, limits.max_tokens - len(traj.response_ids))
                if budget <= 0:
                    traj.truncated = True
                    break
                with self._span(AGENT_TURN, trajectory=task.trajectory_id, turn=index) as span:
                    generation = batcher.request(TokenPrompt(traj.ids, traj.all_media, budget))
                    version = self.version()
                    span.set(tokens=len(generation.response_ids), policy_version=version)
                traj.add_model(generation.response_ids, generation.logprobs, version)
                traj.final_text = generation.text
                # An environment without tools reads the turn's text itself (a library's own action syntax).
                parsed = parse_tool_calls(turn_text(self.tokenizer, generation.response_ids), self.tools, self.format) \
                    if self.tools else ParsedTurn(format=self.format)
                traj.tool_calls += parsed.attempted
                traj.calls += [f"{call.name}({json.dumps(call.arguments, default=str)})" for call in parsed.calls]
                traj.tool_errors += len(parsed.errors)
                traj.malformed_calls += len(parsed.errors)
                if not generation.finished:  # cut at its budget: a turn the model never ended is not answered
                    traj.truncated = True
                    break
                if parsed.errors:
                    observation = Observation(error_observation(parsed.errors),
                                              info={"tool_errors": len(parsed.errors)})
                    traj.observations.append(observation_text(observation))
                else:
                    turn = Turn(index=index, text=generation.text, tool_calls=parsed.calls, finished=True)
                    observation = self._call(traj, batcher, "step", self.environment.step, state, turn, turn=index)
                    if not isinstance(observation, Observation):
                        raise EnvironmentFailure(f"environment {self.name!r}: step returned "
                                                 f"{type(observation).__name__}, not a relax.contracts.Observation")
                    traj.observations.append(observation_text(observation))
                    traj.tool_errors += int(observation.info.get("tool_errors", 0))
                    if observation.reward is not None:
                        traj.turn_reward += float(observation.reward)
                    if observation.done:
                        break
                if index == limits.max_turns - 1:
                    traj.truncated = True  # the model would go on, but its turns are spent
                    break
                refs = self._observation_refs(observation, task)
                stop = self._stop_text(generation.response_ids[-1])
                following = self.chat.message(observation, refs, stop)
                if len(traj.response_ids) + len(following.ids) >= limits.max_tokens:
                    traj.truncated = True
                    break
                traj.add_context(following.ids, following.media)
        except EnvironmentFailure as exc:
            traj.error = str(exc)
            traj.failure = exc.kind
        finally:
            self._close(traj, batcher, state)
        return traj

    def _close(self, traj: Trajectory, batcher: GenerationBatcher, state: Any) -> None:
        """The environment's optional ``close(state)``, once per trajectory on every path (``state``
        is None when ``start`` failed). A failing close does not undo the trajectory's tokens or
        outcome: it is recorded in its info (``close_error``)."""
        close = getattr(self.environment, "close", None)
        if not callable(close):
            return
        try:
            self._call(traj, batcher, "close", close, state, turn=None)
        except EnvironmentFailure as exc:
            traj.info["close_error"] = str(exc)

    def _call(self, traj: Trajectory, batcher: GenerationBatcher, hook: str, fn: Callable[..., Any], *args: Any,
              turn: int | None) -> Any:
        """An environment call under the tool timeout, in a span; the batcher does not wait for
        this trajectory meanwhile."""
        with self._span(AGENT_TOOL_CALL, hook=hook, turn=-1 if turn is None else turn, environment=self.name):
            batcher.outside(+1)
            try:
                result, seconds = self.calls.call(hook, fn, *args)
            finally:
                batcher.outside(-1)
        traj.env_s += seconds
        return result

    def _observation_refs(self, observation: Observation, task: AgentTask) -> list[MediaRef]:
        """References to an observation's media items, written once under the run's media folder
        like the data's inline media. An item the run has no modality plugin for is an error of
        the trajectory (never dropped: the model would be trained on a turn it could not see)."""
        if not isinstance(observation.content, list):
            return []
        refs = []
        for item in observation.content:
            kind = item.get("type")
            if kind == "text":
                continue
            if self.media is None or kind not in self.media.plugins:
                raise EnvironmentFailure(f"environment {self.name!r} returned a {kind!r} item, but the run has no "
                                         f"{kind} modality; add it to model.modalities and data.media_keys so the "
                                         "rollout and the trainer can read it")
            value = item.get(kind, item.get("path"))
            try:
                refs.append(self.media.reference(self.media.plugins[kind], kind, "observation", value))
            except Exception as exc:
                raise EnvironmentFailure(f"environment {self.name!r} returned a {kind} the {kind} modality "
                                         f"cannot read: {exc}") from exc
        return refs


class _NoSpan:
    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def set(self, **_: Any) -> None:
        return None
