"""The run's wiring: which worker process hosts which role loops, what each builds, reads and
writes, and how weights travel. ``make_plan`` puts it into the ``Plan``; ``relax run`` builds its
workers from it and re-derives nothing from the spec, so what ``relax plan`` shows is what runs.

The resolvers here answer the questions the wiring depends on (how a step's rollout is cut into
units, which weight channel a run uses, which columns of other roles an advantage estimator reads);
they read the spec and the plugins' declared traits, never a running system. Pure data: no torch,
no ray.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relax.contracts import PluginKind, prompt_char_limit
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.plan.model import (
    DataSettings,
    PluginUse,
    RewardUse,
    RoleInstance,
    RoleWiring,
    RolloutWork,
    RunSettings,
    WorkerPlan,
)
from relax.registry import PluginError, get_registry, trait
from relax.roles import (
    AGENT_COLUMNS,
    CRITIC_VALUES,
    EVALUATION,
    MODEL_ROLES,
    OPTIONAL_ROLES,
    RANKED_ROLES,
    ROLLOUT_COLUMNS,
    ROUTING_COLUMNS,
    STEP_ROLES,
    TOKEN_COLUMNS,
    TRAIN_COLUMNS,
    Column,
    Role,
)
from relax.spec.architecture import ModelArchitecture
from relax.spec.data_files import data_path
from relax.spec.models import RunSpec
from relax.spec.rules import advantage_and_loss, dataset_plugin, receives_collectively
from relax.spec.run_length import run_steps

#: Not a column of its own: ``response`` is announced once a step's rollout rows are on the bus,
#: which is what readers of those rows wait for.
RESPONSE_READY = Column.response

#: Token columns of other model roles an advantage estimator may read (its ``needs``), and their writer.
ROLE_COLUMNS = {Column.values: Role.critic, Column.ref_logprobs: Role.reference}
#: The order in which a worker runs its role loops each step (data order).
LOOP_ORDER = (Role.rollout, Role.reward, Role.reference, CRITIC_VALUES, Role.advantage, Role.actor_fwd, Role.actor,
              Role.critic, EVALUATION)


# -- resolvers ----------------------------------------------------------------------------------


def run_roles(spec: RunSpec) -> list[str]:
    """The roles of a run, in data order."""
    return [*STEP_ROLES, *(name for name in OPTIONAL_ROLES if getattr(spec.roles, name) is not None)]


def _estimator(spec: RunSpec) -> type | None:
    advantage, _ = advantage_and_loss(spec)
    if advantage is None:
        return None
    try:
        return get_registry().load(PluginKind.advantages, advantage)
    except PluginError:
        return None


def advantage_reads(spec: RunSpec) -> tuple[str, ...]:
    """Columns of other model roles the run's advantage estimator reads: those in its ``needs``
    (a token-level estimator's trait) whose role is present. When there are any, advantages cannot
    be computed inside the rollout worker before the batch reaches the bus."""
    estimator = _estimator(spec)
    if estimator is None or not trait(estimator, PluginKind.advantages, "token_level"):
        return ()
    needs = trait(estimator, PluginKind.advantages, "needs")
    return tuple(sorted(c for c in needs if getattr(spec.roles, ROLE_COLUMNS.get(c, ""), None) is not None))


def weight_sync(spec: RunSpec, backend: type | None = None) -> str:
    """The weight channel of a run outside colocate mode, ``roles.rollout.weight_sync`` resolved:
    ``auto`` is ``collective`` where the rollout backend receives collectively and the actor and
    the rollout have GPUs (and the actor trains no LoRA adapter), ``object_store`` otherwise. ``backend`` defaults to
    the registered class."""
    rollout = spec.roles.rollout
    if rollout.weight_sync != "auto":
        return rollout.weight_sync
    if spec.placement.mode == "colocate" or not (rollout.gpus_per_replica > 0 and spec.roles.actor.gpus > 0):
        return "object_store"
    if spec.roles.actor.lora is not None:  # a LoRA adapter is small (the vllm rollout takes it no other way)
        return "object_store"
    if backend is None:
        try:
            backend = get_registry().load(PluginKind.rollout, rollout.backend)
        except PluginError:
            return "object_store"
    return "collective" if receives_collectively(backend) else "object_store"


def rollout_sampler(spec: RunSpec) -> str:
    """The name of the sampler the rollout draws with (``RunSettings.sampler``): the runtime builds
    it by this name, and ``relax plan`` shows it."""
    rollout = spec.roles.rollout
    inner = "agent" if rollout.agent is not None else "partial" if rollout.partial else "plain"
    return f"dynamic({inner})" if spec.algorithm.dynamic_sampling.enabled else inner


def rollout_work(spec: RunSpec) -> RolloutWork:
    unit, units = spec.rollout_units()
    return RolloutWork(unit_prompts=unit, units_per_step=units, replica_limit=spec.rollout_producers,
                       ragged=units > 1)


# -- plugins ------------------------------------------------------------------------------------


def _use(kind: PluginKind, name: str, options: dict[str, Any], context: Any = None) -> PluginUse:
    """A plugin with the full options of its typed ``Config`` (defaults filled in) and its context,
    so the plan shows every setting the worker will build it with."""
    registry = get_registry()
    dumped = None if context is None else context.model_dump(mode="json")
    try:
        config = registry.build_config(kind, name, options)
    except Exception:  # not loadable here (relax plan of a spec for another machine): as written
        return PluginUse(kind=kind.value, name=name, options=dict(options), context=dumped)
    full = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(options)
    return PluginUse(kind=kind.value, name=name, options=full, context=dumped)


def _backend_options(options: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """A model backend's options with this worker's torch threads, unless the spec set them."""
    return {**options, "num_threads": options.get("num_threads") or threads}


def dataset_use(spec: RunSpec, base_dir: Path, split: str = "train") -> PluginUse:
    """The training (or held-out: ``split="eval"``) data set; a file path is taken relative to the
    spec's folder."""
    source = getattr(spec.data, split)
    name, implied = dataset_plugin(source.source)
    options = {**implied, **source.options}
    if "path" in implied:  # "~" expanded, a relative path from the spec's folder, as validation reads it
        options["path"] = str(data_path(options["path"], base_dir))
    if "path" in implied:  # a data file: its rows' prompts are checked to be text, and bounded, as it is read
        options.setdefault("prompt_key", spec.data.prompt_key)
        options.setdefault("max_prompt_chars", prompt_char_limit(spec.data.max_prompt_tokens))
        options.setdefault("on_long_prompt", spec.data.on_long_prompt)
    return _use(PluginKind.datasets, name, options)


def reward_uses(spec: RunSpec) -> list[RewardUse]:
    return [RewardUse(key=r.key, plugin=_use(PluginKind.rewards, r.name, r.options), weight=r.weight,
                      timeout_s=r.timeout_s, on_error=r.on_error, max_error_frac=r.max_error_frac, always=r.always)
            for r in spec.rewards]


def rollout_use(spec: RunSpec, threads: int | None = None, base_dir: Path | None = None) -> PluginUse:
    """The rollout backend, its options (with this worker's torch threads) and its context; the
    model is as ``model.path`` names it (the worker puts in the folder it was materialized to).
    ``base_dir``: the spec's folder (a relative ``data.chat_template`` is taken from it)."""
    role = spec.roles.rollout
    return _use(PluginKind.rollout, role.backend, _backend_options(role.options, threads),
                rollout_context(spec, spec.model.path, base_dir=base_dir))


def trainer_use(spec: RunSpec, role: str, threads: int | None = None, base_dir: Path | None = None) -> PluginUse:
    """A model role's trainer backend, its options and context (the model as for the rollout;
    ``base_dir``: the spec's folder, which a data file counted for ``trainer.epochs`` is taken from)."""
    block = getattr(spec.roles, role)
    return _use(PluginKind.trainer, block.backend, _backend_options(block.options, threads),
                trainer_context(spec, role, spec.model.path, base_dir=base_dir))


def advantage_use(spec: RunSpec) -> PluginUse:
    name, _ = advantage_and_loss(spec)
    return _use(PluginKind.advantages, name, spec.algorithm.advantage_options, algorithm_context(spec))


def loss_use(spec: RunSpec) -> PluginUse:
    """The policy loss the actor optimises."""
    _, name = advantage_and_loss(spec)
    return _use(PluginKind.losses, name, spec.algorithm.loss_options, algorithm_context(spec))


# -- roles --------------------------------------------------------------------------------------


def _media(spec: RunSpec) -> tuple[str, ...]:
    return (Column.media,) if spec.data.media_keys else ()


def _agent(spec: RunSpec) -> tuple[str, ...]:
    """The token columns of agentic runs and partial rollouts: which tokens the policy chose, and
    with which version."""
    rollout = spec.roles.rollout
    return AGENT_COLUMNS if rollout.agent is not None or rollout.partial else ()


def _routing(spec: RunSpec) -> tuple[str, ...]:
    """The rollout's recorded expert ids, for a run that replays them in the actor (r3)."""
    return ROUTING_COLUMNS if spec.algorithm.router_replay == "r3" else ()


def _weights_channel(spec: RunSpec, roles: set[str]) -> str:
    """How policy weights move between the actor and a rollout: in memory in one process,
    over a weight group (``collective``), or through Ray's object store."""
    if {Role.rollout, Role.actor} <= roles:
        return "in-process"
    return "collective" if weight_sync(spec) == "collective" else "object-store"


class _WorkerWiring:
    """Builds the role loops of one worker, mirroring how they hand rows to each other."""

    def __init__(self, spec: RunSpec, base_dir: Path, roles: list[str], threads: int, replica: int,
                 evaluator: bool) -> None:
        self.spec, self.base_dir, self.roles, self.threads, self.replica = spec, base_dir, set(roles), threads, replica
        self.evaluator = evaluator
        """The run has an evaluation worker (``trainer.eval.host``): the rollout does not evaluate,
        and the actor also publishes each version to the object store, where that worker loads it."""

    def build(self) -> list[RoleWiring]:
        spec, roles = self.spec, self.roles
        estimator = _estimator(spec)
        reads_of_others = advantage_reads(spec)
        critic = spec.roles.critic is not None
        wired: dict[str, RoleWiring] = {}
        # Co-hosted roles hand a step's rows on in memory: the rollout to the scorer riding on it,
        # the scorer to the advantage estimator beside it; the last of them writes to the bus. The
        # scorer rides on the rollout only when one replica makes whole steps (with several, a
        # step's units come from different processes and are scored from the bus). An estimator
        # that reads columns of the critic or the reference waits for them on the bus instead.
        scorer_on_rollout = {Role.rollout, Role.reward} <= roles and spec.rollout_producers == 1
        inline_advantage = {Role.reward, Role.advantage} <= roles and not reads_of_others
        inline_actor = scorer_on_rollout and inline_advantage and self._actor_takes_in_memory()
        advantage_tokens = critic or (estimator is not None
                                      and trait(estimator, PluginKind.advantages, "token_level"))
        evaluates_here = spec.data.eval is not None and self.replica == 0 and not self.evaluator
        if Role.rollout in roles:
            media = [_use(PluginKind.modalities, m, spec.data.media_options.get(m, {})) for m in spec.data.media_keys]
            agent = spec.roles.rollout.agent
            environment = ([_use(PluginKind.environments, agent.environment, agent.environment_options)]
                           if agent is not None and agent.environment is not None else [])
            wired[Role.rollout] = RoleWiring(
                role=Role.rollout, task=Role.rollout,
                plugins=[rollout_use(spec, self.threads, self.base_dir),
                         dataset_use(spec, self.base_dir), *media, *environment],
                writes=[*ROLLOUT_COLUMNS, *_media(spec), *_agent(spec), *_routing(spec)],
                hands_to=Role.reward if scorer_on_rollout else None,
                weights_in=_weights_channel(spec, roles), reports=[Role.rollout] if self.replica == 0 else [],
                evaluation=dataset_use(spec, self.base_dir, "eval") if evaluates_here else None,
                evaluation_rewards=reward_uses(spec) if evaluates_here and not scorer_on_rollout else [])
        if EVALUATION in roles:
            # A rollout engine of its own: the backend and the held-out data, scored with rewards it
            # builds itself, on the versions it loads from the object store.
            wired[EVALUATION] = RoleWiring(
                role=Role.rollout, task=EVALUATION, plugins=[rollout_use(spec, self.threads, self.base_dir)],
                evaluation=dataset_use(spec, self.base_dir, "eval"), evaluation_rewards=reward_uses(spec),
                weights_in="object-store")
        if Role.reward in roles:
            wired[Role.reward] = RoleWiring(
                role=Role.reward, task=Role.reward, rewards=reward_uses(spec),
                reads=[Column.prompt, Column.response, Column.label],
                takes_from=Role.rollout if scorer_on_rollout else None,
                waits_for=[] if scorer_on_rollout else [RESPONSE_READY], writes=[Column.rewards],
                hands_to=Role.advantage if inline_advantage else None, reports=[Role.reward])
        if Role.reference in roles:
            # With the actor's LoRA beside it, the reference is the actor's own base model with the
            # adapter disabled (its trainer's compute_base_logprobs): no second copy of the model.
            base = spec.roles.actor.lora is not None and Role.actor in roles
            wired[Role.reference] = self._forward(Role.reference, Column.ref_logprobs,
                                                  weights_in="shared" if base else None)
        if Role.critic in roles:
            trainer = trainer_use(spec, Role.critic, self.threads, self.base_dir)
            wired[CRITIC_VALUES] = RoleWiring(role=Role.critic, task=CRITIC_VALUES, plugins=[trainer],
                                              reads=[*TOKEN_COLUMNS, *_agent(spec)], waits_for=[RESPONSE_READY],
                                              writes=[Column.values], reports=[CRITIC_VALUES])
            wired[Role.critic] = RoleWiring(role=Role.critic, task=Role.critic,
                                            reads=[*TOKEN_COLUMNS, *_agent(spec), Column.values, Column.returns],
                                            waits_for=[Column.returns], reports=[Role.critic])
        if Role.advantage in roles:
            tokens = ([Column.input_ids, Column.rollout_logprobs, Column.lengths, *_agent(spec)]
                      if advantage_tokens else [])
            wired[Role.advantage] = RoleWiring(
                role=Role.advantage, task=Role.advantage, plugins=[advantage_use(spec)],
                reads=[Column.rewards, *tokens, *reads_of_others],
                takes_from=Role.reward if inline_advantage else None,
                waits_for=[] if inline_advantage else [Column.rewards, *reads_of_others],
                writes=[Column.advantages, *([Column.returns] if critic else [])],
                hands_to=Role.actor if inline_actor else None, reports=[Role.advantage])
        if Role.actor_fwd in roles:
            wired[Role.actor_fwd] = self._forward(Role.actor_fwd, Column.old_logprobs,
                                                  weights_in="shared" if Role.actor in roles else "object-store")
        if Role.actor in roles:
            optional = [c for c, r in ((Column.ref_logprobs, Role.reference), (Column.old_logprobs, Role.actor_fwd))
                        if getattr(spec.roles, r) is not None]
            out = _weights_channel(spec, roles)
            outgoing = [out]
            if ((spec.roles.actor_fwd is not None and Role.actor_fwd not in roles) or self.evaluator) \
                    and out != "object-store":
                outgoing.append("object-store")  # an actor_fwd elsewhere, an evaluation worker load from there
            wired[Role.actor] = RoleWiring(
                role=Role.actor, task=Role.actor,
                plugins=[trainer_use(spec, Role.actor, self.threads, self.base_dir), loss_use(spec)],
                reads=[*TRAIN_COLUMNS, *optional, *_media(spec), *_agent(spec), *_routing(spec)],
                takes_from=Role.advantage if inline_actor else None,
                waits_for=[] if inline_actor else [Column.advantages, *optional],
                weights_out=outgoing, reports=[Role.actor])
        return [wired[name] for name in LOOP_ORDER if name in wired]

    def _actor_takes_in_memory(self) -> bool:
        """Whether a step's rows go from the rollout, through the scorer and estimator riding on it,
        to the actor in the same process without touching the bus (colocate's case). Only when
        nothing else reads them (no reference, proximal-policy or critic role). Nothing is lost: a
        worker that hosts the actor is never restarted in place (validation refuses ``restart`` for
        the actor), a failure resumes the run from its checkpoint with an empty bus."""
        spec, roles = self.spec, self.roles
        if not {Role.rollout, Role.reward, Role.advantage, Role.actor} <= roles:
            return False
        return all(getattr(spec.roles, r) is None for r in (Role.reference, Role.actor_fwd, Role.critic))

    def _forward(self, role: str, column: str, weights_in: str | None) -> RoleWiring:
        shared = weights_in == "shared"
        plugins = [] if shared else [trainer_use(self.spec, role, self.threads, self.base_dir)]
        # actor_fwd's proximal log-probs are the actor's policy: routed like the actor's (r3).
        routing = _routing(self.spec) if role == Role.actor_fwd else ()
        return RoleWiring(role=role, task=role, plugins=plugins,
                          reads=[*TOKEN_COLUMNS, *_media(self.spec), *_agent(self.spec), *routing],
                          waits_for=[RESPONSE_READY], writes=[column], weights_in=weights_in, reports=[role])


# -- workers ------------------------------------------------------------------------------------


def holder_name(roles: list[str], replica: int = 0) -> str:
    """A worker's name in the run: its roles, and the replica number of an extra rollout replica."""
    return "/".join(roles) + (f"#{replica}" if replica else "")


#: Model width per torch intra-op thread worth having on CPU. A thread more than the model's matrix
#: products can use only spins between them: on a 16-core machine the tiny preset (width 64) ran a
#: colocated step no faster on 16 threads than on 2 and kept all 16 cores busy doing it (493 against
#: 56 CPU-ms a step), and a separate run's two workers spun against each other (bench/step_time.py).
HIDDEN_PER_THREAD = 32


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (what ``taskset`` or a container's cpuset
    leaves it), which ``os.cpu_count()`` ignores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


def torch_threads(cores: int, model_processes: int, arch: ModelArchitecture | None) -> int:
    """Torch threads per model process: an equal share of ``cores``, but no more than the model's
    width can use (``HIDDEN_PER_THREAD``; at least 2). Unknown architecture: the whole share."""
    share = max(1, cores // max(1, model_processes))
    if arch is None:
        return share
    return min(share, max(2, arch.hidden_size // HIDDEN_PER_THREAD))


def crowded_cores_note(spec: RunSpec, workers: list[WorkerPlan], cores: int | None = None) -> str | None:
    """A note for a CPU-only run on this machine outside colocate mode whose ``cores`` (default:
    those this process may run on) give each model process a single torch thread: separate mode
    overlaps generating with training only on cores it has to spare, and its workers, the bus and
    the run state then take turns on the same ones. On the 2-core box the tiny preset ran separate
    mode at 0.6-0.9x of colocate's speed, and at 1.1x on 16 cores (docs/runtime.md)."""
    if spec.placement.mode == "colocate" or spec.cluster.address is not None or spec.cluster.gpus_per_node:
        return None
    cores = cores or available_cores()
    model = [w for w in workers if MODEL_ROLES & set(w.role_names)]
    if len(model) < 2 or cores >= 2 * len(model):
        return None
    return (f"{len(model)} model processes share this machine's {cores} core{'s' if cores > 1 else ''}, one torch "
            f"thread each: {spec.placement.mode} mode overlaps generating with training only on spare cores, so "
            "colocate mode is likely faster here (docs/runtime.md)")


def plan_workers(spec: RunSpec, instances: list[RoleInstance], base_dir: Path,
                 cores: int | None = None, arch: ModelArchitecture | None = None) -> list[WorkerPlan]:
    """One worker process per planned bundle: roles whose first instances share a bundle share a
    process (colocate's rollout and actor; a rollout and the scorer riding on it; reward and
    advantage) and hand data to each other in memory. A model role with several ranks is hosted by
    the worker of its rank 0, which starts the other ranks itself; each rollout instance past the
    first is a process of its own that only generates.

    ``cores`` (default: those this process may run on) is shared out as torch threads between the
    model processes, each getting no more than the model ``arch`` can use (``torch_threads``)."""
    cores = cores or available_cores()
    roles = run_roles(spec)

    def of(role: str) -> list[RoleInstance]:
        return [i for i in instances if i.role == role]

    by_bundle: dict[tuple[str, int], list[RoleInstance]] = {}
    for role in roles:
        first = of(role)[0]
        by_bundle.setdefault((first.pool, first.bundles[0]), []).append(first)
    # Colocation across ranks: the rollout's other replicas live in the actor's other ranks.
    replicas = [] if spec.engine_per_rank else of(Role.rollout)[1:]
    extra_ranks = sum(len(of(role)) - 1 for role in RANKED_ROLES if role in roles)
    model_processes = (sum(1 for group in by_bundle.values() if MODEL_ROLES & {i.role for i in group})
                       + len(replicas) + extra_ranks)
    threads = torch_threads(cores, model_processes, arch)
    evaluator = of(EVALUATION)
    workers = []
    for group in by_bundle.values():
        names = [i.role for i in group]
        anchor = next((i for i in group if i.role == Role.actor), group[0])
        own = threads if MODEL_ROLES & set(names) else 1
        ranks = {role: [i.rank for i in of(role)] for role in names if role in RANKED_ROLES and len(of(role)) > 1}
        engines = spec.engine_per_rank and {Role.actor, Role.rollout} <= set(names)
        workers.append(_worker(spec, base_dir, names, anchor, own, 0, ranks, bool(evaluator), engines))
    workers += [_worker(spec, base_dir, [Role.rollout], instance, threads, instance.rank, {}) for instance in replicas]
    # Not counted among the model processes above: on GPUs it has devices of its own; on CPU it
    # runs one thread at the lowest priority, in the time the others leave idle (its torch threads
    # would otherwise be started before it lowers its priority: relax.runtime.worker.evaluation).
    workers += [_worker(spec, base_dir, [EVALUATION], instance, threads if instance.gpus else 1, 0, {}, True)
                for instance in evaluator]
    return workers


def _worker(spec: RunSpec, base_dir: Path, roles: list[str], anchor: RoleInstance, threads: int, replica: int,
            ranks: dict[str, list[int]], evaluator: bool = False, engine_per_rank: bool = False) -> WorkerPlan:
    return WorkerPlan(holder=holder_name(roles, replica),
                      roles=_WorkerWiring(spec, base_dir, roles, threads, replica, evaluator).build(),
                      instance=anchor, replica=replica, threads=threads, ranks=ranks,
                      engine_per_rank=engine_per_rank)


def rollout_replica(spec: RunSpec, workers: list[WorkerPlan], base_dir: Path) -> WorkerPlan | None:
    """The worker ``relax scale`` starts for each rollout replica it adds (replica number 1 here;
    the controller numbers them): a rollout alone, on a bundle like the first rollout worker's,
    with its threads. None when the rollout is not elastic (no ``roles.rollout.max_replicas``)."""
    if spec.roles.rollout.max_replicas is None:
        return None
    first = next(w for w in workers if Role.rollout in w.role_names)
    return _worker(spec, base_dir, [Role.rollout], first.instance, first.threads, 1, {})


def run_settings(spec: RunSpec, base_dir: Path) -> RunSettings:
    """The run-wide settings of a spec, as the controller and the workers read them."""
    from relax.media import media_base_dir

    algo, data = spec.algorithm, spec.data
    media_dir = media_base_dir(spec, base_dir) if data.media_keys else None
    return RunSettings(
        name=spec.name, seed=spec.seed, steps=run_steps(spec, base_dir), epochs=spec.trainer.epochs,
        output_dir=spec.trainer.output_dir,
        checkpoint_every=spec.trainer.checkpoint_every, keep_checkpoints=spec.trainer.keep_checkpoints,
        export_every=spec.trainer.export_every or 0,
        prompts_per_step=algo.prompts_per_step, samples_per_prompt=algo.samples_per_prompt,
        max_staleness=spec.async_policy.staleness_cap, dynamic_sampling=algo.dynamic_sampling.enabled,
        auto_staleness=(spec.async_policy.auto.model_copy(deep=True)
                        if spec.async_policy.max_staleness == "auto" else None),
        dynamic_sampling_rounds=algo.dynamic_sampling.max_rounds,
        max_new_tokens=spec.roles.rollout.sampling.max_new_tokens,
        data=DataSettings(prompt_key=data.prompt_key, label_key=data.label_key, reward_key=data.reward_key,
                          shuffle=data.shuffle, media_dir=None if media_dir is None else str(media_dir)),
        fault_tolerance=spec.fault_tolerance.model_copy(deep=True), tracing=spec.tracing.model_copy(deep=True),
        bus_node_resource=spec.cluster.bus_node_resource,
        agent=None if spec.roles.rollout.agent is None else spec.roles.rollout.agent.model_copy(deep=True),
        partial=spec.roles.rollout.partial, sampler=rollout_sampler(spec),
        mismatch=spec.async_policy.mismatch.model_copy(deep=True),
        eval_every=spec.trainer.eval_every or 0,
        evaluation=None if data.eval is None else spec.trainer.eval.model_copy(deep=True),
        log_samples_every=spec.trainer.log_samples_every, log_samples=spec.trainer.log_samples)
