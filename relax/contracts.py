"""The contracts between the engine and its plugins.

A plugin is a class with a nested pydantic ``Config`` (its options) registered under one entry-point
group per kind. This module states, per kind, which methods the class must have and with which
parameters, so the registry can reject a plugin whose hooks do not match before a run starts, with a
message naming the plugin and the expected signature.

It also holds the small, dependency-free records that cross the plugin boundary (a reward sample, a
generation). Tensors never appear here: this module is imported by ``relax validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class PluginKind(StrEnum):
    """The kinds of plugin, one entry-point group each (``relax.<kind>``)."""

    rollout = "rollout"
    trainer = "trainer"
    rewards = "rewards"
    advantages = "advantages"
    losses = "losses"
    datasets = "datasets"
    modalities = "modalities"
    models = "models"

    @property
    def group(self) -> str:
        """The entry-point group a package registers this kind under."""
        return f"relax.{self.value}"


@dataclass(frozen=True)
class Hook:
    """One method a plugin class must define: its name and its parameter names after ``self``."""

    name: str
    params: tuple[str, ...]

    def signature(self) -> str:
        return f"{self.name}(self{''.join(', ' + p for p in self.params)})"


#: Methods each kind must define. ``__init__`` is listed where the engine calls it with fixed
#: arguments. Extra keyword-only parameters with defaults are allowed.
HOOKS: dict[PluginKind, tuple[Hook, ...]] = {
    # Published contract for third parties: keep it stable.
    PluginKind.rewards: (Hook("__init__", ("config",)), Hook("score", ("samples",))),
    PluginKind.datasets: (
        Hook("__init__", ("config",)),
        Hook("__len__", ()),
        Hook("__getitem__", ("index",)),
    ),
    PluginKind.rollout: (
        Hook("__init__", ("config", "context")),
        Hook("generate", ("prompts", "n", "sampling", "seed")),
        Hook("load_weights", ("weights", "version")),
    ),
    PluginKind.trainer: (
        Hook("__init__", ("config", "context")),
        Hook("compute_logprobs", ("batch",)),
        Hook("train_step", ("batch",)),
        Hook("weights", ()),
        Hook("save", ("path",)),
        Hook("load", ("path",)),
    ),
    PluginKind.advantages: (
        Hook("__init__", ("config", "spec")),
        Hook("compute", ("rewards", "group_ids")),
    ),
    PluginKind.losses: (Hook("__init__", ("config", "spec")), Hook("compute", ("batch", "logprobs"))),
    PluginKind.modalities: (Hook("__init__", ("config",)), Hook("load", ("item",))),
    PluginKind.models: (
        Hook("__init__", ("config",)),
        Hook("architecture", ()),
        Hook("materialize", ("cache_dir",)),
    ),
}


@dataclass
class RewardSample:
    """What a reward plugin scores: one response to one prompt, with the data set's label."""

    prompt: str
    response: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Generation:
    """One sampled response, as a rollout backend returns it.

    ``logprobs[i]`` is the behaviour policy's log-probability of ``response_ids[i]``; it is what
    truncated importance sampling corrects against.
    """

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool = True


@dataclass
class BackendContext:
    """What the runtime hands a rollout or trainer backend when it builds one.

    ``spec`` is the validated ``relax.spec.RunSpec``; a backend reads its own role's block
    (``spec.roles.<role>``), the model and the algorithm from it. ``model_path`` is a local folder:
    built-in models (``builtin:<name>``) are materialized before any backend is built.
    """

    spec: Any
    role: str
    model_path: str
    device: str = "cpu"
    seed: int = 0
    loss: Any = None
    """The built ``relax.losses`` plugin a trainer optimises (None for forward-only roles)."""
