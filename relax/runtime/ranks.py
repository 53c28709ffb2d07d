"""Model roles that span several processes: one Ray actor per rank, one ``torch.distributed`` group.

A trained role with G GPUs has G ranks in the plan, numbered in Megatron's order (tensor parallel
fastest, then context, data, pipeline: ``relax.plan.placement.rank_coords``). The worker that hosts
the role's loops is rank 0. It starts a ``RankWorker`` for every other rank on that rank's planned
bundle, and all ranks join one default process group (NCCL on GPUs, gloo on CPU) before the
backend is built, so the backend's own collectives (Megatron's parallel layers, the torch trainer's
gradient sum) find the group set up. Rank 0 hosts the group's rendezvous store on a port the OS
picks, so no port is probed and raced for.

Backend calls are SPMD: ``RankedTrainer`` (in rank 0) sends each call to every rank and makes it
itself. Each rank gets the rows of its data-parallel index ``d``: ``rows[d::dp]``. Strided rather
than in blocks, so each rank's k-th mini-batch is a part of the whole batch's k-th mini-batch and
``algorithm.updates_per_step`` cuts the same updates as one process would (exactly so when the
batch divides into dp x updates_per_step; otherwise a mini-batch edge may move by a row). Results are joined
back in row order from the first rank (tp = cp = pp = 0) of each data-parallel group; the step's
metrics are rank 0's (backends sum them over data-parallel ranks) and ``tokens`` is summed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

from relax.plan.model import PluginUse
from relax.runtime.components import build_planned, role_device


@dataclass
class RankPlacement:
    """One rank of a multi-process model role: its plan coordinates and Ray actor options."""

    rank: int
    coords: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)
    """``.options(...)`` for its Ray actor (its planned bundle); empty for rank 0, which is the
    worker hosting the role's loops."""

    @property
    def leads_data_shard(self) -> bool:
        """The rank whose results stand for its data-parallel group (the first stage of pipeline,
        the first shard of tensor and context parallelism)."""
        return all(self.coords.get(key, 0) == 0 for key in ("tp", "cp", "pp"))


def join_group(rank: int, world: int, host: str, port: int, timeout_s: float, store: Any = None) -> None:
    """Join the role's default process group (the caller's store when it hosts it). Backends find
    it initialised, so none reads ``RANK``/``WORLD_SIZE``/``MASTER_*``; they are not set, so that
    they cannot leak into a colocated inference engine's own processes (vLLM spawns them from this
    one). A rank's GPU is ``cuda:0``: Ray shows each process only its own."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    device = role_device()
    if device == "cuda":
        torch.cuda.set_device(0)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)


class RankWorker:
    """A rank > 0 of a multi-process model role (use as ``ray.remote(RankWorker)``): it joins the
    group, builds the role's backend and makes the calls rank 0 forwards to it."""

    def __init__(self, trainer: PluginUse, loss: PluginUse | None, model_path: str, threads: int | None, rank: int,
                 world: int, host: str, port: int, timeout_s: float) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        join_group(rank, world, host, port, timeout_s)
        self.backend = build_model_backend(trainer, loss, model_path)

    def ready(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "gpus": ray.get_gpu_ids()}

    def call(self, method: str, keep: bool, *args: Any) -> Any:
        """``backend.method(*args)``; its result only when rank 0 uses it (``keep``). Arguments come
        one by one, so Ray resolves those rank 0 put in the object store."""
        result = getattr(self.backend, method)(*args)
        return result if keep else None


