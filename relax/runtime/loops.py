"""What each role does for one training step, given the bus and the run's control-plane service.

A loop owns its plugin objects and does one step's work per call; a worker (``workers.py``)
hosts one or more loops in one Ray process. The data path is the bus only: the rollout writes a
step's rows to partition ``step-<n>``, the reward and advantage tasks add their columns, and the
actor takes the finished rows. ``RunState`` only says when a column is ready and which policy
version exists, so nobody polls.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import ray
import torch

from relax.bus import Bus, BusBatch
from relax.contracts import Generation, RewardSample
from relax.runtime.checkpoint import save_checkpoint
from relax.runtime.components import (
    build_advantage,
    build_dataset,
    build_rewards,
    build_rollout,
)
from relax.runtime.data import PromptSchedule, prompt_rows, sampling_seed
from relax.media import MediaSet, loads_context
from relax.runtime.health import Activity
from relax.runtime.ranks import RankPlacement, build_role_trainer
from relax.runtime.run_state import partition_of
from relax.runtime.rows import TRAIN_COLUMNS, media_columns, relayout, restack, rollout_columns, token_column, train_batch
from relax.spec.models import RunSpec
from relax.spec.rules import advantage_reads, rollout_units
from relax.telemetry import ADVANTAGE_COMPUTE, CHECKPOINT, REWARD_SCORE, ROLLOUT_BATCH, TRAIN_STEP, WEIGHT_SYNC, Telemetry

#: Longest single wait on the control plane before re-checking whether the run was stopped.
WAIT_SLICE_S = 2.0


class RunStopped(Exception):
    """The run was stopped (by a failure elsewhere or by the user) while this role waited."""


class StalenessViolation(RuntimeError):
    """A batch holds samples older than ``async_policy.max_staleness`` allows: never trained."""


@dataclass
class RoleEnv:
    """What every loop of a run shares inside one worker process."""

    spec: RunSpec
    base_dir: Path
    output_dir: Path
    bus: Bus
    state: Any
    """The ``RunState`` actor handle."""
    timeout_s: float
    threads: int | None
    model_path: str
    """The model as a local folder (built-in models are materialized by the driver first)."""
    telemetry: Telemetry
    """This process's tracer: spans join the run's trace and parent to their step."""
    holder: str = "worker"
    """This worker's name in the run (heartbeats, rollout leases)."""
    activity: Activity = field(default_factory=Activity)
    """What this worker does right now, for its heartbeat."""
    ranks: dict[str, list[RankPlacement]] = field(default_factory=dict)
    """The ranks of each model role hosted here that spans several processes (rank 0 first)."""

    def build_trainer(self, role: str) -> Any:
        """A model role's backend: in this process, or across its ranks (``relax.runtime.ranks``)."""
        return build_role_trainer(self.spec, self.model_path, self.threads, role, self.ranks.get(role), self.timeout_s)

    @property
    def batch_size(self) -> int:
        return self.spec.algorithm.prompts_per_step * self.spec.algorithm.samples_per_prompt

    def call(self, ref: Any) -> Any:
        """``ray.get`` of a call to ``RunState``, bounded (a lost control plane fails the role)."""
        return ray.get(ref, timeout=self.timeout_s)

    def wait(self, method: str, *args: Any) -> Any:
        """Block on a ``RunState`` wait in slices, failing clearly on stop, or once the whole run
        has stood still for ``fault_tolerance.wait_timeout_s`` (a role waits as long as the run
        moves: a slow producer upstream is not a failure, a dead or stuck one is)."""
        started = time.monotonic()
        with self.activity.waiting(f"{method}{args}"):
            while True:
                result = self.call(getattr(self.state, method).remote(*args, WAIT_SLICE_S))
                if result:
                    return result
                status = self.call(self.state.status.remote())
                if status["stopped"]:
                    raise RunStopped(f"run stopped while waiting ({method}{args})")
                if min(time.monotonic() - started, status["stalled_s"]) > self.timeout_s:
                    raise TimeoutError(f"waited {time.monotonic() - started:.0f} s for {method}{args} while "
                                       f"nothing moved in the run for {status['stalled_s']:.0f} s "
                                       "(fault_tolerance.wait_timeout_s); the role that should provide it is "
                                       "stuck or dead")

    def lease(self, only_step: int | None) -> dict[str, Any]:
        """The next rollout unit for this worker (see ``RunState.lease``)."""
        return self.wait("lease", self.holder, self.spec.async_policy.max_staleness, only_step)

    def bus_task(self, step: int, done: dict[int, dict[str, Any]], after: str | tuple[str, ...], fields: tuple[str, ...],
                 task: str, work: Any) -> dict[str, Any]:
        """One step of a task that reads rows from the bus, unless a co-hosted loop already did the
        step in memory (its stats wait in ``done``). ``work(step, batch)`` computes and writes; the
        time outside it is bus time."""
        if step not in done:
            started = time.perf_counter()
            work(step, self.take(step, after, fields, task))
            computed = sum(v for k, v in done[step].items() if k.endswith("_s") and k != "bus_s")
            done[step]["bus_s"] = time.perf_counter() - started - computed
        return done.pop(step)

    def take(self, step: int, after: str | tuple[str, ...], fields: tuple[str, ...], task: str) -> BusBatch:
        """This task's rows of a step, once every column in ``after`` has been announced for them:
        exactly the rows of the acknowledged rollout attempts (orphans of a failed replica are
        skipped and counted as dropped), in sample order, token columns in one layout."""
        partition = partition_of(step)
        for name in (after,) if isinstance(after, str) else after:
            self.wait("wait_ready", partition, name)
        info = self.call(self.state.unit_info.remote(step))
        mixed = info["units"] > 1
        with self.activity.busy(f"{task} reads step {step}"):
            if not info["retried"]:
                batch = self.bus.get(partition, list(fields), task=task, batch_size=self.batch_size,
                                     timeout_s=self.timeout_s)
                keep = list(range(len(batch)))
            else:  # a replica failed during this step: its unacknowledged rows may be here too
                ready = self.bus.counts(partition, task=task, fields=fields).ready
                batch = self.bus.get(partition, list(fields), task=task, batch_size=max(ready, self.batch_size),
                                     timeout_s=self.timeout_s)
                keep, orphans = accepted_rows(batch.meta, info["accepted"])
                for (unit, attempt), rows in orphans.items():
                    self.state.drop.remote(step, unit, attempt, rows)
                if len(keep) != self.batch_size:
                    raise RuntimeError(f"step {step} has {len(keep)} acknowledged rows for {task}, expected "
                                       f"{self.batch_size}; the bus and the rollout ledger disagree")
            order = sorted(keep, key=lambda i: sample_key(batch.meta[i]))
            if order != list(range(len(batch))):
                batch = batch.select(order)
            if info["retried"]:
                batch = restack(batch, keep_ragged=mixed)
            return relayout(batch) if mixed else batch

    def announce(self, step: int, *columns: str) -> None:
        """Tell waiting roles that ``columns`` of a step are on the bus (ordered after the writes
        of this process, so nothing needs to be awaited)."""
        for column in columns:
            self.state.announce.remote(partition_of(step), column)


