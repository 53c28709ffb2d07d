"""Build a run's plugin objects from its spec, through the registry, in whichever process needs them.

Every role worker calls these in its own Ray process, so plugin discovery and loading happen
there exactly as in the driver. A plugin gets its kind's typed context (``relax.contracts``), built
from the spec by ``relax.plan.contexts``; it never sees the spec itself.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from relax.contracts import AlgorithmContext, PluginKind, RewardContext, RolloutContext, TrainerContext
from relax.plan.model import PluginUse, RewardUse
from relax.plan.wiring import advantage_use, dataset_use, loss_use, reward_uses, rollout_use, trainer_use
from relax.registry import get_registry
from relax.runtime.model_files import materialize_path
from relax.runtime.worker.scoring import RewardEntry, RewardScorer
from relax.spec.models import RunSpec


def build_plugin(kind: PluginKind, name: str, options: dict[str, Any], *args: Any) -> Any:
    """Instantiate a plugin with its typed ``Config`` built from spec options."""
    registry = get_registry()
    cls = registry.load(kind, name)
    return cls(registry.build_config(kind, name, options), *args)


def build_dataset(spec: RunSpec, base_dir: Path) -> Any:
    """The training data set as the plan builds it (a file path taken from the spec's folder)."""
    return build_planned(dataset_use(spec, base_dir))


def takes_reward_context(cls: type) -> bool:
    """Whether a reward class's ``__init__`` takes the keyword ``context`` (a ``RewardContext``);
    rewards with the published ``__init__(self, config)`` are built without one."""
    try:
        return "context" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def reward_context() -> RewardContext:
    """The factory a model-based reward builds its judge with, in this process: models are
    materialized relative to the working directory, backends built through the registry."""
    def build_judge_rollout(name: str, options: dict[str, Any], context: RolloutContext) -> Any:
        return build_plugin(PluginKind.rollout, name, options, context)

    return RewardContext(device=role_device(),
                         materialize_model=lambda path, options: materialize_path(path, options, Path.cwd()),
                         build_rollout=build_judge_rollout)


def build_reward(name: str, options: dict[str, Any]) -> Any:
    """One reward plugin; a reward that takes a ``context`` keyword gets this process's
    ``RewardContext``."""
    registry = get_registry()
    cls = registry.load(PluginKind.rewards, name)
    config = registry.build_config(PluginKind.rewards, name, options)
    return cls(config, context=reward_context()) if takes_reward_context(cls) else cls(config)


def build_rewards(spec: RunSpec) -> RewardScorer:
    """The run's reward plugins, each with its weight, time limit and error policy, in a scorer."""
    return build_scorer(reward_uses(spec))


def build_advantage(spec: RunSpec) -> Any:
    return build_planned(advantage_use(spec))


def build_loss(spec: RunSpec) -> Any:
    return build_planned(loss_use(spec))


def role_device() -> str:
    """``cuda`` in a worker Ray gave a GPU (it sets ``CUDA_VISIBLE_DEVICES``, so the GPU is
    ``cuda:0`` of the process), ``cpu`` otherwise, including fake GPUs on a CPU-only machine."""
    import ray
    import torch

    if ray.is_initialized() and ray.get_gpu_ids() and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def planned_context(use: PluginUse, model_path: str, device: str, loss: Any = None) -> Any:
    """A planned plugin's typed context (``PluginUse.context``), completed with what only the
    worker knows: the folder the model was materialized to, and the device Ray gave it."""
    kind = PluginKind(use.kind)
    if use.context is None:
        return None
    if kind is PluginKind.rollout:
        context = RolloutContext.model_validate(use.context)
    elif kind is PluginKind.trainer:
        context = TrainerContext.model_validate(use.context).model_copy(update={"loss": loss})
    else:
        return AlgorithmContext.model_validate(use.context)
    return context.model_copy(update={"model": context.model.model_copy(update={"path": model_path}),
                                      "device": device})


def build_planned(use: PluginUse, model_path: str = "", loss: Any = None) -> Any:
    """A plugin as the plan says: its options and, for the kinds that take one, its context."""
    if PluginKind(use.kind) in (PluginKind.rollout, PluginKind.trainer):
        return build_plugin(PluginKind(use.kind), use.name, use.options,
                            planned_context(use, model_path, role_device(), loss))
    if use.context is not None:
        return build_plugin(PluginKind(use.kind), use.name, use.options, planned_context(use, model_path, "cpu"))
    return build_plugin(PluginKind(use.kind), use.name, use.options)


def build_scorer(rewards: list[RewardUse]) -> RewardScorer:
    """The run's planned rewards, each with its weight, time limit and error policy, in a scorer."""
    return RewardScorer([RewardEntry(key=r.key, name=r.plugin.name,
                                     plugin=build_reward(r.plugin.name, r.plugin.options),
                                     weight=r.weight, timeout_s=r.timeout_s, on_error=r.on_error,
                                     max_error_frac=r.max_error_frac, always=r.always)
                         for r in rewards])


def build_rollout(spec: RunSpec, model_path: str, threads: int | None = None) -> Any:
    """The rollout backend of a spec, built as a planned worker builds it (tests and benches that
    drive plugins without a run use these ``build_*(spec, ...)``)."""
    return build_planned(rollout_use(spec, threads), model_path)


def build_trainer(spec: RunSpec, model_path: str, threads: int | None = None, role: str = "actor") -> Any:
    """The ``relax.trainer`` backend of a model role (actor, critic, reference, actor_fwd). Only the
    actor gets the policy loss; the critic's value loss and forward-only roles need none."""
    loss = build_loss(spec) if role == "actor" else None
    return build_planned(trainer_use(spec, role, threads), model_path, loss=loss)
