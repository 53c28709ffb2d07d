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
from dataclasses import dataclass
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
    build_trainer,
)
from relax.runtime.data import PromptSchedule, prompt_rows, sampling_seed
from relax.runtime.rows import TRAIN_COLUMNS, rollout_columns, train_batch
from relax.spec.models import RunSpec
from relax.telemetry import ADVANTAGE_COMPUTE, CHECKPOINT, REWARD_SCORE, ROLLOUT_BATCH, TRAIN_STEP, WEIGHT_SYNC, Telemetry

#: Longest single wait on the control plane before re-checking whether the run was stopped.
WAIT_SLICE_S = 2.0


class RunStopped(Exception):
    """The run was stopped (by a failure elsewhere or by the user) while this role waited."""


class StalenessViolation(RuntimeError):
    """A batch holds samples older than ``async_policy.max_staleness`` allows: never trained."""


def partition_of(step: int) -> str:
    return f"step-{step}"


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

    @property
    def batch_size(self) -> int:
        return self.spec.algorithm.prompts_per_step * self.spec.algorithm.samples_per_prompt

    def wait(self, method: str, *args: Any) -> Any:
        """Block on a ``RunState`` wait in slices, failing clearly on stop or timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            result = ray.get(getattr(self.state, method).remote(*args, WAIT_SLICE_S))
            if result:
                return result
            if ray.get(self.state.stopped.remote()):
                raise RunStopped(f"run stopped while waiting ({method}{args})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout_s:.0f} s for {method}{args}; the role that should "
                                   "provide it is stuck or dead")

    def bus_task(self, step: int, done: dict[int, dict[str, Any]], after: str, fields: tuple[str, ...],
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

    def take(self, step: int, after: str, fields: tuple[str, ...], task: str) -> Any:
        """This task's rows of a step, once ``after`` has been announced for them."""
        self.wait("wait_ready", partition_of(step), after)
        return self.bus.get(partition_of(step), list(fields), task=task, batch_size=self.batch_size,
                            timeout_s=self.timeout_s)


def group_ids(meta: list[Any]) -> torch.Tensor:
    """The group of each row (the index of the prompt it answers), from the rows' metadata."""
    return torch.tensor([int(m.extra["group"]) for m in meta], dtype=torch.long)