def sample_key(meta: Any) -> tuple[int, int]:
    """Where a row sits in its step: (its prompt's position, its sample of that prompt)."""
    return int(meta.extra["group"]), int(meta.extra.get("sample", 0))


def accepted_rows(meta: list[Any], accepted: dict[int, int]) -> tuple[list[int], dict[tuple[int, int], int]]:
    """Positions of the rows of acknowledged attempts, and the orphan rows per (unit, attempt)."""
    keep, orphans = [], {}
    for i, m in enumerate(meta):
        key = int(m.extra.get("unit", 0)), int(m.extra.get("attempt", 1))
        if accepted.get(key[0]) == key[1]:
            keep.append(i)
        else:
            orphans[key] = orphans.get(key, 0) + 1
    return keep, orphans


def group_ids(meta: list[Any]) -> torch.Tensor:
    """The group of each row (the index of the prompt it answers), from the rows' metadata."""
    return torch.tensor([int(m.extra["group"]) for m in meta], dtype=torch.long)


class WeightChannel(Protocol):
    """How new policy weights reach a rollout backend."""

    def publish(self, version: int, weights: dict[str, Any]) -> None: ...

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | WeightPull | None]:
        """The newest version (at least ``min_version``) and, when newer than ``held``, its weights:
        a state dict, or a ``WeightPull`` that receives them straight into the backend."""
        ...


class InProcessWeights:
    """Colocate: the trainer and the rollout share a process; the newest weights are just handed over."""

    def __init__(self) -> None:
        self.version = 0
        self.weights: dict[str, Any] | None = None

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        self.version, self.weights = version, weights

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | None]:
        if self.version < min_version:
            raise RuntimeError(f"colocated rollout needs policy version {min_version} but the trainer is at "
                               f"{self.version}; steps ran out of order")
        return self.version, (self.weights if self.version > held else None)


