"""What every trainer backend's train step and checkpoint have in common.

The ``torch`` and ``megatron`` backends must give the same update for the same batch (a
conformance test holds them to it), so the rules that decide it live here once: how a step's batch
splits into mini-batches, how much each micro-batch's loss weighs, what a step reports, and how a
checkpoint folder is written so that a crash never leaves half of one.

Imports only pydantic and the standard library at the top (backends' Configs extend ``TrainerConfig``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import OptimizerInfo, TrainerContext


class TrainerConfig(BaseModel):
    """Options every built-in train backend takes (a backend's ``Config`` extends it)."""

    model_config = ConfigDict(extra="forbid")

    logprob_temperature: float | None = Field(None, gt=0.0)
    """Temperature of the log-probs; null uses the rollout's sampling temperature (1 if 0)."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads of this process; null leaves torch's setting alone."""


def logprob_temperature(config: TrainerConfig, context: TrainerContext) -> float:
    """The temperature a trainer scales logits by: the configured one, else the rollout's sampling
    temperature (1 when sampling is greedy), so its log-probs are those of what was sampled."""
    sampling_t = float(context.sampling_temperature)
    return config.logprob_temperature or (sampling_t if sampling_t > 0 else 1.0)


def build_optimizer(params: list[Any], optimizer: OptimizerInfo, backend: str) -> Any:
    """The torch optimizer a role's ``optimizer`` block names, over ``params``."""
    import torch

    if optimizer.name in ("adamw", "adam"):
        kind = torch.optim.AdamW if optimizer.name == "adamw" else torch.optim.Adam
        return kind(params, lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps,
                    weight_decay=optimizer.weight_decay, fused=_fusable(params) or None)
    if optimizer.name == "sgd":
        return torch.optim.SGD(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay)
    raise ValueError(f"optimizer '{optimizer.name}' is not supported by the {backend} trainer; "
                     "use adamw, adam or sgd")


def scheduled_lr(optimizer: OptimizerInfo, total_steps: int, step: int) -> float:
    """The learning rate of training step ``step`` (0-based; the steps a trainer has taken, its
    version) under the role's ``lr_schedule`` over the run's ``total_steps``
    (``relax.algo.schedules``)."""
    from relax.algo.schedules import learning_rate, warmup_length

    warmup = warmup_length(total_steps, optimizer.warmup_steps, optimizer.warmup_ratio)
    return learning_rate(step, lr=optimizer.lr, total_steps=total_steps, schedule=optimizer.lr_schedule,
                         warmup_steps=warmup, min_lr_ratio=optimizer.min_lr_ratio)


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """Give every parameter group of a torch optimizer the learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _fusable(params: list[Any]) -> bool:
    """Whether to ask for torch's fused Adam kernel: on CPU float parameters, one kernel updates all
    of them where torch's default loops over them in Python (on the tiny CPU model's 20
    parameters an update took 0.28 ms fused against 1.2 ms, measured side by side). On GPUs
    torch's default already updates them in a few batched (``foreach``) kernels and is kept."""
    import torch

    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return bool(params) and all(p.device.type == "cpu" and p.dtype in floats for p in params)