class WeightChannel(Protocol):
    """How new policy weights reach a rollout backend."""

    def publish(self, version: int, weights: dict[str, Any]) -> None: ...

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | None]: ...


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
        return version, (ray.get(refs[0]) if version > held else None)


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
        pad = self.backend.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.backend.tokenizer.eos_token_id)
        self.scorer: RewardLoop | None = None
        """The reward loop riding in this worker (``roles.reward.host: rollout``), if any."""
        self.estimator: AdvantageLoop | None = None
        """The advantage loop riding in this worker, if any."""

    def step(self, step: int) -> dict[str, Any]:
        spec, env = self.env.spec, self.env
        t0 = time.perf_counter()
        # Admission: the batch of step s may be generated by version v only if s - v <= k.
        version, weights = self.weights.wait(step - spec.async_policy.max_staleness, self.backend.version)
        t1 = time.perf_counter()
        tel = env.telemetry
        if weights is not None:
            with tel.span(WEIGHT_SYNC, step=step, role="rollout", policy_version=version):
                self.backend.load_weights(weights, version)
        t2 = time.perf_counter()
        indices = self.schedule.indices(step)
        rows = prompt_rows(self.dataset, indices, spec.data.prompt_key, spec.data.label_key)
        n = spec.algorithm.samples_per_prompt
        with tel.span(ROLLOUT_BATCH, step=step, policy_version=self.backend.version) as span:
            gens: list[Generation] = self.backend.generate([r["prompt"] for r in rows], n,
                                                           spec.roles.rollout.sampling, sampling_seed(spec.seed, step))
            t3 = time.perf_counter()
            held = self.backend.version
            columns = rollout_columns(gens, [r["prompt"] for r in rows], [r["label"] for r in rows],
                                      self.pad_token_id)
            carrier = span.carrier()  # each row carries the context of the batch that made it
            meta = [{"policy_version": held, "sample_id": f"{step}:{rows[g.prompt_index]['index']}:{i % n}",
                     "group": g.prompt_index, "trace": carrier} for i, g in enumerate(gens)]
            tokens = sum(len(g.response_ids) for g in gens)
            span.set(samples=len(gens), tokens=tokens, staleness=step - held)
        last = "response"
        if self.scorer is not None:  # score (and estimate) before the one put of the step
            columns["rewards"] = self.scorer.score(step, columns, meta)
            last = "rewards"
            if self.estimator is not None:
                groups = torch.tensor([g.prompt_index for g in gens], dtype=torch.long)
                columns["advantages"] = self.estimator.estimate(step, columns["rewards"], groups)
                last = "advantages"
        env.bus.put(partition_of(step), columns, meta)
        env.state.announce.remote(partition_of(step), last)  # ordered after the put; no need to wait
        t4 = time.perf_counter()
        return {"admission_wait_s": t1 - t0, "weight_load_s": t2 - t1, "rollout_s": t3 - t2, "bus_s": t4 - t3,
                "response_tokens": tokens, "policy_version": held,
                "data_order": hashlib.sha1(repr(indices).encode()).hexdigest()[:12]}


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
        """The weighted reward of every row (``prompt``/``response``/``label`` columns)."""
        started = time.perf_counter()
        ids = [m["sample_id"] if isinstance(m, dict) else m.sample_id for m in meta]
        samples = [RewardSample(prompt=p, response=r, label=lab, metadata={"sample_id": i})
                   for p, r, lab, i in zip(columns["prompt"], columns["response"], columns["label"], ids)]
        total = torch.zeros(len(samples))
        with self.env.telemetry.span(REWARD_SCORE, step=step, samples=len(samples), links=meta):
            for plugin, weight in self.rewards:
                scores = plugin.score(samples)
                if len(scores) != len(samples):
                    raise ValueError(f"reward plugin {type(plugin).__name__} returned {len(scores)} scores for "
                                     f"{len(samples)} samples; it must return one per sample")
                total += weight * torch.tensor([float(s) for s in scores])
        self._stats[step] = {"reward_s": time.perf_counter() - started, "bus_s": 0.0,
                             "reward_mean": float(total.mean())}
        return total

    def step(self, step: int) -> dict[str, Any]:
        return self.env.bus_task(step, self._stats, "response", ("prompt", "response", "label"), "reward",
                                 self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        total = self.score(step, batch.fields, batch.meta)
        if self.handoff is not None:
            self.handoff.accept(step, batch, total)
        else:
            self.env.bus.write_fields(batch, {"rewards": total})
            self.env.state.announce.remote(partition_of(step), "rewards")


class AdvantageLoop:
    """Turns a step's rewards into advantages (a row's group is the prompt it answers)."""

    role = "advantage"

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self.estimator = build_advantage(env.spec)
        self._stats: dict[int, dict[str, Any]] = {}

    def estimate(self, step: int, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        with self.env.telemetry.span(ADVANTAGE_COMPUTE, step=step, samples=len(rewards)):
            advantages = self.estimator.compute(rewards.float(), groups).float()
        self._stats[step] = {"advantage_s": time.perf_counter() - started, "bus_s": 0.0}
        return advantages

    def accept(self, step: int, batch: BusBatch, rewards: torch.Tensor) -> None:
        """Rows a reward loop in this worker took from the bus and scored: estimate, write both."""
        advantages = self.estimate(step, rewards, group_ids(batch.meta))
        self.env.bus.write_fields(batch, {"rewards": rewards, "advantages": advantages})
        self.env.state.announce.remote(partition_of(step), "advantages")

    def step(self, step: int) -> dict[str, Any]:
        return self.env.bus_task(step, self._stats, "rewards", ("rewards",), "advantage", self._from_bus)

    def _from_bus(self, step: int, batch: BusBatch) -> None:
        advantages = self.estimate(step, batch["rewards"].float(), group_ids(batch.meta))
        self.env.bus.write_fields(batch, {"advantages": advantages})
        self.env.state.announce.remote(partition_of(step), "advantages")


class TrainLoop:
    """Takes a step's finished rows, checks their staleness, trains, publishes and checkpoints."""

    role = "actor"

    def __init__(self, env: RoleEnv, weights: WeightChannel, start_step: int, resume_from: Path | None) -> None:
        self.env, self.weights = env, weights
        spec = env.spec
        self.trainer = build_trainer(spec, env.model_path, env.threads)
        if resume_from is not None:
            self.trainer.load(str(resume_from / "trainer"))
        self.version = start_step
        self.weights.publish(start_step, self.trainer.weights())

    def step(self, step: int) -> dict[str, Any]:
        spec, env = self.env.spec, self.env
        t0 = time.perf_counter()
        batch = env.take(step, "advantages", TRAIN_COLUMNS, "actor")
        t1 = time.perf_counter()
        versions = [m.policy_version for m in batch.meta]
        lags = [step - v for v in versions]
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
        env.bus.clear_soon(partition_of(step))
        env.state.forget.remote(partition_of(step))
        return {"data_wait_s": t1 - t0, "collate_s": t2 - t1, "train_s": t3 - t2, "publish_s": t4 - t3,
                "checkpoint_s": checkpoint_s, "staleness_max": max(lags),
                "staleness_mean": sum(lags) / len(lags),
                "train": {k: float(v) for k, v in metrics.items()}, "end_time": time.time()}
