"""The rollout role: generates a step's samples once the staleness bound admits it, and puts
them on the bus.

A step is cut into units (``relax.runtime.state.ledger``) leased from ``RunState``; the replica that
hosts the run's step loops leases its step's units, extra replicas (``serve``) any admissible one.
A unit's generations become the step's bus columns (``relax.runtime.worker.rows.rollout_columns``),
scored (and their advantages estimated) first when the reward (and advantage) loop rides in this
worker.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from relax.contracts import PluginKind, RolloutContext
from relax.media import MediaSet
from relax.plan.model import RoleWiring
from relax.roles import Column, Role
from relax.runtime.state.records import UnitDone
from relax.runtime.state.run_state import partition_of
from relax.runtime.worker.components import build_planned, build_plugin, planned_context, role_device
from relax.runtime.worker.data import PromptSchedule
from relax.runtime.worker.role_env import RoleEnv
from relax.runtime.worker.rows import rollout_columns
from relax.runtime.worker.sampling import (
    AgentTrajectorySampler,
    Draw,
    DynamicSampling,
    PartialSampler,
    PlainSampler,
    SampledBatch,
    Sampler,
    SamplerKit,
)
from relax.runtime.worker.weight_channels import InProcessWeights, WeightChannel, WeightPull
from relax.telemetry import ROLLOUT_BATCH, WEIGHT_SYNC

if TYPE_CHECKING:
    from relax.runtime.worker.agent import AgentSampler
    from relax.runtime.worker.evaluation import Evaluator
    from relax.runtime.worker.partial import PartialRollouts, VersionWatch
    from relax.runtime.worker.roles.actor import ActorLoop
    from relax.runtime.worker.roles.advantage import AdvantageLoop
    from relax.runtime.worker.roles.reward import RewardLoop


#: Colocate: a lease asked ahead covers the steps of about this long (their acknowledgements and
#: reports ride on it, so they reach ``RunState`` at most this late), and at most this many steps.
LEASE_WINDOW_S = 0.1
LEASE_STEPS_MAX = 8


class RolloutLoop:
    """Generates a step's samples once the staleness bound admits it, and puts them on the bus."""

    role = Role.rollout

    def __init__(self, env: RoleEnv, wiring: RoleWiring, weights: WeightChannel) -> None:
        settings = env.settings
        self.env, self.weights = env, weights
        backend, dataset = wiring.plugins[0], wiring.plugins[1]
        self.context: RolloutContext = planned_context(backend, env.model_path, role_device())
        self.backend = build_plugin(PluginKind.rollout, backend.name, backend.options, self.context)
        self.dataset = build_planned(dataset)
        self.schedule = PromptSchedule(len(self.dataset), settings.prompts_per_step, settings.seed,
                                       settings.data.shuffle)
        self.media = MediaSet.from_info(self.context.media, settings.data.media_dir, env.output_dir / "media")
        """Modality plugins turning a row's media into references (multimodal runs only): the bus
        carries the references, inline items are written once under ``<output_dir>/media``."""
        pad = self.backend.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.backend.tokenizer.eos_token_id)
        self.scorer: RewardLoop | None = None
        """The reward loop riding in this worker (``roles.reward.host: rollout``), if any."""
        self.estimator: AdvantageLoop | None = None
        """The advantage loop riding in this worker, if any."""
        self.learner: ActorLoop | None = None
        """The actor loop in this worker that takes each step's rows in memory (colocate: the plan's
        ``advantage.hands_to``); the rows then never touch the bus."""
        self.ragged = env.work.ragged
        """Several units per step: token columns go ragged (their dense layouts would differ)."""
        self.sole_producer = env.work.units_per_step == 1 and env.work.replica_limit == 1
        """One replica makes every step whole: its acknowledgements need no answer (nothing can
        revoke its lease, and its one unit's stats are the step's). A worker that dies before its
        acknowledgement lands has its unit generated again, as if it died before sending it."""
        self.agent: AgentSampler | None = None
        """Multi-turn trajectories instead of single responses (``roles.rollout.agent``)."""
        if settings.agent is not None:
            from relax.runtime.worker.agent import AgentSampler

            self.agent = AgentSampler(settings.agent, wiring, self.backend, self.media, env.telemetry,
                                      self.context.sampling.max_new_tokens, self.context.max_prompt_tokens,
                                      self.dataset)
        self.partial: PartialRollouts | None = None
        """Partial rollouts (``roles.rollout.partial``): weights swapped mid-generation, and the next
        step's samples started beside this one's tail (``relax.runtime.worker.partial``)."""
        self._watch: VersionWatch | None = None
        self._producing = 0
        """The step being produced (what a weight swap in the middle of it is traced under)."""
        if settings.partial:
            from relax.runtime.worker.partial import PartialRollouts, VersionWatch

            def published(min_version: int, timeout_s: float) -> int | None:
                policy = env.call(env.state.wait_version.remote(min_version, timeout_s))
                return None if policy is None else policy.version

            self._watch = VersionWatch(published, lambda: self.backend.version)
            self.partial = PartialRollouts(self.backend, settings.staleness_policy(), self._watch.newer, self._swap)
        self._eval_wiring = wiring if wiring.evaluation is not None else None
        self._evaluator: Evaluator | None = None
        """The held-out evaluation (``data.eval``), built on first use: its scorer may be the reward
        loop that rides in this worker, which is attached after this constructor."""
        self._sampler: Sampler | None = None
        """What draws a unit's samples (the plan's ``RunSettings.sampler``), built on first use:
        dynamic sampling scores with the reward loop riding in this worker, attached after this
        constructor."""
        self.producer = Producer(env)
        """A sole producer's puts and acknowledgements, in a thread of their own."""
        self._acknowledging: list[tuple[Any, ...]] = []
        """Colocate: the ``RunState.complete`` arguments (less the holder) of the steps produced
        since the last lease asked ahead, sent by ``step`` with the next one."""
        self._step_started = 0.0
        self._step_s = 0.0
        """The time between the starts of the last two steps here (the worker's pace)."""

    @property
    def colocated(self) -> bool:
        """Colocate mode: the actor trains in this process and hands each version over in memory,
        whether or not the rows also go through the bus (they do when a reference or critic reads
        them). RunState is never told of those versions, so a lease asked with admission would
        wait out its whole wait slice: a colocated rollout asks without."""
        return isinstance(self.weights, InProcessWeights)

    @property
    def sampler(self) -> Sampler:
        """The sampler the plan names (``RunSettings.sampler``): plain, agent or partial, wrapped in
        DAPO's dynamic sampling when the run uses it."""
        if self._sampler is None:
            self._sampler = self._build_sampler()
        return self._sampler

    def _build_sampler(self) -> Sampler:
        settings = self.env.settings
        kit = SamplerKit(settings, self.backend, self.dataset, self.context.sampling, self.media)
        dynamic = settings.sampler.startswith("dynamic(")
        inner = settings.sampler.removeprefix("dynamic(").removesuffix(")")
        sampler: Sampler
        if inner == "agent" and self.agent is not None:
            sampler = AgentTrajectorySampler(kit, self.agent)
        elif inner == "partial" and self.partial is not None:
            sampler = PartialSampler(kit, self.partial, self.schedule)
        elif inner == "plain":
            sampler = PlainSampler(kit)
        else:
            raise RuntimeError(f"the plan names the rollout sampler '{settings.sampler}', which this rollout cannot "
                               "build; plan the run again (relax plan) with this version of relax")
        # Dynamic sampling needs the rewards before the put: the scorer riding in this worker. An
        # extra replica without it (an elastic run's) draws with the inner sampler alone.
        if dynamic and self.scorer is not None:
            sampler = DynamicSampling(sampler, self.scorer, self.schedule, settings, self.pad_token_id)
        return sampler

    def step(self, step: int) -> dict[str, Any]:
        """The step's rollout, on the replica that hosts the run's step loops: lease this step's
        units until every one is acknowledged (other replicas may generate some of them), then
        report the step from the units' own stats."""
        now = time.perf_counter()
        if self._step_started:
            self._step_s = now - self._step_started
        self._step_started = now
        asked = now
        while (got := self.env.lease(step)).unit is not None:
            done = self.produce(got.unit, asked)
            if done.step_stats is not None:  # this unit completed the step
                if self.sole_producer and step + 1 < self.env.settings.steps:
                    if not self.env.leased_ahead(step + 1):  # granted while the step trains, or in flight
                        acknowledging, self._acknowledging = self._acknowledging, []
                        # separate: admitted leases carry the policy to load (no wait_version call)
                        self.env.lease_ahead(self._steps_to_lease(step + 1), acknowledging,
                                             admit=not self.colocated)
                elif self._acknowledging:  # no lease asked ahead (the last step): what is unacknowledged, in one call
                    acknowledging, self._acknowledging = self._acknowledging, []
                    self.env.state.complete_and_lease.remote(self.env.holder, acknowledging, [], 0.0)
                self.evaluate_if_due()
                return merge_unit_stats(done.step_stats)
            asked = time.perf_counter()
        self.evaluate_if_due()
        return merge_unit_stats(self.env.call(self.env.state.step_stats.remote(step)))

    def _steps_to_lease(self, first: int) -> list[int]:
        """The steps a lease asked ahead covers: in colocate mode as many as fit in about
        ``LEASE_WINDOW_S`` at the last step's pace (at most ``LEASE_STEPS_MAX``), so a run of short
        steps makes one call to ``RunState`` every few steps; elsewhere only ``first``, whose rows
        are acknowledged with their put."""
        if not self.colocated or self._step_s <= 0:
            return [first]
        count = max(1, min(LEASE_STEPS_MAX, int(LEASE_WINDOW_S / self._step_s)))
        return list(range(first, min(first + count, self.env.settings.steps)))

    def evaluate_if_due(self) -> None:
        """Evaluate the held policy version on ``data.eval`` when it is due (``relax.runtime.worker.evaluation``):
        after a step is produced, so in separate mode it runs while the actor trains on that step."""
        if self._eval_wiring is None:
            return
        evaluator = self._evaluator or self._build_evaluator()
        version = self.backend.version
        if not evaluator.due(version):
            return
        evaluator.run(self.env, version, self._producing, "rollout")

    def finish(self) -> None:
        """After the last step: evaluate the final policy version (it is published once the actor
        trained the last step), if the run evaluates."""
        if self._eval_wiring is None:
            return
        steps = self.env.settings.steps
        with self.env.activity.waiting(f"rollout waits for the final policy v{steps} to evaluate it"):
            version, weights = self.weights.wait(steps, self.backend.version)
        self._load(version, weights)
        self.evaluate_if_due()

    def _build_evaluator(self) -> Evaluator:
        from relax.runtime.worker.components import build_scorer
        from relax.runtime.worker.evaluation import Evaluator

        wiring = self._eval_wiring
        scorer = build_scorer(wiring.evaluation_rewards) if wiring.evaluation_rewards else self.scorer.rewards
        self._evaluator = Evaluator(self.env.settings, self.backend, build_planned(wiring.evaluation), scorer,
                                    self.context.sampling)
        self._evaluator.skip_evaluated(self.env)
        return self._evaluator

    def serve(self) -> int:
        """An extra replica: generate any admissible unit until every step is produced or the
        replica is drained. Returns the units it produced."""
        produced = 0
        asked = time.perf_counter()
        while (got := self.env.lease(None)).unit is not None:
            produced += self.produce(got.unit, asked).accepted
            asked = time.perf_counter()
        return produced

    def produce(self, unit: dict[str, Any], asked: float | None = None) -> UnitDone:
        """Generate one leased unit, put its rows and acknowledge it: whether it counts (not when
        the lease was revoked meanwhile: the rows just put are orphans that readers skip), and the
        step's unit stats when it completed its step. ``asked``: when its lease was asked for
        (``time.perf_counter``); the wait for it counts as admission wait (``time/wait_s``), as in
        separate mode RunState holds the lease until the staleness bound admits the step."""
        settings, env = self.env.settings, self.env
        step = unit["step"]
        t0 = time.perf_counter()
        leased_s = t0 - asked if asked is not None else 0.0
        self._producing = step
        # Admission: the batch of step s is generated by a version the staleness policy admits.
        policy = env.staleness()
        bound = policy.bound
        if self.partial is not None:
            self.partial.policy = policy
        version, weights = self.weights.wait(policy.min_version(step), self.backend.version)
        t1 = time.perf_counter()
        tel = env.telemetry
        self._load(version, weights)
        t2 = time.perf_counter()
        held = self.backend.version
        indices = self.schedule.indices(step)[unit["start"]:unit["stop"]]
        with env.activity.busy(f"rollout generates step {step} unit {unit['unit']}"):
            with tel.span(ROLLOUT_BATCH, step=step, policy_version=held, unit=unit["unit"],
                          attempt=unit["attempt"]) as span:
                carrier = span.carrier()  # each row carries the context of the batch that made it
                batch = self.sampler.sample(Draw(step, 0, indices, unit, carrier))
                rollout_s = batch.generate_s
                span.set(samples=len(batch.gens), tokens=batch.tokens, staleness=step - held)
            columns = rollout_columns(batch.gens, [r["prompt"] for r in batch.rows], [r["label"] for r in batch.rows],
                                      self.pad_token_id,
                                      [r["media"] for r in batch.rows] if self.media is not None else None,
                                      ragged=self.ragged)
            if batch.contexts is not None:  # agentic: every media item of each trajectory, in token order
                columns[Column.media] = batch.contexts
            ready = [Column.response]
            if self.scorer is not None:  # score (and estimate) before the one put of the step
                columns[Column.rewards] = (batch.rewards if batch.rewards is not None
                                      else self.scorer.score(step, columns, batch.meta))
                ready.append(Column.rewards)
                if self.estimator is not None:
                    from relax.runtime.worker.roles.advantage import kept_rows

                    groups = torch.tensor([g.prompt_index for g in batch.gens], dtype=torch.long)
                    produced = self.estimator.estimate(step, columns[Column.rewards], groups, columns,
                                                       *kept_rows(batch.meta))
                    columns.update(produced)
                    ready += list(produced)
        t3 = time.perf_counter()
        skipped = {}
        if self.media is not None:  # rows replaced for bad media (data.on_bad_sample: skip)
            skipped, self.media.skipped = {"skipped_samples": self.media.skipped}, 0
        stats = {"admission_wait_s": leased_s + t1 - t0, "weight_load_s": t2 - t1, "rollout_s": rollout_s,
                 "response_tokens": batch.tokens, "policy_version": held, "staleness_bound": bound,
                 "order": batch.order, "holder": env.holder, **lengths(batch), **batch.sampling, **skipped,
                 **batch.stats}
        if self.learner is not None:  # colocate: the actor beside it takes the rows, and the ack is not awaited
            self.learner.hand(step, columns, batch.meta)
            stats["bus_s"] = time.perf_counter() - t3
            # sent by step(): with the next lease it asks ahead
            self._acknowledging.append((step, unit["unit"], unit["attempt"], stats, ready))
            return UnitDone(accepted=True, step_stats=[stats])
        if self.sole_producer:
            # Put and acknowledge in the background while this thread goes on to the next step; only
            # the wait for the previous put (one at a time, in order) counts as this step's bus time.
            self.producer.flush()
            stats["bus_s"] = time.perf_counter() - t3
            self.producer.put(partition_of(step), columns, batch.meta,
                              (env.holder, step, unit["unit"], unit["attempt"], stats, ready))
            if step + 1 >= settings.steps:
                self.producer.flush()  # the run's last rows are on the bus before the loop reports its last step
            return UnitDone(accepted=True, step_stats=[stats])
        env.bus.put(partition_of(step), columns, batch.meta)
        stats["bus_s"] = time.perf_counter() - t3
        # The acknowledgement announces the step's columns once its last unit is in.
        return env.call(env.state.complete.remote(env.holder, step, unit["unit"], unit["attempt"], stats, ready))

    def _load(self, version: int, weights: Any) -> None:
        """Load policy ``version`` into the backend (nothing when ``weights`` is None: held already)."""
        if weights is None:
            return
        with self.env.telemetry.span(WEIGHT_SYNC, step=self._producing, role=Role.rollout, policy_version=version), \
                self.env.activity.busy(f"rollout loads weights v{version}"):
            if isinstance(weights, WeightPull):  # collective: received straight into the backend
                weights.into(self.backend)
            else:
                self.backend.load_weights(weights, version)

    def _swap(self) -> None:
        """Partial rollouts: load the newest published policy in the middle of a step's generation."""
        held = self.backend.version
        self._load(*self.weights.wait(held + 1, held))

    def close(self) -> None:
        """Stop the agent gateway's endpoint and the version watch, if any (the worker is closing)."""
        if self.agent is not None:
            self.agent.close()
        if self._watch is not None:
            self._watch.close()


