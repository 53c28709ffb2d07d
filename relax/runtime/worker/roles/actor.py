"""The actor role: takes a step's finished rows, checks their staleness, trains, publishes the new
policy into its weight channel and checkpoints."""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax.algo.batch import TrainBatch
from relax.bus.records import BusBatch, RowMeta
from relax.plan.model import RoleWiring
from relax.roles import Role
from relax.runtime.checkpoint import export_model, save_checkpoint
from relax.runtime.metrics import mismatch_alarm
from relax.runtime.state.health import Activity
from relax.runtime.state.run_state import partition_of
from relax.runtime.worker.role_env import RoleEnv, StalenessViolation, sample_key
from relax.runtime.worker.weight_channels import WeightChannel
from relax.telemetry import CHECKPOINT, TRAIN_STEP, WEIGHT_SYNC

if TYPE_CHECKING:
    from relax.runtime.worker.ranks import RankEngines


class ActorLoop:
    """Takes a step's finished rows, checks their staleness, trains, publishes and checkpoints."""

    role = Role.actor

    def __init__(self, env: RoleEnv, wiring: RoleWiring, weights: WeightChannel, start_step: int,
                 resume_from: Path | None) -> None:
        self.env, self.weights = env, weights
        self.trainer = env.build_trainer(wiring)
        # The advantages, and the token columns of the optional model roles, are waited for; the
        # tokens, log-probs and media references are read with them.
        self.after = tuple(wiring.waits_for)
        self.fields = tuple(wiring.reads)
        self.in_memory = wiring.takes_from is not None
        """The rows come from the rollout in this process (``hand``), not from the bus."""
        self.handed: dict[int, BusBatch] = {}
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actor-read-ahead")
        """Reads the next step's rows from the bus while this step trains."""
        self._ahead: tuple[int, Future] | None = None
        if resume_from is not None:
            self.trainer.load(str(resume_from / "trainer"))
        self.version = start_step
        self.engines: RankEngines | None = None
        """Colocation across ranks: the rollout engine in every rank's process, which each publish
        hands the weights in its own process (set by the worker once the rollout is built)."""
        self.publish()

    def publish(self) -> None:
        """Publish the held version; no snapshot of the weights when the rollout generates with the
        trainer's own model (``share_policy_model``)."""
        shared = getattr(self.weights, "shares_model", False)
        weights = {} if shared else self.trainer.weights()
        # What one sync moves (the metric weights/sync_bytes): the whole model, or a LoRA adapter alone.
        self.sync_bytes = sum(t.numel() * t.element_size() for t in weights.values() if isinstance(t, torch.Tensor))
        if self.engines is not None:  # into each rank's engine, bucket by bucket, in its own process
            self.sync_bytes = self.engines.hand_over(self.version)
        self.weights.publish(self.version, weights)

    def hand(self, step: int, columns: dict[str, Any], meta: list[dict[str, Any]]) -> None:
        """A step's rows from the rollout (scored, with advantages) in this process: kept for
        ``step`` as the bus would have given them (the columns it reads, rows in sample order)."""
        rows = [RowMeta.coerce(m) for m in meta]
        batch = BusBatch(partition=partition_of(step), task=Role.actor, handle=None, meta=rows,
                         fields={name: columns[name] for name in self.fields})
        order = sorted(range(len(rows)), key=lambda i: sample_key(rows[i]))
        self.handed[step] = batch.select(order) if order != list(range(len(rows))) else batch

    def _rows(self, step: int) -> BusBatch:
        """The step's rows from the bus: read ahead while the previous step trained, when it was;
        then the next step's read starts, to travel while this one trains. (The actor's failure
        resumes the run from its checkpoint with an empty bus, so rows read ahead are never lost.)"""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            with self.env.activity.waiting(f"actor waits for the rows of step {step}"):
                batch = ahead[1].result()
        else:
            batch = self.env.take(step, self.after, self.fields, Role.actor)
        if step + 1 < self.env.settings.steps:
            self._ahead = (step + 1, self._reader.submit(self.env.take, step + 1, self.after, self.fields, Role.actor,
                                                         Activity()))
        return batch

    def step(self, step: int) -> dict[str, Any]:
        settings, env = self.env.settings, self.env
        t0 = time.perf_counter()
        if self.in_memory:
            if step not in self.handed:
                raise RuntimeError(f"step {step}: the rollout in this worker handed over no rows (the plan hands "
                                   "them in memory); a worker restarted in place cannot train this way")
            batch = self.handed.pop(step)
        else:
            batch = self._rows(step)
        t1 = time.perf_counter()
        versions = [m.policy_version for m in batch.meta]
        lags = [step - v for v in versions]
        # A row is its sample, or one segment of it (an agent trajectory whose history branched).
        ids = [m.sample_id if "segment" not in m.extra else f"{m.sample_id}/{m.extra['segment']}" for m in batch.meta]
        if len(set(ids)) != len(ids):  # the exactly-once guard: never train a sample (or segment) twice
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            raise RuntimeError(f"step {step} received samples {repeated[:5]} more than once; the bus holds "
                               "duplicate rows (a rollout ledger bug): refusing to train them")
        policy = settings.staleness_policy()
        tel = env.telemetry
        with tel.span(TRAIN_STEP, step=step, links=batch.meta, samples=len(versions), staleness=max(lags),
                      policy_version=step + 1) as span:
            if not policy.accepts(step, versions):
                raise StalenessViolation(f"step {step} received samples of policy versions "
                                         f"{sorted(set(versions))}: lag {max(lags)} exceeds "
                                         f"async_policy.max_staleness={policy.cap}")
            packed = TrainBatch.from_bus(batch)
            t2 = time.perf_counter()
            if self.engines is not None:
                self.engines.sleep()  # the engines free their devices while the ranks train
            metrics = self.trainer.train_step(packed)
            mismatch = {k: float(v) for k, v in metrics.items() if k.startswith(("mismatch/", "offpolicy/"))}
            span.set(tokens=packed.num_response_tokens, bus_bytes=sum(
                v.numel() * v.element_size() for v in batch.fields.values() if isinstance(v, torch.Tensor)),
                **{k.replace("/", "_"): v for k, v in mismatch.items()})
            if mismatch_alarm(mismatch, settings.mismatch) is not None:
                span.set(mismatch_alarm=True)  # the controller prints it and, with action stop, ends the run
        t3 = time.perf_counter()
        self.version = step + 1
        with tel.span(WEIGHT_SYNC, step=step, role=Role.actor, policy_version=self.version):
            self.publish()
            if self.version == settings.steps:
                self.weights.settle()  # the last version is out before the step is reported
        t4 = time.perf_counter()
        every = settings.checkpoint_every
        checkpoint_s = 0.0
        saved = None
        if (every and self.version % every == 0) or self.version == settings.steps:
            with tel.span(CHECKPOINT, step=step, policy_version=self.version):
                saved = save_checkpoint(env.output_dir, self.version, self.trainer, settings.keep_checkpoints)
        export = settings.export_every
        if export and (self.version % export == 0 or self.version == settings.steps):
            with tel.span(CHECKPOINT, step=step, policy_version=self.version, export=True):
                export_model(env.output_dir, self.version, self.trainer, checkpoint=saved)
        checkpoint_s = time.perf_counter() - t4 if saved is not None or export else 0.0
        return {"data_wait_s": t1 - t0, "collate_s": t2 - t1, "train_s": t3 - t2, "publish_s": t4 - t3,
                "checkpoint_s": checkpoint_s, "staleness_max": max(lags),
                "samples": len({m.sample_id for m in batch.meta}),
                "sync_bytes": self.sync_bytes,
                "samples_hash": hashlib.sha1(repr(ids).encode()).hexdigest()[:12],
                "staleness_mean": sum(lags) / len(lags),
                "train": {k: float(v) for k, v in metrics.items() if k not in mismatch}, "mismatch": mismatch,
                "end_time": time.time()}

