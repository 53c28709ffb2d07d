"""Build a run's plugin objects from its spec, through the registry, in whichever process needs them.

Every role worker calls these in its own Ray process, so plugin discovery and loading happen
there exactly as in the driver.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relax.contracts import BackendContext, PluginKind
from relax.registry import get_registry
from relax.runtime.scoring import RewardEntry, RewardScorer
from relax.spec.architecture import BUILTIN_PREFIX
from relax.spec.models import RunSpec
from relax.spec.rules import advantage_and_loss, dataset_plugin

CACHE_ENV = "RELAX_CACHE"


def cache_dir() -> str:
    """Where built-in models are built once and kept (``$RELAX_CACHE``, default ``~/.cache/relax``)."""
    return os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "relax")


def materialize_model(spec: RunSpec, base_dir: Path) -> str:
    """A local folder for ``model.path``; ``builtin:<name>`` is built by its plugin (cached)."""
    path = spec.model.path
    if path.startswith(BUILTIN_PREFIX):
        model = build_plugin(PluginKind.models, path[len(BUILTIN_PREFIX):], spec.model.options)
        return model.materialize(cache_dir())
    folder = Path(path).expanduser()
    folder = folder if folder.is_absolute() else base_dir / folder
    return str(folder) if folder.is_dir() else path


def build_plugin(kind: PluginKind, name: str, options: dict[str, Any], *args: Any) -> Any:
    """Instantiate a plugin with its typed ``Config`` built from spec options."""
    registry = get_registry()
    cls = registry.load(kind, name)
    return cls(registry.build_config(kind, name, options), *args)


def build_dataset(spec: RunSpec, base_dir: Path) -> Any:
    """The training data set; file paths are taken relative to the spec's folder."""
    name, implied = dataset_plugin(spec.data.train.source)
    options = {**implied, **spec.data.train.options}
    if "path" in implied and not Path(options["path"]).is_absolute():
        options["path"] = str(base_dir / options["path"])
    return build_plugin(PluginKind.datasets, name, options)


def build_rewards(spec: RunSpec) -> RewardScorer:
    """The run's reward plugins, each with its weight, time limit and error policy, in a scorer."""
    return RewardScorer([RewardEntry(key=r.key, name=r.name, plugin=build_plugin(PluginKind.rewards, r.name, r.options),
                                     weight=r.weight, timeout_s=r.timeout_s, on_error=r.on_error, always=r.always)
                         for r in spec.rewards])


def build_advantage(spec: RunSpec) -> Any:
    name, _ = advantage_and_loss(spec)
    return build_plugin(PluginKind.advantages, name, spec.algorithm.advantage_options, spec)


def build_loss(spec: RunSpec) -> Any:
    _, name = advantage_and_loss(spec)
    return build_plugin(PluginKind.losses, name, spec.algorithm.loss_options, spec)


def role_device() -> str:
    """``cuda`` in a worker Ray gave a GPU (it sets ``CUDA_VISIBLE_DEVICES``, so the GPU is
    ``cuda:0`` of the process), ``cpu`` otherwise, including fake GPUs on a CPU-only machine."""
    import ray
    import torch

    if ray.is_initialized() and ray.get_gpu_ids() and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def build_rollout(spec: RunSpec, model_path: str, threads: int | None) -> Any:
    role = spec.roles.rollout
    options = dict(role.options)
    if threads and "num_threads" not in options:
        options["num_threads"] = threads
    context = BackendContext(spec=spec, role="rollout", model_path=model_path, seed=spec.seed, device=role_device())
    return build_plugin(PluginKind.rollout, role.backend, options, context)


def build_trainer(spec: RunSpec, model_path: str, threads: int | None, role: str = "actor") -> Any:
    """The ``relax.trainer`` backend of a model role (actor, critic, reference, actor_fwd). Only the
    actor gets the policy loss; the critic's value loss and forward-only roles need none."""
    block = getattr(spec.roles, role)
    options = dict(block.options)
    if threads and "num_threads" not in options:
        options["num_threads"] = threads
    context = BackendContext(spec=spec, role=role, model_path=model_path, seed=spec.seed, device=role_device(),
                             loss=build_loss(spec) if role == "actor" else None)
    return build_plugin(PluginKind.trainer, block.backend, options, context)