class ObjectStoreWeights:
    """Separate/hybrid: weights go through Ray's object store; ``RunState`` holds the reference."""

    def __init__(self, env: RoleEnv) -> None:
        self.env = env

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        # Not awaited: calls from one process to one actor run in order, and the reference keeps
        # the weights alive in this process's object store until a newer version replaces them.
        self.env.state.publish.remote(version, [ray.put(weights)])

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | None]:
        version, refs = self.env.wait("wait_version", min_version)
        return version, (ray.get(refs[0], timeout=self.env.timeout_s) if version > held else None)


class CollectiveWeights:
    """Separate/hybrid with ``roles.rollout.weight_sync: collective``: weights go from the actor's
    rank 0 to each rollout replica over a weight group of their own (``relax.weight_group``:
    NCCL on GPUs, gloo on CPU), pulled by the replica when it needs a newer version.

    The actor's side keeps its newest snapshot and publishes only the version (plus an object-store
    reference when ``object_store`` too, for an ``actor_fwd`` in another worker). A replica's side
    waits for the version, then asks the actor's worker (registered in ``RunState``) to send its
    snapshot over the replica's group (``RoleWorker.send_weights``, on a free thread of that worker)
    while it receives straight into its backend. The group is opened on a replica's first pull, so a
    replica added mid-run, or a restarted one, joins the same way; a restarted actor is a new sender,
    for which the replica opens a new group."""

    def __init__(self, env: RoleEnv, object_store: bool = False) -> None:
        self.env = env
        self.object_store = object_store
        self.snapshot: tuple[int, dict[str, Any]] | None = None
        """The actor's newest ``(version, weights)``: what a pull sends."""
        self.groups: dict[str, Any] = {}
        """The actor's ``WeightSender`` per rollout replica (by holder)."""
        self.sender: Any = None
        """A replica's sender (the actor worker's handle) whose group its backend joined."""

    # -- the actor's side ----------------------------------------------------------------------

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        self.snapshot = (version, weights)  # before the version is announced: a pull sends >= it
        self.env.state.publish.remote(version, [ray.put(weights)] if self.object_store else [])

    def open(self, holder: str, receivers: int) -> dict[str, Any]:
        """A new weight group for replica ``holder`` (replacing its old one): its address."""
        from relax.weight_group import WeightSender

        old = self.groups.pop(holder, None)
        if old is not None:
            old.close()
        sender = WeightSender(receivers, timeout_s=self.env.timeout_s, host=ray.util.get_node_ip_address())
        self.groups[holder] = sender
        return sender.address.as_dict()

    def send(self, holder: str) -> dict[str, Any]:
        """Broadcast the newest snapshot over ``holder``'s group; its version, size and times. A
        failed send drops the group (the replica opens a new one on its next pull)."""
        if self.snapshot is None or holder not in self.groups:
            raise RuntimeError(f"rollout replica {holder} asked for weights before "
                               f"{'the actor published any' if self.snapshot is None else 'opening its group'}")
        version, weights = self.snapshot
        sender = self.groups[holder]
        # Not marked in env.activity: that is the run thread's state, and this runs beside it.
        try:
            stats = sender.send(weights, version)
        except Exception:
            if self.groups.get(holder) is sender:  # not a newer group the replica opened meanwhile
                del self.groups[holder]
            sender.close()
            raise
        return {"version": version, **stats}

    # -- a rollout replica's side -------------------------------------------------------------------

    def wait(self, min_version: int, held: int) -> tuple[int, WeightPull | None]:
        version, _ = self.env.wait("wait_version", min_version)
        return version, (WeightPull(self) if version > held else None)

    def pull(self, backend: Any) -> int:
        """Receive the actor's newest weights into ``backend`` (joining a group first if needed);
        the version received, which the backend now holds."""
        env = self.env
        sender = env.call(env.state.weight_sender.remote())
        if sender is None:
            raise RuntimeError("no actor worker registered to send weights (roles.rollout.weight_sync: "
                               "collective); the actor failed to start or runs in another run")
        if self.sender is None or self.sender._actor_id != sender._actor_id:
            address = env.call(sender.open_weight_group.remote(env.holder, int(backend.weight_group_ranks)))
            backend.join_weight_group(address)
            self.sender = sender
        sent = sender.send_weights.remote(env.holder)
        try:
            version = backend.receive_weights()
            env.call(sent)
        except Exception:
            self.sender = None  # a new group on the next pull
            raise
        return version


