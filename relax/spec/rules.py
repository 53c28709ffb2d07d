"""Rules that look across sections, at the model's architecture, the data and the installed plugins.

Each rule is a small function ``(spec, context) -> iterable of SpecIssue`` wrapped by ``@rule``,
which records the top-level sections it reads. ``RULES`` says what a spec means (``relax plan``
needs them to hold); ``RUNTIME_RULES`` say what today's runtime can run, which ``relax validate``
and ``relax run`` check besides. Validation runs every one, so a spec's problems are reported
together: on a spec with shape errors, a rule runs on the sound fields and stops at the first
broken one it uses (``relax.spec.soundness``); a rule that walks independent parts (each plugin,
each role) wraps each walk in ``soundly`` so that a broken part ends only its own. A rule names
the path a user should edit and says what to do instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.contracts import MAX_COLUMNS, MAX_ROW_BYTES, PROXIMAL_CORRECTIONS, PluginKind, prompt_char_limit
from relax.errors import SpecIssue, deletion, override, overrides
from relax.errors.translate import did_you_mean, typo_of
from relax.registry import PluginError, Registry, supports, trait
from relax.spec.algorithms import ALGORITHMS
from relax.spec.architecture import BUILTIN_PREFIX, ModelArchitecture
from relax.spec.data_files import (  # noqa: F401 (re-exported: the planner and tests read them here)
    DATA_FILE_SUFFIXES,
    DATA_ROWS_CHECKED,
    RowLimits,
    data_columns,
    data_path,
    dataset_plugin,
    missing_data_issue,
)
from relax.spec.models import RunSpec
from relax.spec.soundness import is_unsound, soundly


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
class RuleExample:
    """A spec on which a rule reports an issue with a fix: a preset and the command-line overrides
    that break it. tests/spec/test_remedies.py loads each, applies the fix of the issue at ``path``
    and validates again: every fix a rule declares an example for is checked to work."""

    preset: str
    """A preset name (``presets/``), as ``relax run`` takes it."""
    overrides: tuple[str, ...]
    """Overrides that make the rule fire (``key=value``)."""
    path: str
    """The path of the issue whose fix is applied."""


@dataclass(frozen=True)
class Rule:
    """A check and the top-level spec sections it reads (checked to be sections; which of their
    fields it uses is found as it runs: see ``relax.spec.soundness``)."""

    check: Check
    reads: frozenset[str]
    examples: tuple[RuleExample, ...] = ()
    """Specs on which it reports an issue with a fix (one per kind of fix it gives)."""

    def __post_init__(self) -> None:
        unknown = self.reads - set(RunSpec.model_fields)
        if unknown:
            raise ValueError(f"rule {self.name} reads {sorted(unknown)}, which are not RunSpec sections")

    @property
    def name(self) -> str:
        return self.check.__name__

    def __call__(self, spec: RunSpec, ctx: RuleContext) -> Iterable[SpecIssue]:
        return self.check(spec, ctx)


def rule(*reads: str, examples: Iterable[tuple[str, str, str]] = ()) -> Callable[[Check], Rule]:
    """Declare a check a rule reading the top-level sections ``reads``; ``examples`` are
    ``(preset, "override override ...", path)`` of specs on which it gives a fix (``RuleExample``)."""

    def wrap(check: Check) -> Rule:
        declared = tuple(RuleExample(preset, tuple(changes.split()), path) for preset, changes, path in examples)
        return Rule(check, frozenset(reads), declared)

    return wrap


def advantage_and_loss(spec: RunSpec) -> tuple[str | None, str | None]:
    """The advantage and loss plugin names the algorithm section resolves to."""
    recipe = ALGORITHMS.get(spec.algorithm.name)
    advantage = spec.algorithm.advantage or (recipe.advantage if recipe else None)
    loss = spec.algorithm.loss or (recipe.loss if recipe else None)
    return advantage, loss


PluginUse = tuple[PluginKind, str, dict[str, Any], str]


def plugin_uses(spec: RunSpec) -> Iterator[PluginUse]:
    """Every plugin the spec names: (kind, name, options, path of its name in the spec). On a spec
    with broken fields, the uses that read none of them (each part is walked on its own)."""
    for part in (_reward_uses, _data_uses, _rollout_uses, _trainer_uses, _algorithm_uses, _modality_uses,
                 _environment_uses, _logger_uses):
        yield from soundly(part(spec))


def _reward_uses(spec: RunSpec) -> Iterator[PluginUse]:
    for i, reward in enumerate(spec.rewards):
        yield PluginKind.rewards, reward.name, reward.options, f"rewards[{i}]"


def _data_uses(spec: RunSpec) -> Iterator[PluginUse]:
    for split in ("train", "eval"):
        yield from soundly(_data_use(spec, split))


def _data_use(spec: RunSpec, split: str) -> Iterator[PluginUse]:
    source = getattr(spec.data, split)
    if source is not None:
        name, implied = dataset_plugin(source.source)
        options = source.options if is_unsound(source.options) else {**implied, **source.options}
        yield PluginKind.datasets, name, options, f"data.{split}"


def _rollout_uses(spec: RunSpec) -> Iterator[PluginUse]:
    yield PluginKind.rollout, spec.roles.rollout.backend, spec.roles.rollout.options, "roles.rollout"


def _trainer_uses(spec: RunSpec) -> Iterator[PluginUse]:
    for role_name in ("actor", "reference", "critic", "actor_fwd"):
        yield from soundly(_trainer_use(spec, role_name))


def _trainer_use(spec: RunSpec, role_name: str) -> Iterator[PluginUse]:
    role = getattr(spec.roles, role_name)
    if role is not None:
        yield PluginKind.trainer, role.backend, role.options, f"roles.{role_name}"


def _algorithm_uses(spec: RunSpec) -> Iterator[PluginUse]:
    advantage, loss = advantage_and_loss(spec)
    if advantage:
        yield from soundly(iter([(PluginKind.advantages, advantage, spec.algorithm.advantage_options, "algorithm")]))
    if loss:
        yield from soundly(iter([(PluginKind.losses, loss, spec.algorithm.loss_options, "algorithm")]))


def _modality_uses(spec: RunSpec) -> Iterator[PluginUse]:
    for modality in spec.data.media_keys:
        options = spec.data.media_options.get(modality, {})
        yield PluginKind.modalities, modality, options, f"data.media_options.{modality}"


def _environment_uses(spec: RunSpec) -> Iterator[PluginUse]:
    agent = spec.roles.rollout.agent
    if agent is not None and agent.environment is not None:
        yield PluginKind.environments, agent.environment, agent.environment_options, "roles.rollout.agent"


def _logger_uses(spec: RunSpec) -> Iterator[PluginUse]:
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


#: Plugin kinds whose name is the whole value at its path (a data set's is a part of its source).
NAMED_BY_VALUE = frozenset(set(PluginKind) - {PluginKind.datasets, PluginKind.modalities})


@rule("rewards", "data", "roles", "algorithm", "logging", examples=[
    ("tiny-cpu", "roles.rollout.backend=hff", "roles.rollout.backend"),
    ("tiny-cpu", "rewards.0.name=exact_matc", "rewards[0].name"),
])
def check_plugins(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Every named plugin is installed, loads, and accepts its options (a broken name or options
    field is its shape error's alone)."""
    for use in plugin_uses(spec):
        yield from soundly(_check_plugin(ctx, *use))


def _check_plugin(ctx: RuleContext, kind: PluginKind, name: str, options: dict[str, Any],
                  path: str) -> Iterator[SpecIssue]:
    if is_unsound(name):
        return
    try:
        ctx.plugin_classes[(kind, name)] = ctx.registry.load(kind, name)
    except PluginError as exc:
        installed = ctx.registry.entries(kind)
        hint = did_you_mean(name, installed) if installed and name not in installed else ""
        hint = hint if hint.startswith("did you mean") else ""
        meant = typo_of(name, installed) if hint and kind in NAMED_BY_VALUE else None
        yield SpecIssue(_name_path(kind, path), str(exc), hint,
                        (override(_name_path(kind, path), meant),) if meant is not None else ())
        return
    if is_unsound(options):
        return
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


