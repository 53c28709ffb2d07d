"""Rules that look across sections, at the model's architecture, the data and the installed plugins.

Each rule is a small function ``(spec, context) -> iterable of SpecIssue`` wrapped by ``@rule``,
which records the top-level sections it reads. ``RULES`` says what a spec means (``relax plan``
needs them to hold); ``RUNTIME_RULES`` say what today's runtime can run, which ``relax validate``
and ``relax run`` check besides. Validation runs every one, so a spec's problems are reported
together: on a spec with shape errors, a rule whose sections are all well-shaped still runs (the
broken sections replaced by their defaults, which it does not read). A rule names the path a user
should edit and says what to do instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.contracts import PROXIMAL_CORRECTIONS, PluginKind
from relax.registry import PluginError, Registry, trait
from relax.spec.algorithms import ALGORITHMS
from relax.spec.architecture import BUILTIN_PREFIX, ModelArchitecture
from relax.spec.data_files import (  # noqa: F401 (re-exported: the planner and tests read them here)
    DATA_FILE_SUFFIXES,
    DATA_ROWS_CHECKED,
    data_columns,
    data_path,
    dataset_plugin,
    missing_data_issue,
)
from relax.spec.errors import SpecIssue
from relax.spec.models import RunSpec
from relax.spec.translate import did_you_mean


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


Check = Callable[[RunSpec, RuleContext], Iterable[SpecIssue]]


@dataclass(frozen=True)
class Rule:
    """A check and the top-level spec sections it reads, so that validation can run it on a spec
    whose other sections are broken and skip it when one of its own is (with a broken section
    replaced by defaults it would report problems that are not there).

    ``per_section``: every issue the check yields belongs to the section its path starts with and
    depends on that section alone (as with a plugin's name and options), so it runs on any spec and
    only the issues of broken sections are dropped."""

    check: Check
    reads: frozenset[str]
    per_section: bool = False

    def __post_init__(self) -> None:
        unknown = self.reads - set(RunSpec.model_fields)
        if unknown:
            raise ValueError(f"rule {self.name} reads {sorted(unknown)}, which are not RunSpec sections")

    @property
    def name(self) -> str:
        return self.check.__name__

    def __call__(self, spec: RunSpec, ctx: RuleContext) -> Iterable[SpecIssue]:
        return self.check(spec, ctx)


def rule(*reads: str, per_section: bool = False) -> Callable[[Check], Rule]:
    """Declare a check a rule reading the top-level sections ``reads``."""

    def wrap(check: Check) -> Rule:
        return Rule(check, frozenset(reads), per_section)

    return wrap


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
    for modality in spec.data.media_keys:
        yield PluginKind.modalities, modality, spec.data.media_options.get(modality, {}), f"data.media_options.{modality}"
    agent = spec.roles.rollout.agent
    if agent is not None and agent.environment is not None:
        yield PluginKind.environments, agent.environment, agent.environment_options, "roles.rollout.agent"
    for i, logger in enumerate(spec.logging):
        yield PluginKind.loggers, logger.name, logger.options, f"logging[{i}]"


def _name_path(kind: PluginKind, path: str) -> str:
    suffix = {
        PluginKind.rewards: "name",
        PluginKind.datasets: "source",
        PluginKind.rollout: "backend",
        PluginKind.trainer: "backend",
        PluginKind.advantages: "advantage",
        PluginKind.losses: "loss",
        PluginKind.modalities: "",
        PluginKind.environments: "environment",
        PluginKind.loggers: "name",
    }[kind]
    return f"{path}.{suffix}" if suffix else path


def _options_path(kind: PluginKind, path: str) -> str:
    if kind is PluginKind.advantages:
        return f"{path}.advantage_options"
    if kind is PluginKind.losses:
        return f"{path}.loss_options"
    if kind is PluginKind.modalities:
        return path
    if kind is PluginKind.environments:
        return f"{path}.environment_options"
    return f"{path}.options"


@rule("rewards", "data", "roles", "algorithm", "logging", per_section=True)
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
            source = str(options["path"])
            if (issue := missing_data_issue(source, data_path(source, ctx.base_dir), f"{path}.source")) is not None:
                yield issue
        yield from ctx.registry.validate_options(kind, name, options, _options_path(kind, path))


def _token_needs(estimator: type | None) -> frozenset[str]:
    """Token tensors of other roles a token-level estimator may read (its ``needs``)."""
    if estimator is None or not trait(estimator, PluginKind.advantages, "token_level"):
        return frozenset()
    return frozenset(trait(estimator, PluginKind.advantages, "needs"))


@rule("algorithm", "roles")
def check_algorithm(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The algorithm name is known (or both halves are given), its roles run, a KL penalty or an
    entropy bonus has a part that takes it, and group-based parts get groups."""
    algo = spec.algorithm
    recipe = ALGORITHMS.get(algo.name)
    if recipe is None and not (algo.advantage and algo.loss):
        yield SpecIssue("algorithm.name", f"unknown algorithm '{algo.name}'",
                        f"{did_you_mean(algo.name, ALGORITHMS)} Or set algorithm.advantage and algorithm.loss")
    advantage, loss = advantage_and_loss(spec)
    estimator = ctx.plugin(PluginKind.advantages, advantage) if advantage else None
    loss_cls = ctx.plugin(PluginKind.losses, loss) if loss else None
    needs_critic = (recipe is not None and recipe.needs_critic) or "values" in _token_needs(estimator)
    if needs_critic and spec.roles.critic is None:
        yield SpecIssue("roles.critic", f"algorithm '{algo.name}' needs a critic (value model) for the "
                        f"advantage '{advantage}'",
                        "add a roles.critic block, or choose a critic-free algorithm such as grpo")
    if algo.kl_coef > 0 and spec.roles.reference is None:
        yield SpecIssue("algorithm.kl_coef", f"kl_coef {algo.kl_coef} needs a reference policy",
                        "add a roles.reference block, or set algorithm.kl_coef to 0")
    if (algo.kl_coef > 0 and algo.kl_in == "reward" and estimator is not None
            and "ref_logprobs" not in _token_needs(estimator)):
        yield SpecIssue("algorithm.kl_in",
                        f"the KL penalty goes in the reward, but the advantage '{advantage}' is not a "
                        "token-level estimator that reads reference log-probs, so it would be ignored",
                        "set algorithm.kl_in: loss, or use a token-level estimator "
                        "(reinforce_pp, reinforce_pp_baseline, gae)")
    if algo.entropy_coef > 0 and loss_cls is not None and trait(loss_cls, PluginKind.losses, "needs_entropy") is None:
        yield SpecIssue("algorithm.entropy_coef",
                        f"{algo.entropy_coef} asks for an entropy bonus, but the loss '{loss}' does not "
                        "take entropy (it declares no needs_entropy)",
                        "set algorithm.entropy_coef to 0, or choose a loss that takes it (ppo_clip, gspo, "
                        "cispo, sapo)")
    group_based = estimator is not None and trait(estimator, PluginKind.advantages, "group_based")
    if group_based and algo.samples_per_prompt < 2:
        yield SpecIssue("algorithm.samples_per_prompt",
                        f"{algo.samples_per_prompt} is too few for the group-based advantage '{advantage}'",
                        "use 2 or more (8 is common), or choose a non-group estimator")
    if algo.dynamic_sampling.enabled and estimator is not None and not group_based:
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        f"dynamic sampling drops groups whose rewards are all equal, but the advantage "
                        f"'{advantage}' is not group-based",
                        "set it to false, or use a group-based estimator such as grpo")
    elif algo.dynamic_sampling.enabled and algo.samples_per_prompt < 2 and not group_based:
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        f"dynamic sampling needs groups, but samples_per_prompt is {algo.samples_per_prompt} "
                        "(every group of one would be dropped)",
                        "set algorithm.samples_per_prompt to 2 or more, or set this to false")
    if algo.dynamic_sampling.enabled and spec.roles.reward.host != "rollout":
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        "dynamic sampling scores each round before the batch is put on the bus, which "
                        "only the scorer riding in the rollout worker can do",
                        "set roles.reward.host: rollout, or set this to false")