@dataclass
class WeightPull:
    """A newer version to pull (what ``CollectiveWeights.wait`` returns instead of the weights)."""

    channel: CollectiveWeights

    def into(self, backend: Any) -> int:
        return self.channel.pull(backend)


class RolloutLoop:
    """Generates a step's samples once the staleness bound admits it, and puts them on the bus."""

    role = "rollout"

    def __init__(self, env: RoleEnv, weights: WeightChannel) -> None:
        spec = env.spec
        self.env, self.weights = env, weights
        self.backend = build_rollout(spec, env.model_path, env.threads)
        self.dataset = build_dataset(spec, env.base_dir)
        self.schedule = PromptSchedule(len(self.dataset), spec.algorithm.prompts_per_step, spec.seed,
                                       spec.data.shuffle)
        self.media = MediaSet.from_spec(spec, env.base_dir, env.output_dir / "media")
        """Modality plugins turning a row's media into references (multimodal runs only): the bus
        carries the references, inline items are written once under ``<output_dir>/media``."""
        pad = self.backend.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.backend.tokenizer.eos_token_id)
        self.scorer: RewardLoop | None = None
        """The reward loop riding in this worker (``roles.reward.host: rollout``), if any."""
        self.estimator: AdvantageLoop | None = None
        """The advantage loop riding in this worker, if any."""
        self.ragged = rollout_units(spec)[1] > 1
        """Several units per step: token columns go ragged (their dense layouts would differ)."""

    @property
    def dynamic_sampling(self) -> bool:
        """DAPO's dynamic sampling: groups with all-equal rewards are replaced by fresh prompts.
        It needs the rewards before the put, so only with the scorer riding in this worker."""
        return bool(self.env.spec.algorithm.dynamic_sampling.enabled) and self.scorer is not None

    def step(self, step: int) -> dict[str, Any]:
        """The step's rollout, on the replica that hosts the run's step loops: lease this step's
        units until every one is acknowledged (other replicas may generate some of them), then
        report the step from the units' own stats."""
        while "unit" in (got := self.env.lease(step)):
            self.produce(got["unit"])
        units = self.env.call(self.env.state.step_stats.remote(step))
        return merge_unit_stats(units)

    def serve(self) -> int:
        """An extra replica: generate any admissible unit until every step is produced or the
        replica is drained. Returns the units it produced."""
        produced = 0
        while "unit" in (got := self.env.lease(None)):
            produced += self.produce(got["unit"])
        return produced

    def produce(self, unit: dict[str, Any]) -> bool:
        """Generate one leased unit, put its rows and acknowledge it; False when the lease was
        revoked meanwhile (the rows just put are orphans that readers skip)."""
        spec, env = self.env.spec, self.env
        step = unit["step"]
        t0 = time.perf_counter()
        # Admission: the batch of step s may be generated by version v only if s - v <= k.
        version, weights = self.weights.wait(step - spec.async_policy.max_staleness, self.backend.version)
        t1 = time.perf_counter()
        tel = env.telemetry
        if weights is not None:
            with tel.span(WEIGHT_SYNC, step=step, role="rollout", policy_version=version), \
                    env.activity.busy(f"rollout loads weights v{version}"):
                if isinstance(weights, WeightPull):  # collective: received straight into the backend
                    weights.into(self.backend)
                else:
                    self.backend.load_weights(weights, version)
        t2 = time.perf_counter()
        held = self.backend.version
        indices = self.schedule.indices(step)[unit["start"]:unit["stop"]]
        with env.activity.busy(f"rollout generates step {step} unit {unit['unit']}"):
            with tel.span(ROLLOUT_BATCH, step=step, policy_version=held, unit=unit["unit"],
                          attempt=unit["attempt"]) as span:
                carrier = span.carrier()  # each row carries the context of the batch that made it
                batch = self._sample(step, 0, indices, carrier, unit)
                sampling: dict[str, Any] = {}
                if self.dynamic_sampling:
                    batch, sampling = self._refill(step, batch, carrier, unit)
                rollout_s = batch.generate_s
                span.set(samples=len(batch.gens), tokens=batch.tokens, staleness=step - held)
            columns = rollout_columns(batch.gens, [r["prompt"] for r in batch.rows], [r["label"] for r in batch.rows],
                                      self.pad_token_id,
                                      [r["media"] for r in batch.rows] if self.media is not None else None,
                                      ragged=self.ragged)
            ready = ["response"]
            if self.scorer is not None:  # score (and estimate) before the one put of the step
                columns["rewards"] = (batch.rewards if batch.rewards is not None
                                      else self.scorer.score(step, columns, batch.meta))
                ready.append("rewards")
                if self.estimator is not None:
                    groups = torch.tensor([g.prompt_index for g in batch.gens], dtype=torch.long)
                    produced = self.estimator.estimate(step, columns["rewards"], groups, columns)
                    columns.update(produced)
                    ready += list(produced)
        t3 = time.perf_counter()
        env.bus.put(partition_of(step), columns, batch.meta)
        skipped = {}
        if self.media is not None:  # rows replaced for bad media (data.on_bad_sample: skip)
            skipped, self.media.skipped = {"skipped_samples": self.media.skipped}, 0
        stats = {"admission_wait_s": t1 - t0, "weight_load_s": t2 - t1, "rollout_s": rollout_s,
                 "bus_s": time.perf_counter() - t3, "response_tokens": batch.tokens, "policy_version": held,
                 "order": batch.order, "holder": env.holder, **sampling, **skipped}
        # The acknowledgement announces the step's columns once its last unit is in.
        return bool(env.call(env.state.complete.remote(env.holder, step, unit["unit"], unit["attempt"], stats, ready)))

    def _sample(self, step: int, round_: int, indices: list[int], carrier: dict[str, str],
                unit: dict[str, Any]) -> SampledBatch:
        """Generate ``samples_per_prompt`` responses to each prompt of ``indices`` (the prompts of
        ``unit``). The seed depends on the step, the round and the unit only, so a unit generated
        again after a failure, on any replica, draws the same samples from the same weights."""
        spec = self.env.spec
        n = spec.algorithm.samples_per_prompt
        rows = prompt_rows(self.dataset, indices, spec.data.prompt_key, spec.data.label_key, spec.data.reward_key,
                           self.media)
        started = time.perf_counter()
        media = {}
        if self.media is not None:  # each prompt's media references (never the decoded media)
            media = {"media": [loads_context(r["media"])[1] for r in rows]}
        gens: list[Generation] = self.backend.generate([r["prompt"] for r in rows], n, spec.roles.rollout.sampling,
                                                       sampling_seed(spec.seed, step) + round_ * 104_729
                                                       + unit["unit"] * 7_919, **media)
        generate_s = time.perf_counter() - started
        tag = f"{step}" if round_ == 0 else f"{step}r{round_}"
        meta = [{"policy_version": self.backend.version, "sample_id": f"{tag}:{unit['start'] + g.prompt_index}:{i % n}",
                 "index": rows[g.prompt_index]["index"],
                 "group": unit["start"] + g.prompt_index, "sample": i % n, "unit": unit["unit"],
                 "attempt": unit["attempt"], "trace": carrier, "response_tokens": len(g.response_ids),
                 **({"reward_route": rows[g.prompt_index]["route"]} if "route" in rows[g.prompt_index] else {})}
                for i, g in enumerate(gens)]
        return SampledBatch(rows=rows, gens=gens, meta=meta, order=list(indices), generate_s=generate_s)

    def _refill(self, step: int, first: SampledBatch, carrier: dict[str, str],
                unit: dict[str, Any]) -> tuple[SampledBatch, dict[str, Any]]:
        """DAPO dynamic sampling: score each round, keep the groups whose rewards differ, and sample
        more prompts (``PromptSchedule.extra``) until ``prompts_per_step`` groups are kept or
        ``dynamic_sampling.max_rounds`` rounds are spent. A short batch is topped up with dropped
        groups (zero advantage for the group estimators) so every step has the same size."""
        from relax.algo.dynamic_sampling import filter_groups

        spec = self.env.spec
        want = spec.algorithm.prompts_per_step
        kept: list[tuple[SampledBatch, int]] = []
        dropped: list[tuple[SampledBatch, int]] = []
        rounds, groups_seen, all_rewards, batch = 0, 0, [], first
        generate_s = score_s = 0.0
        while True:
            columns = rollout_columns(batch.gens, [r["prompt"] for r in batch.rows], [r["label"] for r in batch.rows],
                                      self.pad_token_id)
            started = time.perf_counter()
            batch.rewards = self.scorer.score(step, columns, batch.meta)
            score_s += time.perf_counter() - started
            generate_s += batch.generate_s
            all_rewards.append(batch.rewards)
            groups = torch.tensor([g.prompt_index for g in batch.gens], dtype=torch.long)
            verdict = filter_groups(batch.rewards, groups)
            kept += [(batch, int(g)) for g in verdict.kept_groups]
            dropped += [(batch, int(g)) for g in verdict.dropped_groups]
            groups_seen += len(batch.rows)
            rounds += 1
            if len(kept) >= want or rounds >= spec.algorithm.dynamic_sampling.max_rounds:
                break
            batch = self._sample(step, rounds, self.schedule.extra(step, rounds), carrier, unit)
        merged = SampledBatch.merge((kept + dropped)[:want], generate_s=generate_s)
        # The reward the policy earns is the mean over every sample drawn, not over the kept ones.
        self.scorer.record(step, reward_mean=float(torch.cat(all_rewards).mean()), reward_s=score_s)
        return merged, {"sampling_rounds": rounds, "sampling_filter_rate": len(dropped) / max(groups_seen, 1),
                        "sampling_topped_up": max(0, want - len(kept))}


