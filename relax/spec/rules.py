"""Rules that look across sections, at the model's architecture and at the installed plugins.

Each rule is a small function ``(spec, context) -> iterable of SpecIssue``; ``RULES`` lists them
all and validation runs every one, so a spec's problems are reported together. A rule names the
path a user should edit and says what to do instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.contracts import PluginKind
from relax.registry import PluginError, Registry
from relax.spec.algorithms import ALGORITHMS
from relax.spec.architecture import ModelArchitecture
from relax.spec.errors import SpecIssue
from relax.spec.models import RunSpec
from relax.spec.translate import did_you_mean

DATA_FILE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass
class RuleContext:
    """What rules may consult besides the spec: plugins, files next to the spec, the model."""

    registry: Registry
    base_dir: Path
    architecture: ModelArchitecture | None = None
    plugin_classes: dict[tuple[PluginKind, str], type] = field(default_factory=dict)

    def plugin(self, kind: PluginKind, name: str) -> type | None:
        """The plugin class if it loaded (its absence is reported by ``check_plugins``)."""
        return self.plugin_classes.get((kind, name))


Rule = Callable[[RunSpec, RuleContext], Iterable[SpecIssue]]


def dataset_plugin(source: str) -> tuple[str, dict[str, Any]]:
    """The dataset plugin a ``data.*.source`` names, and options it implies (a file's path)."""
    suffix = Path(source).suffix.lower()
    if suffix in DATA_FILE_SUFFIXES:
        return DATA_FILE_SUFFIXES[suffix], {"path": source}
    return source, {}


def advantage_and_loss(spec: RunSpec) -> tuple[str | None, str | None]:
    """The advantage and loss plugin names the algorithm section resolves to."""
    recipe = ALGORITHMS.get(spec.algorithm.name)
    advantage = spec.algorithm.advantage or (recipe.advantage if recipe else None)
    loss = spec.algorithm.loss or (recipe.loss if recipe else None)
    return advantage, loss


def plugin_uses(spec: RunSpec) -> Iterator[tuple[PluginKind, str, dict[str, Any], str]]:
    """Every plugin the spec names: (kind, name, options, path of its name in the spec)."""
    for i, reward in enumerate(spec.rewards):
        yield PluginKind.rewards, reward.name, reward.options, f"rewards[{i}]"
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is not None:
            name, implied = dataset_plugin(source.source)
            yield PluginKind.datasets, name, {**implied, **source.options}, f"data.{split}"
    yield PluginKind.rollout, spec.roles.rollout.backend, spec.roles.rollout.options, "roles.rollout"
    for role_name, role in spec.trained_roles().items():
        yield PluginKind.trainer, role.backend, role.options, f"roles.{role_name}"
    advantage, loss = advantage_and_loss(spec)
    if advantage:
        yield PluginKind.advantages, advantage, spec.algorithm.advantage_options, "algorithm"
    if loss:
        yield PluginKind.losses, loss, spec.algorithm.loss_options, "algorithm"


def _name_path(kind: PluginKind, path: str) -> str:
    suffix = {
        PluginKind.rewards: "name",
        PluginKind.datasets: "source",
        PluginKind.rollout: "backend",
        PluginKind.trainer: "backend",
        PluginKind.advantages: "advantage",
        PluginKind.losses: "loss",
    }[kind]
    return f"{path}.{suffix}"


def _options_path(kind: PluginKind, path: str) -> str:
    if kind is PluginKind.advantages:
        return f"{path}.advantage_options"
    if kind is PluginKind.losses:
        return f"{path}.loss_options"
    return f"{path}.options"


def check_plugins(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Every named plugin is installed, loads, and accepts its options."""
    for kind, name, options, path in plugin_uses(spec):
        try:
            ctx.plugin_classes[(kind, name)] = ctx.registry.load(kind, name)
        except PluginError as exc:
            installed = ctx.registry.entries(kind)
            hint = did_you_mean(name, installed) if installed and name not in installed else ""
            hint = hint if hint.startswith("did you mean") else ""
            yield SpecIssue(_name_path(kind, path), str(exc), hint)
            continue
        if kind is PluginKind.datasets and "path" in options:
            yield from _check_data_file(Path(str(options["path"])), ctx, f"{path}.source")
        yield from ctx.registry.validate_options(kind, name, options, _options_path(kind, path))


def _check_data_file(path: Path, ctx: RuleContext, spec_path: str) -> Iterator[SpecIssue]:
    resolved = path if path.is_absolute() else ctx.base_dir / path
    if not resolved.is_file():
        yield SpecIssue(spec_path, f"data file {path} does not exist (looked at {resolved})",
                        "give an existing file; relative paths are taken from the spec's folder")


def check_algorithm(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The algorithm name is known (or both halves are given) and its needs are met."""
    algo = spec.algorithm
    recipe = ALGORITHMS.get(algo.name)
    if recipe is None and not (algo.advantage and algo.loss):
        yield SpecIssue("algorithm.name", f"unknown algorithm '{algo.name}'",
                        f"{did_you_mean(algo.name, ALGORITHMS)} Or set algorithm.advantage and algorithm.loss")
    if recipe is not None and recipe.needs_critic and spec.roles.critic is None:
        yield SpecIssue("roles.critic", f"algorithm '{algo.name}' needs a critic (value model)",
                        "add a roles.critic block, or choose a critic-free algorithm such as grpo")
    if algo.kl_coef > 0 and spec.roles.reference is None:
        yield SpecIssue("algorithm.kl_coef", f"kl_coef {algo.kl_coef} needs a reference policy",
                        "add a roles.reference block, or set algorithm.kl_coef to 0")
    advantage, _ = advantage_and_loss(spec)
    estimator = ctx.plugin(PluginKind.advantages, advantage) if advantage else None
    if estimator is not None and getattr(estimator, "group_based", False) and algo.samples_per_prompt < 2:
        yield SpecIssue("algorithm.samples_per_prompt",
                        f"{algo.samples_per_prompt} is too few for the group-based advantage '{advantage}'",
                        "use 2 or more (8 is common), or choose a non-group estimator")


def check_staleness(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Colocated runs are on-policy; decoupled correction needs the proximal policy role."""
    staleness = spec.async_policy.max_staleness
    if spec.placement.mode == "colocate" and staleness != 0:
        yield SpecIssue("async_policy.max_staleness",
                        f"{staleness} is not possible in colocate mode (rollout and training alternate)",
                        "set it to 0, or use placement.mode separate or hybrid for asynchronous training")
    if spec.async_policy.correction == "decoupled" and spec.roles.actor_fwd is None:
        yield SpecIssue("async_policy.correction", "decoupled needs proximal log-probs from roles.actor_fwd",
                        "add a roles.actor_fwd block, or use correction tis")


def _pooled_roles(spec: RunSpec) -> list[str]:
    """Roles that live inside the actor's pool (and so share its GPUs) in this mode."""
    mode = spec.placement.mode
    if mode == "colocate":
        return ["reference", "critic", "actor_fwd"]
    if mode == "hybrid":
        return ["reference", "actor_fwd"]
    return []


def gpus_requested(spec: RunSpec) -> int:
    """GPUs the whole run needs: roles that share a pool count once."""
    pooled = set(_pooled_roles(spec))
    total = spec.roles.actor.gpus
    if spec.placement.mode != "colocate":
        total += spec.roles.rollout.gpus
    for name, role in spec.trained_roles().items():
        if name != "actor" and name not in pooled:
            total += role.gpus
    return total


def check_gpus(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Roles that share a pool agree on its size, and all GPUs asked for fit the cluster."""
    cluster, roles, mode = spec.cluster, spec.roles, spec.placement.mode
    actor_gpus = roles.actor.gpus
    if mode == "colocate" and roles.rollout.gpus != actor_gpus:
        yield SpecIssue("roles.rollout.replicas",
                        f"in colocate mode rollout and actor time-share one pool, but the rollout asks for "
                        f"{roles.rollout.replicas} x {roles.rollout.gpus_per_replica} = {roles.rollout.gpus} GPUs "
                        f"and the actor for {actor_gpus}",
                        "make replicas x gpus_per_replica equal roles.actor.gpus")
    for name in _pooled_roles(spec):
        role = getattr(roles, name)
        if role is not None and role.gpus != actor_gpus:
            yield SpecIssue(f"roles.{name}.gpus",
                            f"{role.gpus} differs from roles.actor.gpus ({actor_gpus}), but in {mode} mode "
                            f"{name} shares the actor's GPUs", f"set it to {actor_gpus}")
    asked = {"roles.rollout.gpus_per_replica": roles.rollout.gpus,
             **{f"roles.{n}.gpus": r.gpus for n, r in spec.trained_roles().items()}}
    if cluster.gpus_per_node == 0:
        for path, gpus in asked.items():
            if gpus:
                yield SpecIssue(path, "asks for GPUs but cluster.gpus_per_node is 0",
                                "set cluster.gpus_per_node, or set it to 0 to run this role on CPU")
        return
    total = gpus_requested(spec)
    if total > cluster.gpus:
        yield SpecIssue("cluster", f"the roles ask for {total} GPUs but the cluster has "
                        f"{cluster.nodes} x {cluster.gpus_per_node} = {cluster.gpus}",
                        "add nodes or GPUs per node, or give roles fewer GPUs")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _list(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def _check_parallel_shape(path: str, gpus: int, role: Any, arch: ModelArchitecture | None,
                          backend: type | None, backend_name: str) -> Iterator[SpecIssue]:
    par = role.parallel
    sizes = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep}
    if gpus == 0:
        for key, size in sizes.items():
            if size != 1:
                yield SpecIssue(f"{path}.parallel.{key}", f"{size} needs GPUs, but this role runs on CPU",
                                "set it to 1, or give the role GPUs")
        return
    supported = getattr(backend, "parallelism", None) if backend is not None else None
    if supported is not None:
        for key, size in sizes.items():
            if size > 1 and key not in supported:
                yield SpecIssue(f"{path}.parallel.{key}",
                                f"backend '{backend_name}' does not support {key} (it supports "
                                f"{', '.join(sorted(supported))})",
                                f"set it to 1, or choose a backend with {key} (e.g. megatron)")
    if gpus % par.model_parallel:
        yield SpecIssue(f"{path}.parallel", f"tp x pp x cp = {par.model_parallel} does not divide the "
                        f"role's {gpus} GPUs", "choose sizes whose product divides the GPU count")
    if arch is None:
        return
    heads_ok = [d for d in _divisors(arch.num_attention_heads)
                if arch.num_kv_heads % d == 0 or d % arch.num_kv_heads == 0]
    if par.tp not in heads_ok:
        yield SpecIssue(f"{path}.parallel.tp", f"{par.tp} does not divide num_attention_heads="
                        f"{arch.num_attention_heads} (num_kv_heads={arch.num_kv_heads})", f"use {_list(heads_ok)}")
    if arch.num_layers % par.pp:
        yield SpecIssue(f"{path}.parallel.pp", f"{par.pp} does not divide num_layers={arch.num_layers}",
                        f"use {_list(_divisors(arch.num_layers))}")
    if par.ep > 1 and not arch.is_moe:
        yield SpecIssue(f"{path}.parallel.ep", f"{par.ep} but {arch.name} has no experts", "set it to 1")
    elif arch.is_moe and arch.num_experts % par.ep:
        yield SpecIssue(f"{path}.parallel.ep", f"{par.ep} does not divide num_experts={arch.num_experts}",
                        f"use {_list(_divisors(arch.num_experts)[:8])}")


def check_parallel(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Parallel sizes fit each role's GPUs, its backend, and the model's heads, layers and experts."""
    arch = ctx.architecture
    rollout = spec.roles.rollout
    if rollout.gpus_per_replica and rollout.gpus_per_replica != rollout.parallel.tp * rollout.parallel.pp:
        yield SpecIssue("roles.rollout.gpus_per_replica",
                        f"{rollout.gpus_per_replica} differs from the engine's tp x pp = "
                        f"{rollout.parallel.tp * rollout.parallel.pp}",
                        "make gpus_per_replica equal roles.rollout.parallel.tp x pp")
    yield from _check_parallel_shape("roles.rollout", rollout.gpus_per_replica, rollout, arch,
                                     ctx.plugin(PluginKind.rollout, rollout.backend), rollout.backend)
    for name, role in spec.trained_roles().items():
        yield from _check_parallel_shape(f"roles.{name}", role.gpus, role, arch,
                                         ctx.plugin(PluginKind.trainer, role.backend), role.backend)


def check_modalities(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Each modality has a data column, the model reads it, and every backend supports it."""
    wanted = spec.model.modalities
    for modality in wanted:
        if modality != "text" and modality not in spec.data.media_keys:
            yield SpecIssue("data.media_keys", f"model.modalities lists {modality} but no column holds it",
                            f"add data.media_keys.{modality}: <column name>")
    for modality in spec.data.media_keys:
        if modality not in wanted:
            yield SpecIssue(f"data.media_keys.{modality}", f"{modality} is not in model.modalities",
                            f"add {modality} to model.modalities, or remove this key")
    arch = ctx.architecture
    if arch is not None:
        for modality in wanted:
            if modality not in arch.modalities:
                yield SpecIssue("model.modalities", f"{arch.name} does not read {modality} "
                                f"(it reads {', '.join(arch.modalities)})",
                                f"remove {modality}, or choose a model that reads it")
    backends: list[tuple[str, PluginKind, str]] = [("roles.rollout.backend", PluginKind.rollout,
                                                    spec.roles.rollout.backend)]
    backends += [(f"roles.{n}.backend", PluginKind.trainer, r.backend) for n, r in spec.trained_roles().items()]
    for path, kind, name in backends:
        cls = ctx.plugin(kind, name)
        supported = getattr(cls, "modalities", None) if cls is not None else None
        if supported is None:
            continue
        for modality in wanted:
            if modality not in supported:
                yield SpecIssue(path, f"backend '{name}' does not support {modality} "
                                f"(it supports {', '.join(sorted(supported))})",
                                "choose a backend that supports it, or remove it from model.modalities")


def check_tracing(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The OTLP exporter is an optional extra: asking for it without it installed is an error."""
    if spec.tracing.exporter == "otlp":
        module = f"opentelemetry.exporter.otlp.proto.{spec.tracing.protocol}"
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            yield SpecIssue("tracing.exporter", f"otlp over {spec.tracing.protocol} needs the package "
                            "opentelemetry-exporter-otlp, which is not installed",
                            "pip install 'relax-rl[otlp]', or choose exporter jsonl")
        if not spec.tracing.endpoint:
            yield SpecIssue("tracing.endpoint", "otlp needs a collector endpoint",
                            "set it, e.g. http://localhost:4318/v1/traces")


RULES: tuple[Rule, ...] = (
    check_plugins,  # first: the rules below consult the plugin classes it loads
    check_algorithm,
    check_staleness,
    check_gpus,
    check_parallel,
    check_modalities,
    check_tracing,
)