class RankedTrainer:
    """Rank 0's view of a multi-process model role, with the ``relax.trainer`` contract the loops
    use (``compute_logprobs``, ``compute_values``, ``train_step``, ``weights``, ``load_weights``,
    ``save``, ``load``): every call runs on every rank."""

    def __init__(self, trainer: PluginUse, loss: PluginUse | None, role: str, model_path: str, threads: int | None,
                 ranks: list[RankPlacement], timeout_s: float) -> None:
        import ray
        import torch.distributed as dist

        if ranks[0].rank != 0 or ranks[0].options:
            raise ValueError("the first rank of a multi-process role must be rank 0, hosted by the calling worker")
        self.role = role
        self.ranks = ranks
        self.timeout_s = timeout_s
        world = len(ranks)
        self.data_parallel = 1 + max(r.coords.get("dp", 0) for r in ranks)
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        remote = ray.remote(RankWorker)
        self.followers = [remote.options(**r.options, max_concurrency=1).remote(
            trainer, loss, model_path, threads, r.rank, world, host, store.port, timeout_s) for r in ranks[1:]]
        try:
            join_group(0, world, host, store.port, timeout_s, store=store)
            self.local = build_model_backend(trainer, loss, model_path)
            placed = ray.get([f.ready.remote() for f in self.followers], timeout=timeout_s)
            self.placed = [{"rank": r.rank, **info} for r, info in zip(ranks[1:], placed)]
            """Where the other ranks run (rank, pid, node, GPU ids), for ``relax status`` and tests."""
        except Exception:
            self.close()
            raise
        self._store = store  # kept alive: the group's rendezvous lives in this process

    # -- the trainer contract -------------------------------------------------------------------

    def compute_logprobs(self, batch: Any) -> Any:
        return self._sharded("compute_logprobs", batch)

    def compute_values(self, batch: Any) -> Any:
        return self._sharded("compute_values", batch)

    def train_step(self, batch: Any) -> dict[str, float]:
        """The step's metrics from rank 0, with ``tokens`` summed over data-parallel groups."""
        results = self._call_shards("train_step", batch)
        metrics = dict(results[0][1])
        if "tokens" in metrics:
            metrics["tokens"] = float(sum(r["tokens"] for _, r in results))
        return metrics

    def weights(self) -> dict[str, Any]:
        return self._everywhere("weights")

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        self._everywhere("load_weights", weights, version)

    def save(self, path: str) -> None:
        self._everywhere("save", path)

    def load(self, path: str) -> None:
        self._everywhere("load", path)

    @property
    def version(self) -> int:
        return int(getattr(self.local, "version", 0))

    def close(self) -> None:
        """Stop the other ranks (they die with this process too: Ray ties actors to their owner)."""
        import ray

        for follower in self.followers:
            ray.kill(follower, no_restart=True)
        self.followers = []

    # -- forwarding -----------------------------------------------------------------------------

    def _everywhere(self, method: str, *args: Any) -> Any:
        """The same call on every rank; rank 0's result."""
        import ray

        if len(args) and any(_is_large(a) for a in args):
            args = tuple(ray.put(a) if _is_large(a) else a for a in args)
        refs = [f.call.remote(method, False, *args) for f in self.followers]
        local_args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        result = getattr(self.local, method)(*local_args)
        ray.get(refs, timeout=self.timeout_s)
        return result

    def _call_shards(self, method: str, batch: Any) -> list[tuple[int, Any]]:
        """``method(shard)`` on every rank with its data-parallel shard; ``(dp index, result)`` of
        the rank leading each data-parallel group, rank 0's first."""
        import ray

        if batch.batch_size < self.data_parallel:
            raise ValueError(f"roles.{self.role}: a batch of {batch.batch_size} rows cannot be split over "
                             f"{self.data_parallel} data-parallel ranks; give each rank at least one row "
                             "(more prompts per step, or fewer GPUs for the role)")
        shards = [batch.select(list(range(d, batch.batch_size, self.data_parallel))) for d in range(self.data_parallel)]
        put = [ray.put(s) for s in shards] if self.followers else []
        refs = [(r, f.call.remote(method, r.leads_data_shard, put[r.coords.get("dp", 0)]))
                for r, f in zip(self.ranks[1:], self.followers)]
        mine = self.ranks[0].coords.get("dp", 0)
        local = getattr(self.local, method)(shards[mine])
        got = ray.get([ref for _, ref in refs], timeout=self.timeout_s)
        results = [(mine, local)]
        results += [(r.coords.get("dp", 0), value) for (r, _), value in zip(refs, got) if r.leads_data_shard]
        return results

    def _sharded(self, method: str, batch: Any) -> Any:
        """A ``[B, T]`` result joined back in row order from the data-parallel shards."""
        import torch

        parts = dict(self._call_shards(method, batch))
        first = parts[0]
        out = torch.zeros((batch.batch_size, *first.shape[1:]), dtype=first.dtype)
        for d, part in parts.items():
            out[d::self.data_parallel] = part
        return out


def _is_large(value: Any) -> bool:
    """Arguments worth one object-store copy instead of one pickle per rank (a state dict)."""
    return isinstance(value, dict) and len(value) > 0


def build_model_backend(trainer: PluginUse, loss: PluginUse | None, model_path: str) -> Any:
    """A model role's ``relax.trainer`` backend in this process, as planned; the actor's gets its
    built loss plugin (``loss``), the other roles none."""
    return build_planned(trainer, model_path, loss=build_planned(loss) if loss is not None else None)


def build_role_trainer(trainer: PluginUse, loss: PluginUse | None, role: str, model_path: str,
                       threads: int | None, ranks: list[RankPlacement] | None, timeout_s: float) -> Any:
    """The backend of a model role: built here, or across its ranks when the plan gives it several."""
    if ranks and len(ranks) > 1:
        return RankedTrainer(trainer, loss, role, model_path, threads, ranks, timeout_s)
    return build_model_backend(trainer, loss, model_path)