def merge_unit_stats(units: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's rollout report from its units' stats: times and tokens add up, the policy version
    is the oldest that generated any of them, ``data_order`` hashes the prompts in step order."""
    merged: dict[str, Any] = {key: sum(u[key] for u in units) for key in
                              ("admission_wait_s", "weight_load_s", "rollout_s", "bus_s", "response_tokens")}
    order = [index for u in units for index in u["order"]]
    merged.update(policy_version=min(u["policy_version"] for u in units),
                  data_order=hashlib.sha1(repr(order).encode()).hexdigest()[:12],
                  units=len(units), replicas=len({u["holder"] for u in units}))
    for key in ("sampling_rounds", "sampling_filter_rate", "sampling_topped_up", "skipped_samples"):
        if any(key in u for u in units):
            merged[key] = sum(u.get(key, 0) for u in units)
    return merged


@dataclass
class SampledBatch:
    """Prompts and generations of one sampling round (or the groups picked from several)."""

    rows: list[dict[str, Any]]
    gens: list[Generation]
    meta: list[dict[str, Any]]
    order: list[int]
    """Data-set indices of the prompts, in order (what ``data/order`` hashes)."""
    generate_s: float
    rewards: torch.Tensor | None = None
    """The weighted rewards of ``gens``, once scored."""

    @property
    def tokens(self) -> int:
        return sum(len(g.response_ids) for g in self.gens)

    @classmethod
    def merge(cls, groups: list[tuple[SampledBatch, int]], generate_s: float) -> SampledBatch:
        """One batch of the chosen groups (a source batch and a prompt index each), renumbered."""
        rows, gens, meta, rewards = [], [], [], []
        for new_index, (source, group) in enumerate(groups):
            rows.append(source.rows[group])
            for i, g in enumerate(source.gens):
                if g.prompt_index == group:
                    gens.append(replace(g, prompt_index=new_index))
                    meta.append({**source.meta[i], "group": new_index})
                    rewards.append(source.rewards[i])
        return cls(rows=rows, gens=gens, meta=meta, order=[r["index"] for r in rows], generate_s=generate_s,
                   rewards=torch.stack(rewards))


class RewardLoop:
    """Scores a step's responses with every reward plugin: the weighted sum becomes ``rewards``.

    Riding in a rollout worker it scores each batch before the batch is put on the bus; otherwise it
    takes responses from the bus, and hands the scored rows to an advantage loop in the same worker
    (``handoff``) or writes ``rewards`` back itself.
    """

    role = "reward"

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self.rewards = build_rewards(env.spec)
        self.handoff: AdvantageLoop | None = None
        self._stats: dict[int, dict[str, Any]] = {}

    def score(self, step: int, columns: dict[str, Any], meta: list[Any]) -> torch.Tensor:
        """The weighted reward of every row (``prompt``/``response``/``label`` columns).

        The scorer (``relax.runtime.scoring``) runs the rewards concurrently within their time
        limits. A sample's metadata is its row's (``sample_id``, ``group``, ``response_tokens``,
        ...; not the trace) plus the run's ``max_new_tokens``; ``response_tokens`` falls back to the
        ``lengths`` column when the row does not carry it. With ``data.reward_key`` set, a row's
        ``reward_route`` metadata (that column's value) picks the rewards that score it.
        """
        started = time.perf_counter()
        max_new_tokens = self.env.spec.roles.rollout.sampling.max_new_tokens
        lengths = columns.get("lengths")
        samples, routes = [], []
        for i, (prompt, response, label, row) in enumerate(zip(columns["prompt"], columns["response"],
                                                                 columns["label"], meta)):
            info = dict(row) if isinstance(row, dict) else {
                **row.extra, "sample_id": row.sample_id, "policy_version": row.policy_version}
            info.pop("trace", None)
            info.setdefault("max_new_tokens", max_new_tokens)
            if "response_tokens" not in info and lengths is not None:
                info["response_tokens"] = int(lengths[i][1])
            routes.append(info.pop("reward_route", None))
            samples.append(RewardSample(prompt=prompt, response=response, label=label, metadata=info))
        with self.env.telemetry.span(REWARD_SCORE, step=step, samples=len(samples), links=meta) as span:
            report = self.rewards.score(samples, routes if self.env.spec.data.reward_key else None)
            per_reward = report.stats()
            span.set(**{"relax.reward." + k.replace("/", "."): v for k, v in per_reward.items()})
        total = torch.tensor(report.totals, dtype=torch.float32)
        self._stats[step] = {"reward_s": time.perf_counter() - started, "bus_s": 0.0,
                             "reward_mean": float(total.mean()), "rewards": per_reward}
        return total

    def record(self, step: int, reward_mean: float, reward_s: float) -> None:
        """Replace a step's reward mean and time after several scoring rounds (dynamic sampling)."""
        self._stats[step].update(reward_mean=reward_mean, reward_s=reward_s)

    def step(self, step: int) -> dict[str, Any]:
        # A co-hosted advantage loop gets these rows in memory: read the token columns it needs too.
        extra = tuple(f for f in self.handoff.fields if f != "rewards") if self.handoff is not None else ()
        return self.env.bus_task(step, self._stats, "response", ("prompt", "response", "label", *extra), "reward",
                                 self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        total = self.score(step, batch.fields, batch.meta)
        if self.handoff is not None:
            self.handoff.accept(step, batch, total)
        else:
            self.env.bus.write_fields(batch, {"rewards": total})
            self.env.state.announce.remote(partition_of(step), "rewards")


class AdvantageLoop:
    """Turns a step's rewards into advantages (a row's group is the prompt it answers).

    An outcome-level estimator maps ``rewards[B]`` to ``advantages[B]``. A token-level one
    (``token_level = True``) also reads the step's tokens and, per its ``needs``, the critic's
    ``values`` or the reference's ``ref_logprobs``, and writes ``[B, T]`` advantages (and
    ``returns`` for the critic). With a critic and an estimator that gives no returns, the
    critic's target is the outcome reward on every response token (Monte Carlo, no discount).
    """

    role = "advantage"

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self.estimator = build_advantage(env.spec)
        self.token_level = bool(getattr(self.estimator, "token_level", False))
        self.reads = advantage_reads(env.spec)
        """Columns of other roles it waits for; with any, it cannot run before the batch's put."""
        self.writes_returns = env.spec.roles.critic is not None
        self._stats: dict[int, dict[str, Any]] = {}

    def estimate(self, step: int, rewards: torch.Tensor, groups: torch.Tensor,
                 columns: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """``advantages`` (and ``returns`` when a critic trains) for a step's rows; ``columns``
        holds the token columns a token-level estimator or the critic's target needs."""
        started = time.perf_counter()
        rewards = rewards.float()
        with self.env.telemetry.span(ADVANTAGE_COMPUTE, step=step, samples=len(rewards)):
            packed = train_batch(columns, [0] * len(rewards)) if columns is not None and "input_ids" in columns else None
            returns = None
            if self.token_level:
                from relax.algo.advantages import TokenAdvantageInputs

                out = self.estimator.compute_tokens(TokenAdvantageInputs(
                    rewards=rewards, group_ids=groups, response_mask=packed.response_mask,
                    logprobs=packed.rollout_logprobs, ref_logprobs=getattr(packed, "ref_logprobs", None),
                    values=getattr(packed, "values", None)))
                advantages = token_column(packed, out.advantages)
                if out.returns is not None:
                    returns = token_column(packed, out.returns)
            else:
                advantages = self.estimator.compute(rewards, groups).float()
            produced = {"advantages": advantages}
            if self.writes_returns:
                produced["returns"] = returns if returns is not None else rewards[:, None] * packed.response_mask
        self._stats[step] = {"advantage_s": time.perf_counter() - started, "bus_s": 0.0}
        return produced

    @property
    def fields(self) -> tuple[str, ...]:
        """What it reads from the bus: rewards, and the tokens when it needs them."""
        tokens = self.token_level or self.writes_returns
        return ("rewards", *(("input_ids", "rollout_logprobs", "lengths") if tokens else ()), *self.reads)

    def accept(self, step: int, batch: BusBatch, rewards: torch.Tensor) -> None:
        """Rows a reward loop in this worker took from the bus and scored: estimate, write both."""
        produced = self.estimate(step, rewards, group_ids(batch.meta), batch.fields)
        self.env.bus.write_fields(batch, {"rewards": rewards, **produced})
        self.env.announce(step, "rewards", *produced)

    def step(self, step: int) -> dict[str, Any]:
        return self.env.bus_task(step, self._stats, ("rewards", *self.reads), self.fields, "advantage",
                                 self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        produced = self.estimate(step, batch["rewards"].float(), group_ids(batch.meta), batch.fields)
        self.env.bus.write_fields(batch, produced)
        self.env.announce(step, *produced)


class TrainLoop:
    """Takes a step's finished rows, checks their staleness, trains, publishes and checkpoints."""

    role = "actor"

    def __init__(self, env: RoleEnv, weights: WeightChannel, start_step: int, resume_from: Path | None) -> None:
        self.env, self.weights = env, weights
        spec = env.spec
        self.trainer = env.build_trainer("actor")
        # Token columns of the optional model roles, read (and waited for) with the advantages.
        optional = tuple(column for column, role in (("ref_logprobs", "reference"), ("old_logprobs", "actor_fwd"))
                         if getattr(spec.roles, role) is not None)
        self.after = ("advantages", *optional)
        self.fields = (*TRAIN_COLUMNS, *optional, *media_columns(spec))
        if resume_from is not None:
            self.trainer.load(str(resume_from / "trainer"))
        self.version = start_step
        self.weights.publish(start_step, self.trainer.weights())

    def step(self, step: int) -> dict[str, Any]:
        spec, env = self.env.spec, self.env
        t0 = time.perf_counter()
        batch = env.take(step, self.after, self.fields, "actor")
        t1 = time.perf_counter()
        versions = [m.policy_version for m in batch.meta]
        lags = [step - v for v in versions]
        ids = [m.sample_id for m in batch.meta]
        if len(set(ids)) != len(ids):  # the exactly-once guard: never train a sample twice
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            raise RuntimeError(f"step {step} received samples {repeated[:5]} more than once; the bus holds "
                               "duplicate rows (a rollout ledger bug): refusing to train them")
        k = spec.async_policy.max_staleness
        tel = env.telemetry
        with tel.span(TRAIN_STEP, step=step, links=batch.meta, samples=len(versions), staleness=max(lags),
                      policy_version=step + 1) as span:
            if max(lags) > k or min(lags) < 0:
                raise StalenessViolation(f"step {step} received samples of policy versions "
                                         f"{sorted(set(versions))}: lag {max(lags)} exceeds "
                                         f"async_policy.max_staleness={k}")
            packed = train_batch(batch.fields, versions)
            t2 = time.perf_counter()
            metrics = self.trainer.train_step(packed)
            span.set(tokens=packed.num_response_tokens, bus_bytes=sum(
                v.numel() * v.element_size() for v in batch.fields.values() if isinstance(v, torch.Tensor)))
        t3 = time.perf_counter()
        self.version = step + 1
        with tel.span(WEIGHT_SYNC, step=step, role="actor", policy_version=self.version):
            self.weights.publish(self.version, self.trainer.weights())
        t4 = time.perf_counter()
        every = spec.trainer.checkpoint_every
        checkpoint_s = 0.0
        if (every and self.version % every == 0) or self.version == spec.trainer.steps:
            with tel.span(CHECKPOINT, step=step, policy_version=self.version):
                save_checkpoint(env.output_dir, self.version, self.trainer, spec.trainer.keep_checkpoints)
            checkpoint_s = time.perf_counter() - t4
        return {"data_wait_s": t1 - t0, "collate_s": t2 - t1, "train_s": t3 - t2, "publish_s": t4 - t3,
                "checkpoint_s": checkpoint_s, "staleness_max": max(lags), "samples": len(ids),
                "samples_hash": hashlib.sha1(repr(ids).encode()).hexdigest()[:12],
                "staleness_mean": sum(lags) / len(lags),
                "train": {k: float(v) for k, v in metrics.items()}, "end_time": time.time()}