@rule("placement", "async_policy", "roles", "algorithm")
def check_staleness(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Colocated runs are on-policy; a correction of the proximal ratio needs the proximal policy role; a part
    without an importance ratio bounds the staleness, and the loss honours the correction."""
    staleness = spec.async_policy.staleness_cap
    if spec.placement.mode == "colocate" and spec.async_policy.max_staleness == "auto":
        yield SpecIssue("async_policy.max_staleness", "auto is not possible in colocate mode (rollout and training "
                        "alternate: the bound is 0)", "set it to 0, or use placement.mode separate or hybrid")
    elif spec.placement.mode == "colocate" and staleness != 0:
        yield SpecIssue("async_policy.max_staleness",
                        f"{staleness} is not possible in colocate mode (rollout and training alternate)",
                        "set it to 0, or use placement.mode separate or hybrid for asynchronous training")
    correction = spec.async_policy.correction
    if correction in PROXIMAL_CORRECTIONS and spec.roles.actor_fwd is None:
        yield SpecIssue("async_policy.correction",
                        f"{correction} needs proximal log-probs from roles.actor_fwd (its weight is a function of "
                        "the proximal / behaviour ratio, which is 1 without them)",
                        "add a roles.actor_fwd block, or use correction tis or opsm")
    advantage, loss = advantage_and_loss(spec)
    parts = [("advantage", PluginKind.advantages, advantage), ("loss", PluginKind.losses, loss)]
    for what, kind, name in parts:
        cls = ctx.plugin(kind, name) if name else None
        tolerated = trait(cls, kind, "tolerated_staleness")
        if tolerated is not None and staleness > tolerated:
            where = "async_policy.auto.max" if spec.async_policy.max_staleness == "auto" else "async_policy.max_staleness"
            yield SpecIssue(where,
                            f"{staleness} is more than the {what} '{name}' tolerates ({tolerated}): it has no "
                            "importance ratio to correct for samples of older policies",
                            f"set it to {tolerated}, or choose a {what} with an importance ratio"
                            + (" (ppo_clip, gspo, cispo, sapo)" if what == "loss" else ""))
    loss_cls = ctx.plugin(PluginKind.losses, loss) if loss else None
    honoured = trait(loss_cls, PluginKind.losses, "corrections")
    if honoured is not None and correction not in honoured:
        yield SpecIssue("async_policy.correction",
                        f"the loss '{loss}' does not honour correction {correction} "
                        f"(it honours {', '.join(sorted(honoured))})",
                        f"set it to {' or '.join(sorted(honoured))}, or choose another loss")


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
    total = spec.roles.actor.gpus + spec.roles.reward.replicas * spec.roles.reward.gpus_per_replica
    if spec.placement.mode != "colocate":
        total += spec.roles.rollout.gpus
    for name, role in spec.trained_roles().items():
        if name != "actor" and name not in pooled:
            total += role.gpus
    return total


@rule("cluster", "roles", "placement")
def check_gpus(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Roles that share a pool agree on its size, and all GPUs asked for fit the cluster."""
    cluster, roles, mode = spec.cluster, spec.roles, spec.placement.mode
    actor_gpus = roles.actor.gpus
    if mode == "colocate" and roles.rollout.gpus != actor_gpus:
        yield SpecIssue("roles.rollout.replicas",
                        f"in colocate mode rollout and actor time-share one pool, but the rollout asks for "
                        f"{roles.rollout.replicas} x {roles.rollout.gpus_per_replica} = {roles.rollout.gpus} GPUs "
                        f"and the actor for {actor_gpus}",
                        f"make replicas x gpus_per_replica equal roles.actor.gpus: one replica with "
                        f"gpus_per_replica {actor_gpus} (the runtime runs one colocated engine)")
    for name in _pooled_roles(spec):
        role = getattr(roles, name)
        if role is not None and role.gpus != actor_gpus:
            yield SpecIssue(f"roles.{name}.gpus",
                            f"{role.gpus} differs from roles.actor.gpus ({actor_gpus}), but in {mode} mode "
                            f"{name} shares the actor's GPUs", f"set it to {actor_gpus}")
    asked = {"roles.rollout.gpus_per_replica": roles.rollout.gpus,
             "roles.reward.gpus_per_replica": roles.reward.gpus_per_replica,
             **{f"roles.{n}.gpus": r.gpus for n, r in spec.trained_roles().items()}}
    if roles.reward.gpus_per_replica and roles.reward.host != "own":
        yield SpecIssue("roles.reward.gpus_per_replica",
                        f"{roles.reward.gpus_per_replica} GPUs per reward worker, but rewards are scored inside the "
                        "rollout worker (roles.reward.host: rollout)",
                        "set roles.reward.host: own for a model-based reward such as genrm, or set this to 0")
    if cluster.gpus_per_node == 0:
        for path, gpus in asked.items():
            if gpus:
                yield SpecIssue(path, "asks for GPUs but cluster.gpus_per_node is 0",
                                "set cluster.gpus_per_node, or set it to 0 to run this role on CPU")
        return
    total = gpus_requested(spec)
    if total > cluster.gpus:
        yield SpecIssue("cluster", f"the roles ask for {total} GPUs ({', '.join(_gpu_askers(spec))}) but the "
                        f"cluster has cluster.nodes x cluster.gpus_per_node = {cluster.nodes} x "
                        f"{cluster.gpus_per_node} = {cluster.gpus}",
                        "raise cluster.nodes or cluster.gpus_per_node, or lower the roles' gpus")


def _gpu_askers(spec: RunSpec) -> list[str]:
    """``roles.<role>.gpus=<n>`` for each role that ``gpus_requested`` counts (a shared pool once)."""
    roles, pooled = spec.roles, set(_pooled_roles(spec))
    askers = [f"roles.actor.gpus={roles.actor.gpus}"]
    if spec.placement.mode != "colocate" and roles.rollout.gpus:
        askers.append(f"roles.rollout.replicas x gpus_per_replica={roles.rollout.replicas} x "
                      f"{roles.rollout.gpus_per_replica}")
    if roles.reward.replicas * roles.reward.gpus_per_replica:
        askers.append(f"roles.reward.replicas x gpus_per_replica={roles.reward.replicas} x "
                      f"{roles.reward.gpus_per_replica}")
    askers += [f"roles.{name}.gpus={role.gpus}" for name, role in spec.trained_roles().items()
               if name != "actor" and name not in pooled and role.gpus]
    return askers


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _list(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def _check_parallel_shape(path: str, gpus: int, role: Any, arch: ModelArchitecture | None,
                          kind: PluginKind, backend: type | None, backend_name: str) -> Iterator[SpecIssue]:
    par = role.parallel
    sizes = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep}
    if gpus == 0:
        for key, size in sizes.items():
            if size != 1:
                yield SpecIssue(f"{path}.parallel.{key}", f"{size} needs GPUs, but this role runs on CPU",
                                "set it to 1, or give the role GPUs")
        return
    supported = trait(backend, kind, "parallelism")
    if supported is not None:
        for key, size in sizes.items():
            if size > 1 and key not in supported:
                yield SpecIssue(f"{path}.parallel.{key}",
                                f"backend '{backend_name}' does not support {key} (it supports "
                                f"{', '.join(sorted(supported))})",
                                f"set it to 1, or choose a backend that supports {key}")
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


@rule("roles", "model")
def check_parallel(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Parallel sizes fit each role's GPUs, its backend, and the model's heads, layers and experts."""
    arch = ctx.architecture
    rollout = spec.roles.rollout
    if rollout.gpus_per_replica and rollout.gpus_per_replica != rollout.parallel.tp * rollout.parallel.pp:
        yield SpecIssue("roles.rollout.gpus_per_replica",
                        f"{rollout.gpus_per_replica} differs from the engine's tp x pp = "
                        f"{rollout.parallel.tp * rollout.parallel.pp}",
                        "make gpus_per_replica equal roles.rollout.parallel.tp x pp")
    yield from _check_parallel_shape("roles.rollout", rollout.gpus_per_replica, rollout, arch, PluginKind.rollout,
                                     ctx.plugin(PluginKind.rollout, rollout.backend), rollout.backend)
    for name, role in spec.trained_roles().items():
        yield from _check_parallel_shape(f"roles.{name}", role.gpus, role, arch, PluginKind.trainer,
                                         ctx.plugin(PluginKind.trainer, role.backend), role.backend)


@rule("model", "data", "roles")
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
    for modality in spec.data.media_options:
        if modality not in spec.data.media_keys:
            yield SpecIssue(f"data.media_options.{modality}", f"budgets for {modality}, but data.media_keys names "
                            f"no {modality} column", f"add data.media_keys.{modality}, or remove these options")
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
        supported = trait(cls, kind, "modalities")
        if supported is None:
            continue
        for modality in wanted:
            if modality not in supported:
                yield SpecIssue(path, f"backend '{name}' does not support {modality} "
                                f"(it supports {', '.join(sorted(supported))})",
                                "choose a backend that supports it, or remove it from model.modalities")


#: Rows of a data file whose media files validation checks (the rest are checked as the run reads them).
MEDIA_ROWS_CHECKED = 10_000


@rule("data")
def check_media_files(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Media files that a ``.jsonl`` data file names exist and pass their modality plugin's cheap
    standard-library probe (not truncated, not empty, a known format): each problem names the row
    and the column. Relative media paths are taken from the data file's folder."""
    import json

    if not spec.data.media_keys:
        return
    probes: dict[str, Any] = {}
    for modality in spec.data.media_keys:
        cls = ctx.plugin(PluginKind.modalities, modality)
        if cls is None or not hasattr(cls, "probe"):
            continue
        try:
            probes[modality] = cls(cls.Config.model_validate(spec.data.media_options.get(modality, {})))
        except Exception:  # bad options are reported by check_plugins
            continue
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None or Path(source.source).suffix.lower() not in (".jsonl", ".json"):
            continue
        data_file = data_path(source.source, ctx.base_dir)
        if not data_file.is_file():
            continue  # reported by check_plugins
        with open(data_file, encoding="utf-8") as handle:
            for number, line in enumerate(handle):
                if number >= MEDIA_ROWS_CHECKED:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    break  # the dataset plugin reports malformed lines
                for modality, key in spec.data.media_keys.items():
                    yield from _check_media_cell(row.get(key) if isinstance(row, dict) else None, number, key,
                                                 probes.get(modality), data_file.parent, f"data.{split}.source",
                                                 spec.data.on_bad_sample)


def _check_media_cell(cell: Any, row: int, key: str, plugin: Any, folder: Path, path: str,
                      policy: str) -> Iterator[SpecIssue]:
    items = cell if isinstance(cell, list) and all(isinstance(v, str) for v in cell) else [cell]
    hint = ("fix or remove the file, or set data.on_bad_sample: skip to skip such samples"
            if policy == "error" else "this sample will be skipped (data.on_bad_sample: skip)")
    for item in items:
        if not isinstance(item, str):
            continue  # inline items are checked when the run reads them
        media = Path(item).expanduser()
        media = media if media.is_absolute() else folder / media
        if not media.exists():
            problem = f"media file {item} does not exist (looked at {media})"
        elif media.is_dir() and not getattr(plugin, "accepts_folders", False):
            problem = f"media path {item} is a folder, not a file (looked at {media})"
        elif media.is_file() and media.stat().st_size == 0:
            problem = f"media file {item} is empty (0 bytes)"
        else:
            found = plugin.probe(media) if plugin is not None else None
            problem = f"media file {item} {found}" if found else None
        if problem:
            if policy == "skip":
                continue  # not an error: the run skips it and counts it
            yield SpecIssue(path, f"sample {row}, column '{key}': {problem}", hint)


@rule("rewards", "roles")
def check_rewards(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Reward entries have distinct keys; a model-based reward (a judge) gets reward workers of its
    own, and the backend that serves its model is installed and accepts its options."""
    seen: dict[str, int] = {}
    for i, reward in enumerate(spec.rewards):
        if reward.key in seen:
            yield SpecIssue(f"rewards[{i}].id", f"'{reward.key}' also names rewards[{seen[reward.key]}]",
                            "give each entry its own id (routing and per-reward metrics use it)")
        seen.setdefault(reward.key, i)
        cls = ctx.plugin(PluginKind.rewards, reward.name)
        if cls is None or not trait(cls, PluginKind.rewards, "model_based"):
            continue
        if spec.roles.reward.host != "own":
            yield SpecIssue("roles.reward.host", f"rewards[{i}] ('{reward.name}') serves a model, which must not "
                            "share the rollout worker's process", "set roles.reward.host: own")
        try:
            config = cls.Config.model_validate(reward.options)
        except Exception:  # reported by check_plugins with its path
            continue
        # Convention of model-based rewards: ``model``/``model_options`` name the model like
        # ``model.path``/``model.options`` do, ``backend``/``backend_options`` the rollout plugin serving it.
        nested = [(PluginKind.rollout, getattr(config, "backend", None), getattr(config, "backend_options", None),
                   "backend")]
        model = getattr(config, "model", None)
        if isinstance(model, str) and model.startswith(BUILTIN_PREFIX):
            nested.append((PluginKind.models, model[len(BUILTIN_PREFIX):], getattr(config, "model_options", None),
                           "model"))
        for kind, name, options, field_name in nested:
            if not (isinstance(name, str) and isinstance(options, dict)):
                continue
            try:
                ctx.registry.load(kind, name)
            except PluginError as exc:
                yield SpecIssue(f"rewards[{i}].options.{field_name}", str(exc), "")
                continue
            yield from ctx.registry.validate_options(kind, name, options, f"rewards[{i}].options.{field_name}_options")


@rule("roles", "algorithm", "placement")
def check_rollout_scaling(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """An elastic rollout (``max_replicas`` above ``replicas``) runs in separate mode only, units of
    rollout work fit in a step, and dynamic sampling gets a whole step in one replica."""
    rollout, algo, mode = spec.roles.rollout, spec.algorithm, spec.placement.mode
    if rollout.max_replicas is not None and rollout.max_replicas < rollout.replicas:
        yield SpecIssue("roles.rollout.max_replicas",
                        f"{rollout.max_replicas} is below roles.rollout.replicas ({rollout.replicas}), the "
                        "replicas the run starts with",
                        f"set it to {rollout.replicas} or more, or remove it for a fixed number of replicas")
    elif rollout.max_replicas is not None and rollout.max_replicas > rollout.replicas and mode != "separate":
        why = ("in colocate mode the rollout time-shares the actor's GPUs, so it cannot grow past them"
               if mode == "colocate" else
               "elastic rollout is only for separate mode")
        yield SpecIssue("roles.rollout.max_replicas",
                        f"{rollout.max_replicas} replicas (above replicas: {rollout.replicas}) make the rollout "
                        f"elastic, but {why}",
                        f"set placement.mode: separate, or remove max_replicas (or set it to {rollout.replicas})")
    if rollout.unit_prompts is not None and rollout.unit_prompts > algo.prompts_per_step:
        yield SpecIssue("roles.rollout.unit_prompts",
                        f"{rollout.unit_prompts} is more than algorithm.prompts_per_step ({algo.prompts_per_step}); "
                        "a unit of rollout work is a part of one step's prompts",
                        f"set it to {algo.prompts_per_step} or less, or remove it to let the runtime choose")
    unit, units = spec.rollout_units()
    if algo.dynamic_sampling.enabled and units > 1:
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        f"dynamic sampling scores and refills a whole step inside one rollout replica, but a step "
                        f"of {algo.prompts_per_step} prompts is cut into {units} units of {unit} prompts "
                        f"(up to {rollout.replica_limit} replicas)",
                        "set it to false, or give the rollout whole-step units (roles.rollout.unit_prompts: "
                        f"{algo.prompts_per_step}, or one replica without max_replicas)")


def receives_collectively(backend: type | None) -> bool:
    """Whether a rollout backend class can take weights from a weight group: it has the methods
    ``join_weight_group(address)`` and ``receive_weights() -> version`` (the runtime also reads how
    many ranks it joins with, ``weight_group_ranks``). Read from the class, so checking imports no
    engine."""
    return backend is not None and all(callable(getattr(backend, m, None))
                                       for m in ("join_weight_group", "receive_weights"))


@rule("roles", "placement")
def check_weight_sync(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """``collective`` weight sync needs weights to travel (not colocate), a backend that can
    receive them from a weight group, and a rollout on GPUs when the actor's are (NCCL)."""
    rollout = spec.roles.rollout
    if rollout.weight_sync != "collective":
        return
    if spec.placement.mode == "colocate":
        yield SpecIssue("roles.rollout.weight_sync", "collective weight sync, but in colocate mode the rollout "
                        "shares the actor's process and gets its weights in memory",
                        "use auto or object_store, or placement.mode: separate or hybrid")
    if spec.roles.actor.gpus > 0 and rollout.gpus_per_replica == 0:
        yield SpecIssue("roles.rollout.weight_sync", "collective weight sync from an actor on GPUs broadcasts "
                        "over NCCL, which a rollout on CPU (gpus_per_replica: 0) cannot join",
                        "use auto or object_store, or give the rollout GPUs")
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    if backend is not None and not receives_collectively(backend):
        yield SpecIssue("roles.rollout.weight_sync", f"rollout backend '{rollout.backend}' cannot receive weights "
                        "from a weight group (it has no join_weight_group / receive_weights)",
                        "use auto or object_store, or a backend that can (hf, vllm)")


def generates_from_tokens(backend: type | None) -> bool:
    """Whether a rollout backend class can continue a multi-turn trajectory from its token ids
    (``generate_tokens(prompts, sampling, seed)``); read from the class, importing no engine."""
    return backend is not None and callable(getattr(backend, "generate_tokens", None))


@rule("roles", "data", "model")
def check_agent(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Agentic rollouts need a backend that generates from token ids, budgets that fit, media the
    environment may return that the run can read, and an agent program that can be found."""
    rollout = spec.roles.rollout
    agent = rollout.agent
    if agent is None:
        return
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    if backend is not None and not generates_from_tokens(backend):
        yield SpecIssue("roles.rollout.backend", f"rollout backend '{rollout.backend}' cannot continue a trajectory "
                        "from its token ids (it has no generate_tokens), which agentic rollouts need",
                        "use hf or vllm, or remove roles.rollout.agent")
    per_turn = agent.max_new_tokens or rollout.sampling.max_new_tokens
    if per_turn > agent.max_tokens:
        where = "max_new_tokens" if agent.max_new_tokens else "max_tokens"
        yield SpecIssue(f"roles.rollout.agent.{where}", f"a turn may take {per_turn} tokens but a whole trajectory "
                        f"only {agent.max_tokens}", "raise roles.rollout.agent.max_tokens above the per-turn budget")
    if agent.environment is not None:
        cls = ctx.plugin(PluginKind.environments, agent.environment)
        if cls is not None:
            wanted = trait(cls, PluginKind.environments, "observation_modalities")
            missing = sorted(set(wanted) - set(spec.data.media_keys))
            if missing:
                yield SpecIssue("data.media_keys", f"environment '{agent.environment}' returns {', '.join(missing)} "
                                "in its observations, but the run has no modality plugin for it",
                                f"add {', '.join(missing)} to data.media_keys and model.modalities (and use a "
                                "backend that reads them)")
    if agent.gateway is not None:
        module = agent.gateway.program.split(":")[0]
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            yield SpecIssue("roles.rollout.agent.gateway.program", f"no module named '{top}' can be imported here",
                            "install the package of the agent program, or run from the folder that holds it")


@rule("trainer", "data", "roles", "rewards")
def check_evaluation(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The evaluation (``trainer.eval_every``) generates on the rollout that hosts the step loop
    and scores there, with the run's rewards built in that worker: rewards that need a worker of
    their own (``roles.reward.host: own``, a judge model on GPUs) cannot score it yet."""
    every = spec.trainer.eval_every
    if spec.data.eval is None:
        if every:
            yield SpecIssue("trainer.eval_every", f"evaluation every {every} steps needs held-out prompts, but "
                            "data.eval is not set", "set data.eval: {source: <file or dataset>}, or remove "
                            "trainer.eval_every")
        return
    fix = "remove data.eval"
    if spec.trainer.eval.host == "own" and spec.placement.mode == "colocate":
        yield SpecIssue("trainer.eval.host", "an evaluation worker of its own is not supported in colocate mode "
                        "(the policy's weights stay in the colocated process)",
                        "set trainer.eval.host: rollout or auto (the rollout evaluates between steps)")
    if spec.roles.reward.host == "own":
        yield SpecIssue("data.eval", "the evaluation scores in the rollout worker, but roles.reward.host is own "
                        "(the rewards run in workers of their own)", f"set roles.reward.host: rollout, or {fix}")
    if spec.roles.rollout.agent is not None:
        yield SpecIssue("data.eval", "evaluation of agentic rollouts (roles.rollout.agent) is not supported yet",
                        f"remove roles.rollout.agent, or {fix}")
    if spec.data.media_keys:
        yield SpecIssue("data.eval", "evaluation takes text prompts only for now", f"remove data.media_keys, or {fix}")


@rule("roles", "placement", "algorithm", "data")
def check_partial(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Partial rollouts swap weights in the middle of generation, which needs the trainer in another
    process, a backend that can pause (its ``pausable`` trait), text samples and one rollout replica
    generating whole steps (it keeps the next step's drafts)."""
    rollout = spec.roles.rollout
    if not rollout.partial:
        return
    fix = "set roles.rollout.partial: false"
    if spec.placement.mode == "colocate":
        yield SpecIssue("roles.rollout.partial", "partial rollouts need the trainer in another process, but in "
                        "colocate mode rollout and training alternate (no weights arrive mid-generation)",
                        f"use placement.mode: separate or hybrid, or {fix}")
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    if backend is not None and not (trait(backend, PluginKind.rollout, "pausable")
                                    and callable(getattr(backend, "encode_prompt", None))):
        yield SpecIssue("roles.rollout.backend", f"rollout backend '{rollout.backend}' cannot pause generation at a "
                        "token boundary (it does not declare the pausable trait)", f"use hf or vllm, or {fix}")
    if rollout.agent is not None:
        yield SpecIssue("roles.rollout.partial", "partial rollouts and agentic rollouts (roles.rollout.agent) do "
                        "not combine yet", f"remove roles.rollout.agent, or {fix}")
    if spec.algorithm.dynamic_sampling.enabled:
        yield SpecIssue("roles.rollout.partial", "partial rollouts and dynamic sampling do not combine (dynamic "
                        "sampling draws extra prompts the next step's drafts cannot know)",
                        f"set algorithm.dynamic_sampling.enabled: false, or {fix}")
    if spec.data.media_keys:
        yield SpecIssue("roles.rollout.partial", "partial rollouts take text samples only for now",
                        f"remove data.media_keys, or {fix}")
    if spec.algorithm.router_replay == "r3":
        yield SpecIssue("roles.rollout.partial", "partial rollouts do not carry routed experts over a pause yet "
                        "(r3)", f"set algorithm.router_replay: r2 or off, or {fix}")
    if spec.rollout_units()[1] != 1 or rollout.replica_limit != 1:
        yield SpecIssue("roles.rollout.partial", "partial rollouts run with one rollout replica generating whole "
                        "steps (it keeps the next step's drafts between steps)",
                        f"set roles.rollout.replicas: 1 with no max_replicas or unit_prompts, or {fix}")


@rule("algorithm", "roles", "model")
def check_router_replay(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Routing replay needs a mixture-of-experts model and backends that record (the rollout,
    r3) and replay (the actor and actor_fwd trainers) routing, as their ``router_replay`` traits
    declare; agentic trajectories do not carry routed experts yet."""
    mode = spec.algorithm.router_replay
    if mode == "off":
        return
    arch = ctx.architecture
    if arch is not None and not arch.is_moe:
        yield SpecIssue("algorithm.router_replay", f"{mode} replays mixture-of-experts routing, but {arch.name} is "
                        "a dense model (no experts)", "set algorithm.router_replay: off, or use an MoE model")
    if mode == "r3":
        rollout = spec.roles.rollout
        backend = ctx.plugin(PluginKind.rollout, rollout.backend)
        if backend is not None and "r3" not in trait(backend, PluginKind.rollout, "router_replay"):
            yield SpecIssue("roles.rollout.backend", f"r3 needs the rollout to record each token's routed experts, "
                            f"which rollout backend '{rollout.backend}' cannot",
                            "use a backend that records routing (hf), or algorithm.router_replay: r2 or off")
        if rollout.agent is not None:
            yield SpecIssue("algorithm.router_replay", "r3 is not supported with agentic rollouts "
                            "(roles.rollout.agent): multi-turn trajectories do not carry routed experts yet",
                            "set algorithm.router_replay: r2 or off, or remove roles.rollout.agent")
    for name in ("actor", "actor_fwd"):
        role = getattr(spec.roles, name)
        if role is None:
            continue
        cls = ctx.plugin(PluginKind.trainer, role.backend)
        if cls is not None and mode not in trait(cls, PluginKind.trainer, "router_replay"):
            supported = sorted(trait(cls, PluginKind.trainer, "router_replay"))
            yield SpecIssue(f"roles.{name}.backend", f"trainer backend '{role.backend}' cannot replay routing "
                            f"({mode}; it supports {', '.join(supported) or 'none'})",
                            f"use a backend that replays routing (torch, megatron), or set algorithm.router_replay: "
                            f"{' or '.join([*supported, 'off'])}")


def _wanted_columns(spec: RunSpec) -> list[tuple[str, str, bool, bool]]:
    """(path of the key in the spec, column, whether every row must have it, whether the data must
    have it at all): the prompt is read from every row; a reward route or a media cell may be
    missing from some rows. A label may be missing from the whole data set (rewards that need none,
    such as format or a judge, get None), so a missing label column is reported only when the data
    has a column of a close name: a typo."""
    data = spec.data
    wanted = [("data.prompt_key", data.prompt_key, True, True), ("data.label_key", data.label_key, False, False)]
    if data.reward_key is not None:
        wanted.append(("data.reward_key", data.reward_key, False, True))
    wanted += [(f"data.media_keys.{modality}", column, False, True) for modality, column in data.media_keys.items()]
    return wanted


@rule("data")
def check_data_columns(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The columns the spec names (prompt, label, reward route, media) are in the data: in the
    first rows of a data file, or in the ``columns`` a dataset plugin declares."""
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None:
            continue
        name, implied = dataset_plugin(source.source)
        where = f"data.{split}.source"
        if "path" in implied:
            data_file = data_path(source.source, ctx.base_dir)
            if missing_data_issue(source.source, data_file, where) is not None:
                continue  # reported by check_plugins
            rows, issues = data_columns(data_file, source.source, where)
            yield from issues
            if not rows:
                continue
            described = f"{source.source}'s first {len(rows)} row{'s' if len(rows) != 1 else ''}"
        else:
            cls = ctx.plugin(PluginKind.datasets, name)
            declared = getattr(cls, "columns", None) if cls is not None else None
            if declared is None:
                continue  # the plugin does not say; the run reports a missing column
            rows, described = [set(declared)], f"data set '{name}'"
        found = set().union(*rows)
        for path, column, every_row, needed in _wanted_columns(spec):
            if column not in found:
                hint = did_you_mean(column, sorted(found))
                hint = hint if hint.startswith("did you mean") else ""
                if not needed and not hint:
                    continue  # no such column at all: a data set without labels
                yield SpecIssue(path, f"'{column}' is not a column of {described} (it has "
                                f"{', '.join(sorted(found)) or 'none'})",
                                hint or f"set {path} to one of its columns, or fix the data")
            elif every_row and (missing := next((i for i, r in enumerate(rows) if column not in r), None)) is not None:
                yield SpecIssue(path, f"row {missing} of {source.source} has no '{column}' column, which every "
                                "row needs", "give every row a prompt, or remove the rows without one")


@rule("roles", "placement")
def check_colocated_rollout(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Colocate mode runs one rollout engine, inside the actor's process (``check_gpus`` already
    reports replicas whose GPUs do not add up to the actor's; this one the layouts that do)."""
    rollout = spec.roles.rollout
    if spec.placement.mode == "colocate" and rollout.replicas > 1 and rollout.gpus == spec.roles.actor.gpus:
        yield SpecIssue("roles.rollout.replicas",
                        f"{rollout.replicas} rollout replicas in colocate mode, but there the runtime runs one "
                        "rollout engine inside the actor's process",
                        f"set replicas: 1 and gpus_per_replica: {spec.roles.actor.gpus} (with a parallel layout "
                        "the rollout backend supports), or use placement.mode separate for several replicas")


#: Roles the runtime runs as one worker so far, whatever the planner lays out.
SINGLE_WORKER_ROLES = ("reward", "advantage")


@rule("roles")
def check_single_workers(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The reward and advantage roles run as one worker each (the planner can lay out more)."""
    for name in SINGLE_WORKER_ROLES:
        replicas = getattr(spec.roles, name).replicas
        if replicas != 1:
            yield SpecIssue(f"roles.{name}.replicas", f"{replicas} {name} workers, but the runtime runs one so far",
                            "set it to 1")


@rule("roles", "placement")
def check_actor_fwd_weights(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """In separate mode the proximal-policy role (actor_fwd) gets each new policy in memory, through
    its backend's ``load_weights``."""
    fwd = spec.roles.actor_fwd
    if fwd is None or spec.placement.mode != "separate":
        return
    backend = ctx.plugin(PluginKind.trainer, fwd.backend)
    if backend is not None and not callable(getattr(backend, "load_weights", None)):
        yield SpecIssue("roles.actor_fwd.backend",
                        f"backend '{fwd.backend}' cannot take new weights in memory (it has no load_weights), "
                        "which roles.actor_fwd needs in separate mode",
                        "use the torch backend, or placement.mode hybrid where actor_fwd shares the actor's process")


#: Roles holding state that a restart in place would lose, and what that state is.
STATEFUL_ROLES = {
    "actor": "the policy and optimizer state",
    "critic": "the value head and optimizer state",
    "controller": "the run's ledger (policy versions, data-ready signals, rollout work)",
}

#: ``heartbeat_timeout_s`` is at least this many heartbeats, so that a busy machine does not flag
#: healthy workers as hung.
HEARTBEATS_PER_TIMEOUT = 3


@rule("fault_tolerance")
def check_fault_tolerance(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Stateful roles are never restarted in place, and the failure-detection timeouts are ordered:
    heartbeat interval x 3 <= heartbeat timeout <= progress timeout."""
    ft = spec.fault_tolerance
    for name, state in STATEFUL_ROLES.items():
        if getattr(ft.roles, name).on_failure == "restart":
            yield SpecIssue(f"fault_tolerance.roles.{name}.on_failure",
                            f"restart would start the {name} again in place, losing {state}",
                            "use resume (restart the run from its last checkpoint) or stop")
    least = HEARTBEATS_PER_TIMEOUT * ft.heartbeat_s
    if ft.heartbeat_timeout_s < least:
        yield SpecIssue("fault_tolerance.heartbeat_timeout_s",
                        f"{ft.heartbeat_timeout_s:g}s is less than {HEARTBEATS_PER_TIMEOUT} heartbeats "
                        f"(heartbeat_s {ft.heartbeat_s:g}s): a busy machine would flag healthy workers as hung",
                        f"set it to {least:g} or more, or lower fault_tolerance.heartbeat_s")
    if ft.progress_timeout_s < ft.heartbeat_timeout_s:
        yield SpecIssue("fault_tolerance.progress_timeout_s",
                        f"{ft.progress_timeout_s:g}s is shorter than heartbeat_timeout_s "
                        f"({ft.heartbeat_timeout_s:g}s): a piece of work must be allowed at least as long as a "
                        "silent worker", f"set it to {ft.heartbeat_timeout_s:g} or more, "
                        "or lower fault_tolerance.heartbeat_timeout_s")


@rule("tracing")
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


#: What a spec means: ``relax plan`` lays out a spec that passes them, in order (``check_plugins``
#: first: the rules after it consult the plugin classes it loads).
#: A chat template file larger than this is not a template (a model's own are a few KiB).
MAX_CHAT_TEMPLATE_BYTES = 1024 * 1024


@rule("data")
def check_chat_template(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """A ``data.chat_template`` file exists (``~`` expanded, relative to the spec's folder), is
    small UTF-8 text and parses as a Jinja template (parsed, never rendered, here)."""
    template = spec.data.chat_template
    if template in ("auto", "none"):
        return
    path = data_path(template, ctx.base_dir)
    if not path.is_file():
        yield SpecIssue("data.chat_template", f"'{template}' is neither auto, none nor an existing file "
                        f"(looked at {path})", "give auto, none, or a Jinja template file relative to the spec's folder")
        return
    if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
        yield SpecIssue("data.chat_template", f"{path} is larger than {MAX_CHAT_TEMPLATE_BYTES} bytes",
                        "give a chat template file (a Jinja template of a few KiB)")
        return
    import jinja2

    try:
        jinja2.Environment().parse(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        yield SpecIssue("data.chat_template", f"{path} is not UTF-8 text", "save the template as UTF-8")
    except jinja2.TemplateSyntaxError as exc:
        yield SpecIssue("data.chat_template", f"{path}: line {exc.lineno}: not a valid Jinja template ({exc.message})",
                        "fix the template's syntax")


RULES: tuple[Rule, ...] = (
    check_plugins,
    check_algorithm,
    check_staleness,
    check_gpus,
    check_parallel,
    check_modalities,
    check_data_columns,
    check_chat_template,
    check_media_files,
    check_rewards,
    check_rollout_scaling,
    check_weight_sync,
    check_agent,
    check_partial,
    check_evaluation,
    check_router_replay,
    check_fault_tolerance,
    check_tracing,
)

#: What today's runtime can run, beyond what the spec means: checked by ``relax validate`` and
#: before ``relax run`` starts anything (after ``RULES``, whose plugin classes they consult), not by
#: ``relax plan``, which lays out what the planner can place.
RUNTIME_RULES: tuple[Rule, ...] = (
    check_colocated_rollout,
    check_single_workers,
    check_actor_fwd_weights,
)