class Producer:
    """A sole producer's puts and acknowledgements, one at a time and in order, in a thread of their
    own while the rollout generates the next step. Nothing can revoke a sole producer's lease, so an
    acknowledgement is sent without waiting for its answer."""

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-put")
        self._putting: Future | None = None

    def put(self, partition: str, columns: dict[str, Any], meta: list[dict[str, Any]], ack: tuple) -> None:
        """Put ``columns`` on the bus and send ``ack`` (``RunState.complete``'s arguments) after it,
        in the background; call ``flush`` first, as one put runs at a time."""
        self._putting = self._thread.submit(self._put_and_ack, partition, columns, meta, ack)

    def _put_and_ack(self, partition: str, columns: dict[str, Any], meta: list[dict[str, Any]], ack: tuple) -> None:
        self.env.bus.put(partition, columns, meta)
        self.env.state.complete.remote(*ack)  # nothing can revoke a sole producer's lease: not awaited

    def flush(self) -> None:
        """Wait for the put in flight, if any, raising its failure (the rows never reached the bus)."""
        putting, self._putting = self._putting, None
        if putting is not None:
            putting.result()


def merge_unit_stats(units: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's rollout report from its units' stats: times and tokens add up, the policy version
    is the oldest that generated any of them, ``data_order`` hashes the prompts in step order."""
    merged: dict[str, Any] = {key: sum(u[key] for u in units) for key in
                              ("admission_wait_s", "weight_load_s", "rollout_s", "bus_s", "response_tokens")}
    order = [index for u in units for index in u["order"]]
    merged.update(policy_version=min(u["policy_version"] for u in units),
                  staleness_bound=max(u.get("staleness_bound", 0) for u in units),
                  data_order=hashlib.sha1(repr(order).encode()).hexdigest()[:12],
                  units=len(units), replicas=len({u["holder"] for u in units}))
    for key in ("sampling_rounds", "sampling_filter_rate", "sampling_topped_up", "skipped_samples",
                *LENGTH_TOTALS, *AGENT_TOTALS, *PARTIAL_TOTALS):
        if any(key in u for u in units):
            merged[key] = sum(u.get(key, 0) for u in units)
    for key in sorted({k for u in units for k in u if k.startswith(AGENT_PER_KIND)}):
        merged[key] = sum(u.get(key, 0) for u in units)  # outcomes and refused calls, per kind
    if any("response_tokens_max" in u for u in units):
        merged["response_tokens_max"] = max(u.get("response_tokens_max", 0) for u in units)
    for key in AGENT_MEANS:  # per trajectory: the units' means, weighted by their samples
        if any(key in u for u in units):
            weights = [u.get("agent_trajectories", 1) for u in units]
            merged[key] = sum(u.get(key, 0.0) * w for u, w in zip(units, weights)) / max(sum(weights), 1)
    return merged


def lengths(batch: SampledBatch) -> dict[str, int]:
    """A unit's length figures (``response_length/*``, ``prompt_length/mean`` in the step's row):
    its samples, their prompt tokens, the longest response, and the responses cut short: that hit
    ``max_new_tokens`` before they ended, or (agentic) trajectories truncated by a budget."""
    clipped = 0
    for gen, meta in zip(batch.gens, batch.meta):
        summary = meta.get("agent")
        clipped += bool(summary.get("truncated")) if isinstance(summary, dict) else not gen.finished
    return {"rollout_samples": len(batch.gens), "prompt_tokens": sum(len(g.prompt_ids) for g in batch.gens),
            "response_tokens_max": max((len(g.response_ids) for g in batch.gens), default=0),
            "clipped": clipped}


#: Length figures that add up over a step's units (``lengths``).
LENGTH_TOTALS = ("rollout_samples", "prompt_tokens", "clipped")
#: Agentic unit stats that add up over a step's units, and those that are means per trajectory.
AGENT_TOTALS = ("agent_tool_errors", "agent_failed", "agent_env_s", "agent_trajectories", "agent_generate_calls",
                "agent_regenerated")
AGENT_MEANS = ("agent_turns", "agent_tool_calls", "agent_truncated", "agent_segments")
#: Agentic unit stats counted per kind (``agent_outcome/<outcome>``, ``agent_malformed_calls/<format>``): totals.
AGENT_PER_KIND = ("agent_outcome/", "agent_malformed_calls/", "agent_cause/")
#: Partial-rollout unit stats (``relax.runtime.worker.partial.PartialStats``), all totals.
PARTIAL_TOTALS = ("partial_samples", "partial_interrupted", "partial_versions", "partial_calls", "partial_swaps")