@rule("algorithm", "roles", examples=[
    ("tiny-cpu", "algorithm.kl_coef=0.1", "algorithm.kl_coef"),
    ("tiny-cpu", "algorithm.kl_coef=0.1 +roles.reference.backend=torch algorithm.kl_in=reward", "algorithm.kl_in"),
    ("tiny-cpu", "algorithm.samples_per_prompt=1", "algorithm.samples_per_prompt"),
    ("tiny-cpu", "algorithm.name=ppo", "roles.critic"),
    ("tiny-cpu", "algorithm.dynamic_sampling.enabled=true algorithm.advantage=reinforce_pp",
     "algorithm.dynamic_sampling.enabled"),
    ("tiny-cpu", "algorithm.dynamic_sampling.enabled=true roles.reward.host=own", "algorithm.dynamic_sampling.enabled"),
])
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
                        "add a roles.critic block, or choose a critic-free algorithm such as grpo",
                        _critic_like_actor(spec))
    if algo.kl_coef > 0 and spec.roles.reference is None:
        yield SpecIssue("algorithm.kl_coef", f"kl_coef {algo.kl_coef} needs a reference policy",
                        "add a roles.reference block, or set algorithm.kl_coef to 0",
                        overrides(algorithm__kl_coef=0))
    if (algo.kl_coef > 0 and algo.kl_in == "reward" and estimator is not None
            and "ref_logprobs" not in _token_needs(estimator)):
        yield SpecIssue("algorithm.kl_in",
                        f"the KL penalty goes in the reward, but the advantage '{advantage}' is not a "
                        "token-level estimator that reads reference log-probs, so it would be ignored",
                        "set algorithm.kl_in: loss, or use a token-level estimator "
                        "(reinforce_pp, reinforce_pp_baseline, gae)", overrides(algorithm__kl_in="loss"))
    if algo.entropy_coef > 0 and loss_cls is not None and trait(loss_cls, PluginKind.losses, "needs_entropy") is None:
        yield SpecIssue("algorithm.entropy_coef",
                        f"{algo.entropy_coef} asks for an entropy bonus, but the loss '{loss}' does not "
                        "take entropy (it declares no needs_entropy)",
                        "set algorithm.entropy_coef to 0, or choose a loss that takes it (ppo_clip, gspo, "
                        "cispo, sapo)", overrides(algorithm__entropy_coef=0))
    group_based = estimator is not None and trait(estimator, PluginKind.advantages, "group_based")
    if group_based and algo.samples_per_prompt < 2:
        yield SpecIssue("algorithm.samples_per_prompt",
                        f"{algo.samples_per_prompt} is too few for the group-based advantage '{advantage}'",
                        "use 2 or more (8 is common), or choose a non-group estimator",
                        overrides(algorithm__samples_per_prompt=2))
    if algo.dynamic_sampling.enabled and estimator is not None and not group_based:
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        f"dynamic sampling drops groups whose rewards are all equal, but the advantage "
                        f"'{advantage}' is not group-based",
                        "set it to false, or use a group-based estimator such as grpo",
                        overrides(algorithm__dynamic_sampling__enabled=False))
    elif algo.dynamic_sampling.enabled and algo.samples_per_prompt < 2 and not group_based:
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        f"dynamic sampling needs groups, but samples_per_prompt is {algo.samples_per_prompt} "
                        "(every group of one would be dropped)",
                        "set algorithm.samples_per_prompt to 2 or more, or set this to false")
    if algo.dynamic_sampling.enabled and spec.roles.reward.host != "rollout":
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        "dynamic sampling scores each round before the batch is put on the bus, which "
                        "only the scorer riding in the rollout worker can do",
                        "set roles.reward.host: rollout, or set this to false",
                        overrides(algorithm__dynamic_sampling__enabled=False))