def minibatch_bounds(rows: int, updates: int) -> list[tuple[int, int]]:
    """``updates`` consecutive, as-equal-as-possible row ranges of a batch; empty ones dropped."""
    bounds = [round(i * rows / updates) for i in range(updates + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def micro_batch_share(loss: Any, micro: Any, tokens: float, rows: float) -> float:
    """The weight of one micro-batch's loss in its mini-batch: its share of the mini-batch's
    response tokens when the loss's ``aggregation`` is token-mean (the default when a loss does not
    say; ``token_mean`` is read the same), else its share of rows. ``tokens`` and ``rows`` are the
    mini-batch's, summed over data-parallel ranks. Summing ``share * loss`` over micro-batches then
    gives exactly the loss (and gradient) of the whole mini-batch."""
    aggregation = str(getattr(loss, "aggregation", "token-mean")).replace("_", "-")
    if aggregation == "token-mean" and tokens:
        return micro.num_response_tokens / tokens
    return micro.batch_size / rows


def add_weighted(stats: dict[str, float], loss: float, metrics: dict[str, float], share: float) -> None:
    """Accumulate one micro-batch's loss and metrics, weighted by its share."""
    for key, value in {"loss": loss, **metrics}.items():
        stats[key] = stats.get(key, 0.0) + share * float(value)


def routing_to_replay(mode: str, batch: Any, updates: int, own_routing: Any) -> Any:
    """The batch a train step runs on under ``algorithm.router_replay`` ``mode``: ``r3`` needs the
    rollout's recorded experts on it; ``r2`` with several updates gets the trainer's own routing
    (``own_routing(batch)``, before the first update) so every update replays it; else as it is."""
    if mode == "r3" and batch.routed_experts is None:
        raise ValueError("algorithm.router_replay=r3 but the batch has no routed experts: the rollout did not "
                         "record them (its backend must record routing, e.g. hf, and write the routed_experts "
                         "column)")
    if mode == "r2" and updates > 1:  # the first update would replay itself: no pass needed
        return batch.with_fields(routed_experts=own_routing(batch))
    return batch


def policy_step(engine: Any, batch: Any) -> dict[str, float]:
    """One training step of a trainer engine (``relax.contracts.TrainerEngine``: the ``torch``
    trainer, replica or FSDP2, and ``megatron``), written once for all of them.

    ``updates_per_step`` optimizer updates over consecutive mini-batches of the batch. Each update
    accumulates its micro-batches (the engine cuts and runs them, ``forward_backward``), and each
    micro-batch's loss is weighted by its share of the mini-batch's response tokens for a token-mean
    loss, else by its share of rows (``micro_batch_share``). The gradient is then exactly that of the
    whole mini-batch at once. Under data parallelism each rank passes its own shard of the step's rows:
    the shares count the tokens and rows of all ranks (``data_parallel_sum``), and the engine sums
    gradients and stats over them (``finish_gradients``, which also clips). Every rank thus takes the
    update of the whole batch. Every update trains at the step's learning rate
    (``optimizer.lr_schedule`` at step ``version``).

    Returns the mean over updates of ``loss``, ``grad_norm`` (before clipping) and the loss's
    metrics, plus ``lr``, ``tokens`` (this rank's response tokens), ``updates`` and ``version``, and
    the engine's own figures (``end_step``: ``mismatch/*`` of the first mini-batch, before any
    update, ``pad_frac``, ``router_replay/changed``)."""
    if engine.optimizer is None or engine.loss is None:
        raise RuntimeError(f"roles.{engine.context.role} is forward-only (no optimizer or loss); "
                           "it can compute log-probs but not train")
    updates = int(engine.updates_per_step)
    if engine.data_parallel() and batch.batch_size < updates:
        raise ValueError(f"this rank got {batch.batch_size} samples, fewer than "
                         f"algorithm.updates_per_step={updates}; give each rank at least that many")
    # The step's learning rate, from the steps taken (restored with a checkpoint's version).
    set_learning_rate(engine.optimizer, scheduled_lr(engine.optimizer_info, int(engine.context.total_steps),
                                                     engine.version))
    batch = routing_to_replay(engine.router_replay, batch, updates, engine.own_routing)
    mismatch = engine.begin_step()
    totals: dict[str, float] = {}
    taken = 0
    engine.model.train()
    for lo, hi in minibatch_bounds(batch.batch_size, updates):
        minibatch = batch.select(slice(lo, hi))
        tokens, rows = engine.data_parallel_sum([float(minibatch.num_response_tokens), float(minibatch.batch_size)])
        engine.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}

        def weigh(micro: Any, loss: Any, metrics: dict[str, float], tokens: float = tokens, rows: float = rows,
                  stats: dict[str, float] = stats) -> Any:
            share = micro_batch_share(engine.loss, micro, tokens, rows)
            add_weighted(stats, float(loss.item()), metrics, share)
            return loss * share

        engine.forward_backward(minibatch, weigh, mismatch if taken == 0 else None)
        stats["grad_norm"] = engine.finish_gradients(stats)
        engine.optimizer.step()
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
        taken += 1
    engine.optimizer.zero_grad(set_to_none=True)
    engine.model.eval()
    totals, figures = engine.end_step(totals, mismatch)
    engine.version += 1
    result = step_result(totals, taken, batch.num_response_tokens, engine.optimizer, engine.version)
    result.update(figures)
    return result


def step_result(totals: dict[str, float], taken: int, tokens: int, optimizer: Any, version: int) -> dict[str, float]:
    """What ``train_step`` returns: the mean over updates of the summed stats, plus ``tokens``
    (this rank's response tokens), ``lr``, ``updates`` and ``version``."""
    result = {key: value / max(taken, 1) for key, value in totals.items()}
    result["tokens"] = float(tokens)
    result["lr"] = float(optimizer.param_groups[0]["lr"])
    result["updates"] = float(taken)
    result["version"] = float(version)
    return result


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A staging folder beside ``path`` to write a checkpoint into; on success it replaces
    ``path`` by two renames, so ``path`` is always either the old checkpoint or the new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    staging.chmod(0o755)  # readable by others whatever the process's umask (files: save_pretrained's own)
    try:
        yield staging
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