@rule("placement", "async_policy", "roles", "algorithm", examples=[
    ("tiny-cpu", "placement.mode=colocate", "async_policy.max_staleness"),
    ("tiny-cpu", "placement.mode=colocate async_policy.max_staleness=auto", "async_policy.max_staleness"),
    ("tiny-cpu", "async_policy.correction=icepop", "async_policy.correction"),
    ("tiny-cpu", "async_policy.max_staleness=3 algorithm.loss=pg", "async_policy.max_staleness"),
    ("tiny-cpu", "async_policy.correction=opsm algorithm.loss=pg async_policy.max_staleness=0",
     "async_policy.correction"),
])
def check_staleness(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Colocated runs are on-policy; a correction of the proximal ratio needs the proximal policy role; a part
    without an importance ratio bounds the staleness, and the loss honours the correction."""
    staleness = spec.async_policy.staleness_cap
    if spec.placement.mode == "colocate" and spec.async_policy.max_staleness == "auto":
        yield SpecIssue("async_policy.max_staleness", "auto is not possible in colocate mode (rollout and training "
                        "alternate: the bound is 0)", "set it to 0, or use placement.mode separate or hybrid",
                        overrides(async_policy__max_staleness=0))
    elif spec.placement.mode == "colocate" and staleness != 0:
        yield SpecIssue("async_policy.max_staleness",
                        f"{staleness} is not possible in colocate mode (rollout and training alternate)",
                        "set it to 0, or use placement.mode separate or hybrid for asynchronous training",
                        overrides(async_policy__max_staleness=0))
    correction = spec.async_policy.correction
    if correction in PROXIMAL_CORRECTIONS and spec.roles.actor_fwd is None:
        yield SpecIssue("async_policy.correction",
                        f"{correction} needs proximal log-probs from roles.actor_fwd (its weight is a function of "
                        "the proximal / behaviour ratio, which is 1 without them)",
                        "add a roles.actor_fwd block, or use correction tis or opsm",
                        overrides(async_policy__correction="tis"))
    advantage, loss = advantage_and_loss(spec)
    parts = [("advantage", PluginKind.advantages, advantage), ("loss", PluginKind.losses, loss)]
    for what, kind, name in parts:
        cls = ctx.plugin(kind, name) if name else None
        tolerated = trait(cls, kind, "tolerated_staleness")
        if tolerated is not None and staleness > tolerated:
            where = ("async_policy.auto.max" if spec.async_policy.max_staleness == "auto"
                     else "async_policy.max_staleness")
            yield SpecIssue(where,
                            f"{staleness} is more than the {what} '{name}' tolerates ({tolerated}): it has no "
                            "importance ratio to correct for samples of older policies",
                            f"set it to {tolerated}, or choose a {what} with an importance ratio"
                            + (" (ppo_clip, gspo, cispo, sapo)" if what == "loss" else ""),
                            overrides(async_policy__max_staleness=tolerated))
    loss_cls = ctx.plugin(PluginKind.losses, loss) if loss else None
    honoured = trait(loss_cls, PluginKind.losses, "corrections")
    if honoured is not None and correction not in honoured:
        yield SpecIssue("async_policy.correction",
                        f"the loss '{loss}' does not honour correction {correction} "
                        f"(it honours {', '.join(sorted(honoured))})",
                        f"set it to {' or '.join(sorted(honoured))}, or choose another loss",
                        (override("async_policy.correction", _preferred_correction(honoured)),))


def _critic_like_actor(spec: RunSpec) -> tuple[str, ...]:
    """A critic on the actor's backend, where it needs no GPUs of its own: on CPU, or sharing the
    actor's in colocate mode (with its GPUs and parallel sizes); else no fix (its GPUs are the
    cluster's to give)."""
    actor = spec.roles.actor
    if actor.gpus and spec.placement.mode != "colocate":
        return ()
    fix = (override("roles.critic.backend", actor.backend), override("roles.critic.gpus", actor.gpus))
    return fix + tuple(override(f"roles.critic.parallel.{k}", getattr(actor.parallel, k))
                       for k in ("tp", "pp", "cp", "ep") if getattr(actor.parallel, k) != 1)


def _preferred_correction(honoured: Iterable[str]) -> str:
    """The correction a fix sets among those a loss honours: none where it may, else the first."""
    return "none" if "none" in honoured else sorted(honoured)[0]


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


@rule("cluster", "roles", "placement", examples=[
    ("qwen3-4b-grpo-colocate", "roles.actor.gpus=2 cluster.gpus_per_node=2", "roles.rollout.replicas"),
    ("qwen3-4b-grpo-hybrid", "roles.reference.gpus=4", "roles.reference.gpus"),
    ("tiny-cpu", "roles.reward.gpus_per_replica=1", "roles.reward.gpus_per_replica"),
    ("tiny-cpu", "roles.actor.gpus=1", "roles.actor.gpus"),
    ("qwen3-4b-grpo-async", "cluster.gpus_per_node=4", "cluster"),
])
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
                        f"gpus_per_replica {actor_gpus} (the runtime runs one colocated engine)",
                        _colocated_engine(spec, ctx))
    for name in _pooled_roles(spec):
        role = getattr(roles, name)
        if role is not None and role.gpus != actor_gpus:
            yield SpecIssue(f"roles.{name}.gpus",
                            f"{role.gpus} differs from roles.actor.gpus ({actor_gpus}), but in {mode} mode "
                            f"{name} shares the actor's GPUs", f"set it to {actor_gpus}",
                            _role_gpus(f"roles.{name}", role, actor_gpus))
    asked = {"roles.rollout.gpus_per_replica": roles.rollout.gpus,
             "roles.reward.gpus_per_replica": roles.reward.gpus_per_replica,
             **{f"roles.{n}.gpus": r.gpus for n, r in spec.trained_roles().items()}}
    if roles.reward.gpus_per_replica and roles.reward.host != "own":
        yield SpecIssue("roles.reward.gpus_per_replica",
                        f"{roles.reward.gpus_per_replica} GPUs per reward worker, but rewards are scored inside the "
                        "rollout worker (roles.reward.host: rollout)",
                        "set roles.reward.host: own for a model-based reward such as genrm, or set this to 0",
                        overrides(roles__reward__gpus_per_replica=0))
    if cluster.gpus_per_node == 0:
        for path, gpus in asked.items():
            if gpus:
                yield SpecIssue(path, "asks for GPUs but cluster.gpus_per_node is 0",
                                "set cluster.gpus_per_node, or set it to 0 to run this role on CPU",
                                _on_cpu(spec, path))
        return
    total = gpus_requested(spec)
    if total > cluster.gpus:
        yield SpecIssue("cluster", f"the roles ask for {total} GPUs ({', '.join(_gpu_askers(spec))}) but the "
                        f"cluster has cluster.nodes x cluster.gpus_per_node = {cluster.nodes} x "
                        f"{cluster.gpus_per_node} = {cluster.gpus}",
                        "raise cluster.nodes or cluster.gpus_per_node, or lower the roles' gpus",
                        overrides(cluster__nodes=-(-total // cluster.gpus_per_node)))


def _one_rollout_engine(rollout: Any, gpus: int) -> tuple[str, ...]:
    """The overrides that make the rollout one engine on ``gpus`` GPUs (its pipeline stages kept
    where they divide them, its tensor parallel the rest)."""
    pp = rollout.parallel.pp if gpus % rollout.parallel.pp == 0 else 1
    tp = max(1, gpus // pp)
    return overrides(roles__rollout__replicas=1, roles__rollout__gpus_per_replica=gpus,
                     roles__rollout__parallel__tp=tp, roles__rollout__parallel__pp=pp)


def _colocated_engine(spec: RunSpec, ctx: RuleContext) -> tuple[str, ...]:
    """Colocate mode's one rollout engine on the actor's GPUs; where the rollout backend cannot
    split a model over several (no tensor parallel), the actor on the GPUs of one engine instead."""
    rollout, actor = spec.roles.rollout, spec.roles.actor
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    supported = trait(backend, PluginKind.rollout, "parallelism") if backend is not None else None
    if actor.gpus <= 1 or supported is None or {"tp", "pp"} & set(supported):
        return _one_rollout_engine(rollout, actor.gpus)
    one = max(1, rollout.gpus_per_replica)
    return (*overrides(roles__rollout__replicas=1, roles__rollout__gpus_per_replica=one),
            *_role_gpus("roles.actor", actor, one))


def _role_gpus(path: str, role: Any, gpus: int) -> tuple[str, ...]:
    """``<path>.gpus=<gpus>``, with its parallel sizes set to 1 where their product would no longer
    divide the GPUs."""
    fix = (override(f"{path}.gpus", gpus),)
    if gpus % role.parallel.model_parallel:
        fix += tuple(override(f"{path}.parallel.{k}", 1) for k in ("tp", "pp", "cp")
                     if getattr(role.parallel, k) != 1)
    return fix


def _on_cpu(spec: RunSpec, path: str) -> tuple[str, ...]:
    """``<path>=0``, the role whose GPU count ``path`` names (``roles.<role>.<field>``) on CPU,
    where its parallel sizes allow (all 1); else no fix."""
    parallel = getattr(getattr(spec.roles, path.split(".")[1]), "parallel", None)
    if parallel is not None and any(getattr(parallel, k) != 1 for k in ("tp", "pp", "cp", "ep")):
        return ()
    return (override(path, 0),)


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


def _parallel_fix(path: str, par: Any, key: str, size: int) -> tuple[str, ...]:
    """``<path>.parallel.<key>=<size>``; for the rollout (whose ``gpus_per_replica`` is its
    engine's tp x pp) with the engine's GPUs to match."""
    fix = (override(f"{path}.parallel.{key}", size),)
    if path == "roles.rollout" and key in ("tp", "pp"):
        sizes = {"tp": par.tp, "pp": par.pp, key: size}
        fix += (override("roles.rollout.gpus_per_replica", sizes["tp"] * sizes["pp"]),)
    return fix


def _check_parallel_shape(path: str, gpus: int, role: Any, arch: ModelArchitecture | None,
                          kind: PluginKind, backend: type | None, backend_name: str) -> Iterator[SpecIssue]:
    par = role.parallel
    sizes = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep}
    if gpus == 0:
        for key, size in sizes.items():
            if size != 1:
                yield SpecIssue(f"{path}.parallel.{key}", f"{size} needs GPUs, but this role runs on CPU",
                                "set it to 1, or give the role GPUs", (override(f"{path}.parallel.{key}", 1),))
        return
    supported = trait(backend, kind, "parallelism")
    if supported is not None:
        for key, size in sizes.items():
            if size > 1 and key not in supported:
                yield SpecIssue(f"{path}.parallel.{key}",
                                f"backend '{backend_name}' does not support {key} (it supports "
                                f"{', '.join(sorted(supported))})",
                                f"set it to 1, or choose a backend that supports {key}",
                                _parallel_fix(path, par, key, 1))
    if gpus % par.model_parallel:
        yield SpecIssue(f"{path}.parallel", f"tp x pp x cp = {par.model_parallel} does not divide the "
                        f"role's {gpus} GPUs", "choose sizes whose product divides the GPU count")
    if arch is None:
        return
    heads_ok = [d for d in _divisors(arch.num_attention_heads)
                if arch.num_kv_heads % d == 0 or d % arch.num_kv_heads == 0]
    if par.tp not in heads_ok:
        fitting = [d for d in heads_ok if d < par.tp and gpus % (d * par.pp * par.cp) == 0]
        yield SpecIssue(f"{path}.parallel.tp", f"{par.tp} does not divide num_attention_heads="
                        f"{arch.num_attention_heads} (num_kv_heads={arch.num_kv_heads})", f"use {_list(heads_ok)}",
                        _parallel_fix(path, par, "tp", fitting[-1]) if fitting else ())
    if arch.num_layers % par.pp:
        fitting = [d for d in _divisors(arch.num_layers) if d < par.pp and gpus % (par.tp * d * par.cp) == 0]
        yield SpecIssue(f"{path}.parallel.pp", f"{par.pp} does not divide num_layers={arch.num_layers}",
                        f"use {_list(_divisors(arch.num_layers))}",
                        _parallel_fix(path, par, "pp", fitting[-1]) if fitting else ())
    if par.ep > 1 and not arch.is_moe:
        yield SpecIssue(f"{path}.parallel.ep", f"{par.ep} but {arch.name} has no experts", "set it to 1",
                        (override(f"{path}.parallel.ep", 1),))
    elif arch.is_moe and arch.num_experts % par.ep:
        yield SpecIssue(f"{path}.parallel.ep", f"{par.ep} does not divide num_experts={arch.num_experts}",
                        f"use {_list(_divisors(arch.num_experts)[:8])}")


@rule("roles", "model", examples=[
    ("qwen3-4b-grpo-async", "roles.rollout.gpus_per_replica=2", "roles.rollout.gpus_per_replica"),
    ("tiny-cpu", "roles.actor.parallel.tp=2", "roles.actor.parallel.tp"),
    ("qwen3-4b-grpo-async", "roles.rollout.parallel.tp=2 roles.rollout.gpus_per_replica=2 cluster.gpus_per_node=16",
     "roles.rollout.parallel.tp"),
    ("qwen3-4b-grpo-async", "roles.actor.backend=megatron roles.actor.parallel.tp=3", "roles.actor.parallel.tp"),
    ("qwen3-4b-grpo-async", "roles.actor.backend=megatron roles.actor.parallel.ep=2", "roles.actor.parallel.ep"),
    ("qwen3-4b-grpo-async",
     "roles.actor.backend=megatron roles.actor.gpus=5 roles.actor.parallel.pp=5 cluster.gpus_per_node=9",
     "roles.actor.parallel.pp"),
])
def check_parallel(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Parallel sizes fit each role's GPUs, its backend, and the model's heads, layers and experts."""
    arch = ctx.architecture
    rollout = spec.roles.rollout
    if rollout.gpus_per_replica and rollout.gpus_per_replica != rollout.parallel.tp * rollout.parallel.pp:
        yield SpecIssue("roles.rollout.gpus_per_replica",
                        f"{rollout.gpus_per_replica} differs from the engine's tp x pp = "
                        f"{rollout.parallel.tp * rollout.parallel.pp}",
                        "make gpus_per_replica equal roles.rollout.parallel.tp x pp",
                        overrides(roles__rollout__gpus_per_replica=rollout.parallel.tp * rollout.parallel.pp))
    yield from soundly(_check_parallel_shape("roles.rollout", rollout.gpus_per_replica, rollout, arch,
                                             PluginKind.rollout, ctx.plugin(PluginKind.rollout, rollout.backend),
                                             rollout.backend))
    for name, role in spec.trained_roles().items():  # each role's sizes judged apart
        yield from soundly(_check_parallel_shape(f"roles.{name}", role.gpus, role, arch, PluginKind.trainer,
                                                 ctx.plugin(PluginKind.trainer, role.backend), role.backend))


def _without_modality(spec: RunSpec, modality: str) -> tuple[str, ...]:
    """The overrides that take ``modality`` out of the run: out of ``model.modalities``, and its
    data column and budgets deleted."""
    fix: tuple[str, ...] = ()
    if modality in spec.model.modalities:
        fix += (override("model.modalities", [m for m in spec.model.modalities if m != modality]),)
    if modality in spec.data.media_keys:
        fix += (deletion(f"data.media_keys.{modality}"),)
    if modality in spec.data.media_options:
        fix += (deletion(f"data.media_options.{modality}"),)
    return fix


@rule("model", "data", "roles", examples=[
    ("tiny-omni-cpu", "~data.media_keys.video ~data.media_options.video", "data.media_keys"),
    ("tiny-omni-cpu", "model.modalities=[text,image,audio]", "data.media_keys.video"),
    ("tiny-omni-cpu", "~data.media_keys.video model.modalities=[text,image,audio]", "data.media_options.video"),
    ("tiny-cpu", "model.modalities=[text,image] +data.media_keys.image=image", "model.modalities"),
    ("tiny-omni-cpu", "roles.rollout.backend=vllm", "roles.rollout.backend"),
])
def check_modalities(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Each modality has a data column, the model reads it, and every backend supports it."""
    wanted = spec.model.modalities
    for modality in wanted:
        if modality != "text" and modality not in spec.data.media_keys:
            yield SpecIssue("data.media_keys", f"model.modalities lists {modality} but no column holds it",
                            f"add data.media_keys.{modality}: <column name>", _without_modality(spec, modality))
    for modality in spec.data.media_keys:
        if modality not in wanted:
            yield SpecIssue(f"data.media_keys.{modality}", f"{modality} is not in model.modalities",
                            f"add {modality} to model.modalities, or remove this key",
                            _without_modality(spec, modality))
    for modality in spec.data.media_options:
        if modality not in spec.data.media_keys:
            yield SpecIssue(f"data.media_options.{modality}", f"budgets for {modality}, but data.media_keys names "
                            f"no {modality} column", f"add data.media_keys.{modality}, or remove these options",
                            (deletion(f"data.media_options.{modality}"),))
    arch = ctx.architecture
    if arch is not None:
        for modality in wanted:
            if modality not in arch.modalities:
                yield SpecIssue("model.modalities", f"{arch.name} does not read {modality} "
                                f"(it reads {', '.join(arch.modalities)})",
                                f"remove {modality}, or choose a model that reads it",
                                _without_modality(spec, modality))
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
                                "choose a backend that supports it, or remove it from model.modalities",
                                _without_modality(spec, modality))


def _free_id(key: str, index: int, spec: RunSpec) -> str:
    """``<key>_<index>``, or with a further number, an id no reward entry has."""
    taken = {reward.key for reward in spec.rewards}
    candidate, n = f"{key}_{index}", index
    while candidate in taken:
        n += 1
        candidate = f"{key}_{n}"
    return candidate


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
            yield SpecIssue(path, f"sample {row}, column '{key}': {problem}", hint,
                            overrides(data__on_bad_sample="skip"))


@rule("rewards", "roles", examples=[
    ("tiny-cpu", "rewards=[{name:exact_match},{name:exact_match}]", "rewards[1].id"),
    ("tiny-cpu", 'rewards=[{name:genrm,options:{model:"builtin:tiny-lm"}}]', "roles.reward.host"),
])
def check_rewards(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Reward entries have distinct keys; a model-based reward (a judge) gets reward workers of its
    own, and the backend that serves its model is installed and accepts its options."""
    seen: dict[str, int] = {}
    for i, reward in enumerate(spec.rewards):
        if reward.key in seen:
            yield SpecIssue(f"rewards[{i}].id", f"'{reward.key}' also names rewards[{seen[reward.key]}]",
                            "give each entry its own id (routing and per-reward metrics use it)",
                            (override(f"rewards[{i}].id", _free_id(reward.key, i, spec)),))
        seen.setdefault(reward.key, i)
        cls = ctx.plugin(PluginKind.rewards, reward.name)
        if cls is None or not trait(cls, PluginKind.rewards, "model_based"):
            continue
        if spec.roles.reward.host != "own":
            yield SpecIssue("roles.reward.host", f"rewards[{i}] ('{reward.name}') serves a model, which must not "
                            "share the rollout worker's process", "set roles.reward.host: own",
                            overrides(roles__reward__host="own"))
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


@rule("roles", "algorithm", "placement", examples=[
    ("tiny-cpu", "roles.rollout.replicas=2 roles.rollout.max_replicas=1", "roles.rollout.max_replicas"),
    ("tiny-cpu", "placement.mode=hybrid roles.rollout.max_replicas=2", "roles.rollout.max_replicas"),
    ("tiny-cpu", "roles.rollout.unit_prompts=32", "roles.rollout.unit_prompts"),
    ("tiny-cpu", "algorithm.name=dapo roles.rollout.replicas=2", "algorithm.dynamic_sampling.enabled"),
])
def check_rollout_scaling(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """An elastic rollout (``max_replicas`` above ``replicas``) runs in separate mode only, units of
    rollout work fit in a step, and dynamic sampling gets a whole step in one replica."""
    rollout, algo, mode = spec.roles.rollout, spec.algorithm, spec.placement.mode
    if rollout.max_replicas is not None and rollout.max_replicas < rollout.replicas:
        yield SpecIssue("roles.rollout.max_replicas",
                        f"{rollout.max_replicas} is below roles.rollout.replicas ({rollout.replicas}), the "
                        "replicas the run starts with",
                        f"set it to {rollout.replicas} or more, or remove it for a fixed number of replicas",
                        overrides(roles__rollout__max_replicas=rollout.replicas))
    elif rollout.max_replicas is not None and rollout.max_replicas > rollout.replicas and mode != "separate":
        why = ("in colocate mode the rollout time-shares the actor's GPUs, so it cannot grow past them"
               if mode == "colocate" else
               "elastic rollout is only for separate mode")
        yield SpecIssue("roles.rollout.max_replicas",
                        f"{rollout.max_replicas} replicas (above replicas: {rollout.replicas}) make the rollout "
                        f"elastic, but {why}",
                        f"set placement.mode: separate, or remove max_replicas (or set it to {rollout.replicas})",
                        overrides(roles__rollout__max_replicas=None))
    if rollout.unit_prompts is not None and rollout.unit_prompts > algo.prompts_per_step:
        yield SpecIssue("roles.rollout.unit_prompts",
                        f"{rollout.unit_prompts} is more than algorithm.prompts_per_step ({algo.prompts_per_step}); "
                        "a unit of rollout work is a part of one step's prompts",
                        f"set it to {algo.prompts_per_step} or less, or remove it to let the runtime choose",
                        overrides(roles__rollout__unit_prompts=algo.prompts_per_step))
    unit, units = spec.rollout_units()
    if algo.dynamic_sampling.enabled and units > 1:
        yield SpecIssue("algorithm.dynamic_sampling.enabled",
                        f"dynamic sampling scores and refills a whole step inside one rollout replica, but a step "
                        f"of {algo.prompts_per_step} prompts is cut into {units} units of {unit} prompts "
                        f"(up to {rollout.replica_limit} replicas)",
                        "set it to false, or give the rollout whole-step units (roles.rollout.unit_prompts: "
                        f"{algo.prompts_per_step}, or one replica without max_replicas)",
                        overrides(roles__rollout__unit_prompts=algo.prompts_per_step))


def receives_collectively(backend: type | None) -> bool:
    """Whether a rollout backend class can take weights from a weight group: it has the
    ``collective_receive`` capability (``relax.contracts.CollectiveReceive``; the runtime also reads
    how many ranks it joins with, ``weight_group_ranks``). Read from the class, so checking imports no
    engine."""
    return supports(backend, PluginKind.rollout, "collective_receive")


@rule("roles", "placement", examples=[
    ("tiny-cpu", "roles.rollout.weight_sync=collective placement.mode=colocate async_policy.max_staleness=0",
     "roles.rollout.weight_sync"),
    ("qwen3-4b-grpo-async", "roles.rollout.weight_sync=collective roles.rollout.gpus_per_replica=0",
     "roles.rollout.weight_sync"),
])
def check_weight_sync(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """``collective`` weight sync needs weights to travel (not colocate), a backend that can
    receive them from a weight group, and a rollout on GPUs when the actor's are (NCCL)."""
    rollout = spec.roles.rollout
    if rollout.weight_sync != "collective":
        return
    if spec.placement.mode == "colocate":
        yield SpecIssue("roles.rollout.weight_sync", "collective weight sync, but in colocate mode the rollout "
                        "shares the actor's process and gets its weights in memory",
                        "use auto or object_store, or placement.mode: separate or hybrid",
                        overrides(roles__rollout__weight_sync="auto"))
    if spec.roles.actor.gpus > 0 and rollout.gpus_per_replica == 0:
        yield SpecIssue("roles.rollout.weight_sync", "collective weight sync from an actor on GPUs broadcasts "
                        "over NCCL, which a rollout on CPU (gpus_per_replica: 0) cannot join",
                        "use auto or object_store, or give the rollout GPUs",
                        overrides(roles__rollout__weight_sync="object_store"))
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    if backend is not None and not receives_collectively(backend):
        yield SpecIssue("roles.rollout.weight_sync", f"rollout backend '{rollout.backend}' cannot receive weights "
                        "from a weight group (it has no join_weight_group / receive_weights)",
                        "use auto or object_store, or a backend that can (hf, vllm)",
                        overrides(roles__rollout__weight_sync="object_store"))


def generates_from_tokens(backend: type | None) -> bool:
    """Whether a rollout backend class can continue a multi-turn trajectory from its token ids: the
    ``token_generation`` capability (``relax.contracts.TokenGeneration``); read from the class,
    importing no engine."""
    return supports(backend, PluginKind.rollout, "token_generation")


@rule("roles", "data", "model", examples=[
    ("tiny-agent-cpu", "roles.rollout.agent.max_tokens=4 roles.rollout.agent.max_new_tokens=8",
     "roles.rollout.agent.max_new_tokens"),
])
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
                        "use hf or vllm, or remove roles.rollout.agent", overrides(roles__rollout__backend="hf"))
    per_turn = agent.max_new_tokens or rollout.sampling.max_new_tokens
    if per_turn > agent.max_tokens:
        where = "max_new_tokens" if agent.max_new_tokens else "max_tokens"
        yield SpecIssue(f"roles.rollout.agent.{where}", f"a turn may take {per_turn} tokens but a whole trajectory "
                        f"only {agent.max_tokens}", "raise roles.rollout.agent.max_tokens above the per-turn budget",
                        overrides(roles__rollout__agent__max_tokens=per_turn))
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


@rule("trainer", "data", "roles", "rewards", examples=[
    ("tiny-cpu", "trainer.eval_every=10", "trainer.eval_every"),
    ("tiny-cpu", "+data.eval.source=synthetic:arithmetic placement.mode=colocate async_policy.max_staleness=0 "
     "trainer.eval.host=own", "trainer.eval.host"),
    ("tiny-cpu", "+data.eval.source=synthetic:arithmetic trainer.eval_every=10 roles.reward.host=own", "data.eval"),
    ("tiny-agent-cpu", "+data.eval.source=synthetic:arithmetic", "data.eval"),
    ("tiny-omni-cpu", "+data.eval.source=synthetic:omni", "data.eval"),
])
def check_evaluation(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The evaluation (``trainer.eval_every``) generates on the rollout that hosts the step loop
    and scores there, with the run's rewards built in that worker: rewards that need a worker of
    their own (``roles.reward.host: own``, a judge model on GPUs) cannot score it yet."""
    every = spec.trainer.eval_every
    if spec.data.eval is None:
        if every:
            yield SpecIssue("trainer.eval_every", f"evaluation every {every} steps needs held-out prompts, but "
                            "data.eval is not set", "set data.eval: {source: <file or dataset>}, or remove "
                            "trainer.eval_every", overrides(trainer__eval_every=None))
        return
    fix = "remove data.eval"
    no_eval = overrides(data__eval=None, trainer__eval_every=None)
    if spec.trainer.eval.host == "own" and spec.placement.mode == "colocate":
        yield SpecIssue("trainer.eval.host", "an evaluation worker of its own is not supported in colocate mode "
                        "(the policy's weights stay in the colocated process)",
                        "set trainer.eval.host: rollout or auto (the rollout evaluates between steps)",
                        overrides(trainer__eval__host="rollout"))
    if spec.roles.reward.host == "own":
        yield SpecIssue("data.eval", "the evaluation scores in the rollout worker, but roles.reward.host is own "
                        "(the rewards run in workers of their own)", f"set roles.reward.host: rollout, or {fix}",
                        no_eval)
    if spec.roles.rollout.agent is not None:
        yield SpecIssue("data.eval", "evaluation of agentic rollouts (roles.rollout.agent) is not supported yet",
                        f"remove roles.rollout.agent, or {fix}", no_eval)
    if spec.data.media_keys:
        yield SpecIssue("data.eval", "evaluation takes text prompts only for now", f"remove data.media_keys, or {fix}",
                        no_eval)


@rule("roles", "placement", "algorithm", "data", examples=[
    ("tiny-cpu", "roles.rollout.partial=true placement.mode=colocate async_policy.max_staleness=0",
     "roles.rollout.partial"),
    ("tiny-cpu", "roles.rollout.partial=true roles.rollout.replicas=2", "roles.rollout.partial"),
    ("tiny-agent-cpu", "roles.rollout.partial=true", "roles.rollout.partial"),
    ("tiny-cpu", "roles.rollout.partial=true algorithm.name=dapo", "roles.rollout.partial"),
    ("tiny-omni-cpu", "roles.rollout.partial=true", "roles.rollout.partial"),
    ("tiny-cpu", "roles.rollout.partial=true algorithm.router_replay=r3", "roles.rollout.partial"),
])
def check_partial(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Partial rollouts swap weights in the middle of generation, which needs the trainer in another
    process, a backend that can pause (its ``pausable`` trait), text samples and one rollout replica
    generating whole steps (it keeps the next step's drafts)."""
    rollout = spec.roles.rollout
    if not rollout.partial:
        return
    fix = "set roles.rollout.partial: false"
    off = overrides(roles__rollout__partial=False)
    if spec.placement.mode == "colocate":
        yield SpecIssue("roles.rollout.partial", "partial rollouts need the trainer in another process, but in "
                        "colocate mode rollout and training alternate (no weights arrive mid-generation)",
                        f"use placement.mode: separate or hybrid, or {fix}", off)
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    if backend is not None and not supports(backend, PluginKind.rollout, "pausing"):
        yield SpecIssue("roles.rollout.backend", f"rollout backend '{rollout.backend}' cannot pause generation at a "
                        "token boundary (it does not declare the pausable trait)", f"use hf or vllm, or {fix}", off)
    if rollout.agent is not None:
        yield SpecIssue("roles.rollout.partial", "partial rollouts and agentic rollouts (roles.rollout.agent) do "
                        "not combine yet", f"remove roles.rollout.agent, or {fix}", off)
    if spec.algorithm.dynamic_sampling.enabled:
        yield SpecIssue("roles.rollout.partial", "partial rollouts and dynamic sampling do not combine (dynamic "
                        "sampling draws extra prompts the next step's drafts cannot know)",
                        f"set algorithm.dynamic_sampling.enabled: false, or {fix}", off)
    if spec.data.media_keys:
        yield SpecIssue("roles.rollout.partial", "partial rollouts take text samples only for now",
                        f"remove data.media_keys, or {fix}", off)
    if spec.algorithm.router_replay == "r3":
        yield SpecIssue("roles.rollout.partial", "partial rollouts do not carry routed experts over a pause yet "
                        "(r3)", f"set algorithm.router_replay: r2 or off, or {fix}", off)
    if spec.rollout_units()[1] != 1 or rollout.replica_limit != 1:
        yield SpecIssue("roles.rollout.partial", "partial rollouts run with one rollout replica generating whole "
                        "steps (it keeps the next step's drafts between steps)",
                        f"set roles.rollout.replicas: 1 with no max_replicas or unit_prompts, or {fix}", off)


@rule("algorithm", "roles", "model", examples=[
    ("tiny-cpu", "algorithm.router_replay=r2", "algorithm.router_replay"),
    ("tiny-agent-cpu", "algorithm.router_replay=r3", "algorithm.router_replay"),
])
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
                        "a dense model (no experts)", "set algorithm.router_replay: off, or use an MoE model",
                        overrides(algorithm__router_replay="off"))
    if mode == "r3":
        rollout = spec.roles.rollout
        backend = ctx.plugin(PluginKind.rollout, rollout.backend)
        if backend is not None and "r3" not in trait(backend, PluginKind.rollout, "router_replay"):
            yield SpecIssue("roles.rollout.backend", f"r3 needs the rollout to record each token's routed experts, "
                            f"which rollout backend '{rollout.backend}' cannot",
                            "use a backend that records routing (hf), or algorithm.router_replay: r2 or off",
                            overrides(algorithm__router_replay="off"))
        if rollout.agent is not None:
            yield SpecIssue("algorithm.router_replay", "r3 is not supported with agentic rollouts "
                            "(roles.rollout.agent): multi-turn trajectories do not carry routed experts yet",
                            "set algorithm.router_replay: r2 or off, or remove roles.rollout.agent",
                            overrides(algorithm__router_replay="off"))
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
                            f"{' or '.join([*supported, 'off'])}", overrides(algorithm__router_replay="off"))


@rule("roles", examples=[
    ("tiny-cpu", "roles.actor.max_tokens_per_micro_batch=256 roles.actor.backend=megatron",
     "roles.actor.max_tokens_per_micro_batch"),
])
def check_token_budget(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """``max_tokens_per_micro_batch`` needs a trainer backend that cuts micro-batches by tokens (its
    ``token_budget`` trait: torch); megatron cuts them by rows."""
    for name, role in spec.trained_roles().items():
        if role.max_tokens_per_micro_batch is None:
            continue
        cls = ctx.plugin(PluginKind.trainer, role.backend)
        if cls is not None and not trait(cls, PluginKind.trainer, "token_budget"):
            yield SpecIssue(f"roles.{name}.max_tokens_per_micro_batch",
                            f"trainer backend '{role.backend}' cuts micro-batches by rows, not by a token budget",
                            f"use backend torch, or remove roles.{name}.max_tokens_per_micro_batch and size "
                            f"micro-batches with roles.{name}.micro_batch_size",
                            overrides(**{f"roles__{name}__max_tokens_per_micro_batch": None}))


@rule("roles", "model", "algorithm", examples=[
    ("tiny-lora-cpu", "roles.actor.lora.target_modules=[q_proj,vproj]", "roles.actor.lora.target_modules"),
    ("tiny-lora-cpu", "roles.rollout.partial=true", "roles.rollout.partial"),
    ("tiny-lora-cpu", "roles.actor.backend=megatron", "roles.actor.backend"),
    ("tiny-lora-cpu", "roles.rollout.backend=vllm roles.rollout.weight_sync=collective placement.mode=separate",
     "roles.rollout.weight_sync"),
    ("tiny-lora-cpu", "roles.actor.lora.init_adapter=no-such-adapter", "roles.actor.lora.init_adapter"),
    ("tiny-lora-cpu", "algorithm.router_replay=r2 model.options.architecture=qwen3_moe", "algorithm.router_replay"),
])
def check_lora(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """A ``lora`` block (``relax.spec.lora``) needs a trainer that trains adapters and, on the actor,
    a rollout that applies them; its target modules must be linear layers of the model's decoder.
    Weight syncs then carry the adapter only, which partial rollouts, routing replay and a weight
    group to a rollout without the ``adapter_weight_group`` trait (vllm) do not take yet."""
    from relax.spec.lora import SAVABLE_MODULES, decoder_module_names, unknown_targets

    arch = ctx.architecture
    for name in ("actor", "critic"):
        role = getattr(spec.roles, name)
        lora = None if role is None else role.lora
        if lora is None:
            continue
        path = f"roles.{name}.lora"
        cls = ctx.plugin(PluginKind.trainer, role.backend)
        if cls is not None and not trait(cls, PluginKind.trainer, "lora"):
            yield SpecIssue(f"roles.{name}.backend", f"trainer backend '{role.backend}' cannot train LoRA adapters "
                            f"({path})", f"use the torch trainer (backend: torch), or remove {path} to train "
                            "the whole model", overrides(**{f"roles__{name}__backend": "torch"}))
        if arch is not None:
            unknown = list(unknown_targets(lora, arch))
            if unknown:
                known = decoder_module_names(arch)
                fixed = [typo_of(target, known) or target for target in lora.target_modules]
                hints = "; ".join(f"'{target}': {did_you_mean(target, known)}" for _, target in unknown)
                yield SpecIssue(f"{path}.target_modules", f"{arch.name} has no linear layer named "
                                f"{', '.join(repr(t) for _, t in unknown)} in its decoder ({hints})",
                                f"name linear layers of the decoder ({', '.join(known)}), or use all-linear",
                                overrides(**{f"roles__{name}__lora__target_modules":
                                             fixed if all(f in known for f in fixed) else "all-linear"}))
        for i, module in enumerate(lora.modules_to_save):
            if module not in SAVABLE_MODULES:
                yield SpecIssue(f"{path}.modules_to_save[{i}]", f"'{module}' is not a module LoRA can train in full "
                                f"beside the adapter ({did_you_mean(module, SAVABLE_MODULES)})",
                                f"name one of {', '.join(SAVABLE_MODULES)}, or remove it")
        if lora.init_adapter is not None:
            folder = Path(lora.init_adapter).expanduser()
            folder = folder if folder.is_absolute() else ctx.base_dir / folder
            if not (folder / "adapter_config.json").is_file():
                yield SpecIssue(f"{path}.init_adapter", f"{folder} is no PEFT adapter folder (it has no "
                                "adapter_config.json)", "give a folder written by peft's save_pretrained (such as "
                                "a run's export/step-<n>), or null to start a new adapter",
                                overrides(**{f"roles__{name}__lora__init_adapter": None}))
    lora = spec.roles.actor.lora
    if lora is None:
        return
    rollout = spec.roles.rollout
    backend = ctx.plugin(PluginKind.rollout, rollout.backend)
    if backend is not None and not trait(backend, PluginKind.rollout, "lora_adapters"):
        yield SpecIssue("roles.rollout.backend", f"rollout backend '{rollout.backend}' cannot serve LoRA adapters "
                        "(roles.actor.lora: weight syncs carry only the adapter)",
                        "use a backend that applies adapters (hf, vllm), or remove roles.actor.lora")
    if (rollout.weight_sync == "collective" and backend is not None and receives_collectively(backend)
            and not trait(backend, PluginKind.rollout, "adapter_weight_group")):
        yield SpecIssue("roles.rollout.weight_sync", f"rollout backend '{rollout.backend}' takes a LoRA adapter "
                        "(roles.actor.lora) through the object store, not a weight group",
                        "set roles.rollout.weight_sync: object_store (or auto, which picks it for an adapter)",
                        overrides(roles__rollout__weight_sync="object_store"))
    if rollout.partial:
        yield SpecIssue("roles.rollout.partial", "partial rollouts do not swap LoRA adapters in the middle of "
                        "generation yet (roles.actor.lora)", "set roles.rollout.partial: false",
                        overrides(roles__rollout__partial=False))
    if spec.algorithm.router_replay != "off":
        yield SpecIssue("algorithm.router_replay", "routing replay is not supported with LoRA (roles.actor.lora): "
                        "an MoE model's experts and router are no linear layers an adapter wraps",
                        "set algorithm.router_replay: off", overrides(algorithm__router_replay="off"))


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


def row_limits(spec: RunSpec, options: dict[str, Any]) -> RowLimits:
    """The bounds the file plugin of a data source applies to each row (its ``max_row_bytes`` and
    ``max_columns`` options, when whole numbers; the plugin's own check names any other value)."""
    def option(name: str, default: int) -> int:
        value = options.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default

    return RowLimits(max_row_bytes=option("max_row_bytes", MAX_ROW_BYTES),
                     max_columns=option("max_columns", MAX_COLUMNS),
                     prompt_key=spec.data.prompt_key, max_prompt_chars=prompt_char_limit(spec.data.max_prompt_tokens),
                     on_long_prompt=spec.data.on_long_prompt)


@rule("data", examples=[("tiny-cpu", "data.prompt_key=promt", "data.prompt_key")])
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
            rows, issues = data_columns(data_file, source.source, where, row_limits(spec, source.options))
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
                meant = typo_of(column, found) if hint else None
                yield SpecIssue(path, f"'{column}' is not a column of {described} (it has "
                                f"{', '.join(sorted(found)) or 'none'})",
                                hint or f"set {path} to one of its columns, or fix the data",
                                (override(path, meant),) if meant is not None else ())
            elif every_row and (missing := next((i for i, r in enumerate(rows) if column not in r), None)) is not None:
                yield SpecIssue(path, f"row {missing} of {source.source} has no '{column}' column, which every "
                                "row needs", "give every row a prompt, or remove the rows without one")


@rule("roles", "placement", examples=[
    ("tiny-cpu", "placement.mode=colocate async_policy.max_staleness=0 roles.rollout.replicas=2",
     "roles.rollout.replicas"),
    ("tiny-cpu", "placement.mode=colocate async_policy.max_staleness=0 roles.rollout.replicas=2 "
     "roles.actor.cpu_ranks=2 roles.rollout.backend=vllm", "roles.rollout.backend"),
    ("tiny-agent-cpu", "placement.mode=colocate async_policy.max_staleness=0 roles.rollout.replicas=2 "
     "roles.actor.cpu_ranks=2", "roles.rollout.agent"),
    ("tiny-lora-cpu", "placement.mode=colocate async_policy.max_staleness=0 roles.rollout.replicas=2 "
     "roles.actor.cpu_ranks=2", "roles.actor.lora"),
])
def check_colocated_rollout(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Colocate mode runs one rollout engine inside the actor's process, or one in each of its
    ranks' processes (``RunSpec.engine_per_rank``: one replica per rank, a backend that takes the
    weights in process, plain or dynamic sampling; the trainer's extractor gives the weights). ``check_gpus`` already
    reports replicas whose GPUs do not add up to the actor's; this one the layouts that do."""
    rollout, actor = spec.roles.rollout, spec.roles.actor
    if spec.placement.mode != "colocate" or rollout.replicas == 1 or rollout.gpus != actor.gpus:
        return
    if spec.engine_per_rank:
        backend = ctx.plugin(PluginKind.rollout, rollout.backend)
        if backend is not None and not supports(backend, PluginKind.rollout, "in_process_handover"):
            yield SpecIssue("roles.rollout.backend",
                            f"one colocated rollout engine per actor rank ({rollout.replicas}), but the "
                            f"'{rollout.backend}' backend cannot take the weights in the rank's process",
                            "use roles.rollout.backend hf, or one engine over the actor's GPUs "
                            "(replicas: 1 with tensor parallelism)", overrides(roles__rollout__backend="hf"))
        if actor.lora is not None:
            yield SpecIssue("roles.actor.lora",
                            "a LoRA adapter with one colocated engine per actor rank: the ranks hand their engines "
                            "full weights only so far", "use roles.rollout.replicas 1 (one engine in the actor's "
                            "first process, which takes the adapter alone)", overrides(roles__rollout__replicas=1))
        if rollout.agent is not None:
            yield SpecIssue("roles.rollout.agent",
                            "agentic rollouts with one colocated engine per actor rank: the ranks' engines "
                            "share only plain sampling so far",
                            "use roles.rollout.replicas 1 (one engine in the actor's first process)",
                            overrides(roles__rollout__replicas=1))
        return
    yield SpecIssue("roles.rollout.replicas",
                    f"{rollout.replicas} rollout replicas in colocate mode, but there the runtime runs one rollout "
                    f"engine inside the actor's process, or one in each of its {actor.ranks} rank(s)",
                    f"set replicas: 1 and gpus_per_replica: {actor.gpus} (with a parallel layout the rollout "
                    "backend supports), or one replica per actor rank, or use placement.mode separate for "
                    "several replicas",
                    _one_rollout_engine(rollout, actor.gpus) if actor.gpus
                    else overrides(roles__rollout__replicas=1))


@rule("roles", examples=[("tiny-cpu", "roles.actor.gpus=1 roles.actor.cpu_ranks=2 cluster.gpus_per_node=1",
                          "roles.actor.cpu_ranks")])
def check_cpu_ranks(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """``cpu_ranks`` counts processes of a role on CPU; on GPUs each GPU is a rank."""
    for name, role in spec.trained_roles().items():
        if role.cpu_ranks > 1 and role.gpus:
            yield SpecIssue(f"roles.{name}.cpu_ranks",
                            f"{role.cpu_ranks} CPU ranks, but the role runs on {role.gpus} GPU(s), each a rank",
                            "leave cpu_ranks at 1 on GPUs (set gpus for more ranks)",
                            (override(f"roles.{name}.cpu_ranks", 1),))


#: Roles the runtime runs as one worker so far, whatever the planner lays out.
SINGLE_WORKER_ROLES = ("reward", "advantage")


@rule("roles", examples=[("tiny-cpu", "roles.advantage.replicas=2", "roles.advantage.replicas")])
def check_single_workers(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """The reward and advantage roles run as one worker each (the planner can lay out more)."""
    for name in SINGLE_WORKER_ROLES:
        replicas = getattr(spec.roles, name).replicas
        if replicas != 1:
            yield SpecIssue(f"roles.{name}.replicas", f"{replicas} {name} workers, but the runtime runs one so far",
                            "set it to 1", (override(f"roles.{name}.replicas", 1),))


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
                        "use the torch backend, or placement.mode hybrid where actor_fwd shares the actor's process",
                        overrides(roles__actor_fwd__backend="torch"))


#: Roles holding state that a restart in place would lose, and what that state is.
STATEFUL_ROLES = {
    "actor": "the policy and optimizer state",
    "critic": "the value head and optimizer state",
    "controller": "the run's ledger (policy versions, data-ready signals, rollout work)",
}

#: ``heartbeat_timeout_s`` is at least this many heartbeats, so that a busy machine does not flag
#: healthy workers as hung.
HEARTBEATS_PER_TIMEOUT = 3


@rule("fault_tolerance", examples=[
    ("tiny-cpu", "fault_tolerance.roles.actor.on_failure=restart", "fault_tolerance.roles.actor.on_failure"),
    ("tiny-cpu", "fault_tolerance.heartbeat_s=10 fault_tolerance.heartbeat_timeout_s=20",
     "fault_tolerance.heartbeat_timeout_s"),
    ("tiny-cpu", "fault_tolerance.heartbeat_s=10 fault_tolerance.heartbeat_timeout_s=20 "
     "fault_tolerance.progress_timeout_s=25", "fault_tolerance.heartbeat_timeout_s"),
    ("tiny-cpu", "fault_tolerance.heartbeat_timeout_s=60 fault_tolerance.progress_timeout_s=30",
     "fault_tolerance.progress_timeout_s"),
])
def check_fault_tolerance(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """Stateful roles are never restarted in place, and the failure-detection timeouts are ordered:
    heartbeat interval x 3 <= heartbeat timeout <= progress timeout."""
    ft = spec.fault_tolerance
    for name, state in STATEFUL_ROLES.items():
        yield from soundly(_restarted_in_place(ft, name, state))
    yield from soundly(_timeouts_in_order(ft))


def _restarted_in_place(ft: Any, name: str, state: str) -> Iterator[SpecIssue]:
    if getattr(ft.roles, name).on_failure == "restart":
        yield SpecIssue(f"fault_tolerance.roles.{name}.on_failure",
                        f"restart would start the {name} again in place, losing {state}",
                        "use resume (restart the run from its last checkpoint) or stop",
                        (override(f"fault_tolerance.roles.{name}.on_failure", "resume"),))


def _timeouts_in_order(ft: Any) -> Iterator[SpecIssue]:
    least = HEARTBEATS_PER_TIMEOUT * ft.heartbeat_s
    if ft.heartbeat_timeout_s < least:
        yield SpecIssue("fault_tolerance.heartbeat_timeout_s",
                        f"{ft.heartbeat_timeout_s:g}s is less than {HEARTBEATS_PER_TIMEOUT} heartbeats "
                        f"(heartbeat_s {ft.heartbeat_s:g}s): a busy machine would flag healthy workers as hung",
                        f"set it to {least:g} or more, or lower fault_tolerance.heartbeat_s",
                        (override("fault_tolerance.heartbeat_timeout_s", f"{least:g}"),
                         *((override("fault_tolerance.progress_timeout_s", f"{least:g}"),)
                           if ft.progress_timeout_s < least else ())))
    if ft.progress_timeout_s < ft.heartbeat_timeout_s:
        yield SpecIssue("fault_tolerance.progress_timeout_s",
                        f"{ft.progress_timeout_s:g}s is shorter than heartbeat_timeout_s "
                        f"({ft.heartbeat_timeout_s:g}s): a piece of work must be allowed at least as long as a "
                        "silent worker", f"set it to {ft.heartbeat_timeout_s:g} or more, "
                        "or lower fault_tolerance.heartbeat_timeout_s",
                        (override("fault_tolerance.progress_timeout_s", f"{ft.heartbeat_timeout_s:g}"),))


@rule("tracing", examples=[
    ("tiny-cpu", "tracing.exporter=otlp", "tracing.endpoint"),
])
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
                            "set it, e.g. http://localhost:4318/v1/traces",
                            overrides(tracing__endpoint="http://localhost:4318/v1/traces"))


#: What a spec means: ``relax plan`` lays out a spec that passes them, in order (``check_plugins``
#: first: the rules after it consult the plugin classes it loads).
#: A chat template file larger than this is not a template (a model's own are a few KiB).
MAX_CHAT_TEMPLATE_BYTES = 1024 * 1024


@rule("data", examples=[("tiny-cpu", "data.chat_template=no-such-template.jinja", "data.chat_template")])
def check_chat_template(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """A ``data.chat_template`` file exists (``~`` expanded, relative to the spec's folder), is
    small UTF-8 text and parses as a Jinja template (parsed, never rendered, here)."""
    template = spec.data.chat_template
    if template in ("auto", "none"):
        return
    auto = overrides(data__chat_template="auto")  # the tokenizer's own template
    path = data_path(template, ctx.base_dir)
    if not path.is_file():
        yield SpecIssue("data.chat_template", f"'{template}' is neither auto, none nor an existing file "
                        f"(looked at {path})",
                        "give auto, none, or a Jinja template file relative to the spec's folder",
                        auto)
        return
    if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
        yield SpecIssue("data.chat_template", f"{path} is larger than {MAX_CHAT_TEMPLATE_BYTES} bytes",
                        "give a chat template file (a Jinja template of a few KiB), or use auto", auto)
        return
    import jinja2

    from relax.chat_templates import TemplateBoundError, check_nesting, probe

    try:
        source = path.read_text(encoding="utf-8")
        check_nesting(source)  # before parsing: a template nested hundreds deep crashes Jinja's parser
        jinja2.Environment().parse(source)
    except UnicodeDecodeError:
        yield SpecIssue("data.chat_template", f"{path} is not UTF-8 text", "save the template as UTF-8, or use auto",
                        auto)
        return
    except jinja2.TemplateSyntaxError as exc:
        yield SpecIssue("data.chat_template", f"{path}: line {exc.lineno}: not a valid Jinja template ({exc.message})",
                        "fix the template's syntax, or use auto", auto)
        return
    except (TemplateBoundError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, TemplateBoundError) else "it nests too deeply to parse"
        yield SpecIssue("data.chat_template", f"{path} is refused: {reason}",
                        "a chat template is a short file (bounds in docs/security.md), or use auto", auto)
        return
    problem = probe(source)  # rendered once in a child process, under memory and time limits
    if problem is not None:
        yield SpecIssue("data.chat_template", f"{path} is refused: {problem}",
                        "a chat template renders a conversation in well under a second (bounds in "
                        "docs/security.md), or use auto", auto)


@rule("trainer", "data", "algorithm", "roles")
def check_run_length(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """``trainer.epochs`` resolves to steps (the training set's size is known here), and a trained
    role's learning-rate warmup ends before the run does."""
    from relax.errors import SpecError
    from relax.spec.run_length import run_steps

    try:
        steps = run_steps(spec, ctx.base_dir, ctx.registry)
    except SpecError as exc:
        yield from exc.issues
        return
    for name, role in spec.trained_roles().items():
        optimizer = getattr(role, "optimizer", None)
        if optimizer is None or optimizer.warmup_ratio is not None or optimizer.warmup_steps < steps:
            continue
        yield SpecIssue(f"roles.{name}.optimizer.warmup_steps",
                        f"{optimizer.warmup_steps} warmup steps but the run has {steps} steps: it would never "
                        "train at optimizer.lr", f"give fewer warmup steps than {steps}, or warmup_ratio instead")


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
    check_token_budget,
    check_lora,
    check_fault_tolerance,
    check_tracing,
    check_run_length,
)

#: What today's runtime can run, beyond what the spec means: checked by ``relax validate`` and
#: before ``relax run`` starts anything (after ``RULES``, whose plugin classes they consult), not by
#: ``relax plan``, which lays out what the planner can place.
RUNTIME_RULES: tuple[Rule, ...] = (
    check_colocated_rollout,
    check_cpu_ranks,
    check_single_workers,
    check_actor_fwd_weights,
)
