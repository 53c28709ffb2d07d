"""The Plan: pure, serializable data saying where every role instance runs.

``relax plan`` renders it; ``relax run`` builds its Ray placement groups from it and never
re-derives placement. ``Plan.model_json_schema()`` is checked in as ``schemas/plan.schema.json``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from relax.algo.staleness import StalenessPolicy, staleness_policy
from relax.spec.attribute_docs import DocumentedModel
from relax.spec.models import AgentSpec, AutoStalenessSpec, EvalSpec, FaultToleranceSpec, MismatchSpec, TracingSpec

Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


class PlanPart(DocumentedModel):
    """Base of the plan's parts: unknown keys are errors; docstrings document fields (read when a
    schema asks for them: ``relax.spec.attribute_docs``)."""

    model_config = ConfigDict(extra="forbid")


class Bundle(PlanPart):
    """One Ray placement-group bundle: resources reserved on one node."""

    index: int
    """Position of the bundle in its pool."""
    node: int
    """Planned node index (0-based, in the order the cluster lists its nodes)."""
    gpus: list[int] = Field(default_factory=list)
    """GPU indices on that node (empty for a CPU bundle)."""
    cpus: float
    """Logical CPUs reserved."""


class Pool(PlanPart):
    """A Ray placement group shared by one or more roles."""

    name: str
    """Pool name (also the placement group's name)."""
    strategy: Strategy
    """Ray placement strategy: STRICT_PACK when the pool fits one node, PACK otherwise."""
    roles: list[str]
    """Roles whose instances sit in this pool."""
    bundles: list[Bundle]
    """The bundles, one per GPU (or one per CPU worker)."""

    @property
    def gpu_count(self) -> int:
        return sum(len(b.gpus) for b in self.bundles)


class RoleInstance(PlanPart):
    """One Ray actor: a rank of a trained role, a rollout engine or a CPU worker."""

    role: str
    """Role name (rollout, actor, reference, critic, actor_fwd, reward, advantage), or evaluation:
    the evaluation worker's engine (``trainer.eval.host``)."""
    rank: int
    """Index of this instance within its role."""
    pool: str
    """The pool it is placed in."""
    bundles: list[int]
    """Bundle indices in that pool (a rollout engine with tp x pp GPUs spans several)."""
    node: int
    """Planned node."""
    gpus: list[int] = Field(default_factory=list)
    """GPU indices on that node; empty on CPU."""
    gpu_fraction: float = 0.0
    """Share of each GPU's scheduling resource this actor takes (colocated roles split one GPU)."""
    coords: dict[str, int] = Field(default_factory=dict)
    """Parallel coordinates of a trained rank: dp, tp, pp, cp (replica for rollout engines)."""


class BusField(PlanPart):
    """A column on the TransferQueue bus: who writes it and who reads it."""

    name: str
    writer: str
    readers: list[str]


class WeightSyncEdge(PlanPart):
    """Versioned weights published by ``source`` and loaded by ``target`` at a batch boundary."""

    source: str
    target: str
    mechanism: Literal["in-process", "object-store", "nccl-broadcast", "gloo-broadcast", "cuda-ipc"]
    """How the bytes move: same process, Ray object store, a weight group's broadcast (NCCL on GPUs,
    gloo on CPU: ``roles.rollout.weight_sync``), or CUDA IPC (shared GPUs)."""
    bytes_per_sync: int | None = None
    """Bytes one version moves (``relax.plan.memory.weight_sync_bytes``): the whole model, or the
    LoRA adapter alone; None when the architecture is unknown."""
    adapter_only: bool = False
    """Only the actor's LoRA adapter moves (``roles.actor.lora``)."""


class StalenessWindow(PlanPart):
    """Policy versions a step may train on."""

    step: int
    min_version: int
    max_version: int


class StalenessSchedule(PlanPart):
    """The staleness bound as the runtime enforces it."""

    max_staleness: int
    """The most staleness a sample may have (``auto.max`` with ``max_staleness: auto``)."""
    correction: str
    rule: str
    """The admission rule in words."""
    first_steps: list[StalenessWindow]
    """The allowed version window of the first steps (the pattern repeats)."""


class MemoryItem(PlanPart):
    """One contribution to a GPU's memory, in GiB."""

    role: str
    what: str
    """weights, gradients, optimizer, activations, logits, kv_cache."""
    gib: float
    transient: bool = False
    """Freed between uses (activations, logits, KV cache) rather than held for the whole run."""


class DeviceMemory(PlanPart):
    """The estimate for one GPU (or the host, for CPU roles)."""

    node: int
    gpu: int | None
    """GPU index on the node; None for host memory of CPU roles."""
    roles: list[str]
    items: list[MemoryItem]
    phases: dict[str, float]
    """Resident GiB per phase (colocate: generate and train; otherwise one phase: run)."""
    peak_gib: float
    capacity_gib: float | None
    """The GPU's memory from cluster.gpu_memory_gb; None for the host."""


class PluginUse(PlanPart):
    """One plugin a role builds: its kind, its registered name and the options its ``Config``
    is built from (validated against that ``Config`` when the plan is made)."""

    kind: str
    """The plugin kind (``relax.<kind>`` entry-point group): rollout, trainer, rewards, ..."""
    name: str
    """The registered name within the kind."""
    options: dict[str, Any] = Field(default_factory=dict)
    """What the plugin's typed ``Config`` is built from, exactly as the worker builds it."""
    context: dict[str, Any] | None = None
    """The typed context of its kind (``relax.contracts``: ``RolloutContext``, ``TrainerContext``,
    ``AlgorithmContext``) as the worker hands it over, except for what only the worker knows: where
    the model was materialized and which device it got. None for kinds built from options alone."""


class RewardUse(PlanPart):
    """One reward of the run, as the scorer weighs and guards it."""

    key: str
    """The entry's id (per-reward metrics and routing)."""
    plugin: PluginUse
    weight: float
    timeout_s: float | None
    on_error: str
    max_error_frac: float = 0.5
    """Under ``on_error: zero``, the share of a batch it may fail on before the run stops."""
    always: bool


class RoleWiring(PlanPart):
    """One role loop in a worker: what it builds, what it reads and writes, how weights reach it."""

    role: str
    """The role (rollout, reward, advantage, actor, reference, actor_fwd, critic)."""
    task: str
    """The loop's name: what it reads the bus as and reports its step under (the role's name, but
    the critic runs two loops: ``critic_values`` and ``critic``)."""
    plugins: list[PluginUse] = Field(default_factory=list)
    """The plugins it builds, in the order it builds them."""
    rewards: list[RewardUse] = Field(default_factory=list)
    """The reward role's rewards (empty for other roles)."""
    reads: list[str] = Field(default_factory=list)
    """The columns it uses of each step's rows."""
    takes_from: str | None = None
    """Where its rows come from: None, the bus (once every column in ``waits_for`` is announced);
    or the role in the same worker that hands them over in memory (a scorer riding on the rollout,
    an estimator beside the scorer)."""
    waits_for: list[str] = Field(default_factory=list)
    """Columns announced for a step before it reads from the bus (``response``: the rollout's rows
    are in)."""
    writes: list[str] = Field(default_factory=list)
    """The columns it produces. A role that hands its rows on (``hands_to``) passes its columns
    along; the last of the chain puts or writes them all to the bus."""
    hands_to: str | None = None
    """The role in the same worker that gets its rows, and its columns, in memory."""
    evaluation: PluginUse | None = None
    """The held-out data set (``data.eval``) this loop evaluates on: the evaluation worker's loop,
    or (``trainer.eval.host`` rollout) the rollout that hosts the step loop; None: it does not
    evaluate."""
    evaluation_rewards: list[RewardUse] = Field(default_factory=list)
    """With ``evaluation``: the rewards it scores with when no reward loop rides in its worker
    (the evaluation worker, a rollout with several replicas); empty: the riding reward loop's."""
    weights_in: str | None = None
    """How new policy weights reach it (a ``WeightSyncEdge`` mechanism; ``shared``: it reuses the
    actor's own backend in this process); None: it holds no policy weights."""
    weights_out: list[str] = Field(default_factory=list)
    """How it publishes new policy weights (the actor): the mechanisms of its outgoing edges."""
    reports: list[str] = Field(default_factory=list)
    """The per-step reports it sends the controller (the critic sends two)."""


class WorkerPlan(PlanPart):
    """One Ray actor process of the run and everything it is built from."""

    holder: str
    """The worker's name in the run (heartbeats, leases, logs): its roles joined by ``/``, and
    ``#n`` for the n-th extra rollout replica; ``evaluation`` for the evaluation worker."""
    roles: list[RoleWiring]
    """The role loops it hosts, in the order it runs them each step (data order)."""
    instance: RoleInstance
    """The plan instance whose bundle it takes (the actor's, when it hosts the actor)."""
    replica: int = 0
    """0 for the worker that hosts the run's step loops; n > 0 for the n-th extra rollout replica,
    which only generates (it leases units of rollout work)."""
    threads: int
    """Torch threads per process of this worker: the machine's cores shared by the run's model
    processes (a CPU-only worker gets one)."""
    ranks: dict[str, list[int]] = Field(default_factory=dict)
    """Per model role spanning several processes: its instance ranks (0 is this worker, which starts
    the others on their planned bundles)."""
    engine_per_rank: bool = False
    """Colocation across ranks (``RunSpec.engine_per_rank``): every rank of the actor hosts a rollout
    engine of its own in its process, generates a share of each step and takes the weights from its
    own shards; the rollout's replicas past the first are those engines, not workers."""

    @property
    def pool(self) -> str:
        return self.instance.pool

    @property
    def bundle(self) -> int:
        return self.instance.bundles[0]

    @property
    def role_names(self) -> list[str]:
        """The roles it hosts, each once, in data order."""
        return list(dict.fromkeys(r.role for r in self.roles))


class DataSettings(PlanPart):
    """How the rollout reads the training data set's rows."""

    prompt_key: str
    label_key: str
    reward_key: str | None
    shuffle: bool
    media_dir: str | None
    """Where relative media paths of the data are taken from (the data file's folder, or the
    spec's); None for a text run."""


class RunSettings(PlanPart):
    """The run-wide settings the controller and every worker read, copied from the spec: with the
    workers' wiring, everything a run is built from."""

    name: str
    seed: int
    steps: int
    """The run's training steps: ``trainer.steps``, or ``trainer.epochs`` resolved against the
    training set's size (``relax.spec.run_length``)."""
    epochs: float | None = None
    """``trainer.epochs`` when the steps were resolved from it; None: ``trainer.steps`` gave them."""
    output_dir: str
    """``trainer.output_dir`` as the spec says it; ``relax run`` resolves it against the working
    folder and tells each worker the absolute folder."""
    checkpoint_every: int
    keep_checkpoints: int
    export_every: int = 0
    """``trainer.export_every`` (0 when null): a Hugging Face export every this many steps and at the end."""
    prompts_per_step: int
    samples_per_prompt: int
    max_staleness: int
    """The most staleness a sample may have: ``async_policy.max_staleness``, or ``auto.max`` with
    ``auto`` (the bound it chooses moves below it)."""
    dynamic_sampling: bool
    """DAPO's dynamic sampling (the rollout refills groups whose rewards are all equal)."""
    dynamic_sampling_rounds: int
    max_new_tokens: int
    data: DataSettings
    fault_tolerance: FaultToleranceSpec
    tracing: TracingSpec
    bus_node_resource: str | None = None
    """``cluster.bus_node_resource``: the node resource the bus's storage is placed by."""
    agent: AgentSpec | None = None
    """``roles.rollout.agent``: multi-turn agentic rollouts (the environment itself is among the
    rollout's plugins); None: one response per sample."""
    partial: bool = False
    """``roles.rollout.partial``: partial rollouts (``relax.runtime.worker.partial``)."""
    sampler: str = "plain"
    """How the rollout draws a unit's samples (``relax.runtime.worker.sampling``): ``plain``,
    ``agent`` (``roles.rollout.agent``) or ``partial`` (``roles.rollout.partial``); inside
    ``dynamic(...)`` with DAPO's dynamic sampling (``algorithm.dynamic_sampling``)."""
    auto_staleness: AutoStalenessSpec | None = None
    """``async_policy.max_staleness: auto``: how the bound is chosen (``max_staleness`` is then
    ``auto.max``, the cap); None: the bound is ``max_staleness``, fixed."""
    mismatch: MismatchSpec = Field(default_factory=MismatchSpec)
    """``async_policy.mismatch``: the alarm on the actor's ``mismatch/kl`` (relax.algo.mismatch)."""
    eval_every: int = 0
    """``trainer.eval_every`` (0 when null): with ``evaluation``, an evaluation every this many
    policy versions (and at 0 and the end); 0: only after the last step."""
    evaluation: EvalSpec | None = None
    """``trainer.eval`` when ``data.eval`` is set (who evaluates is in the workers' wiring:
    ``relax.runtime.worker.evaluation``); None: no evaluation."""
    log_samples_every: int = 0
    """``trainer.log_samples_every``: the steps whose rows the scorer picks samples from (every this
    many; 0: none)."""
    log_samples: int = 4
    """``trainer.log_samples``: rows kept of a sampled step."""

    def staleness_policy(self) -> StalenessPolicy:
        """The run's staleness policy (``relax.algo.staleness``): the one way the runtime reads
        ``max_staleness`` and ``auto_staleness``. A new object each call: ``auto`` keeps its state
        in the run-state actor, which owns the run's."""
        return staleness_policy(self.max_staleness, self.auto_staleness)


class RolloutWork(PlanPart):
    """How a step's prompts are cut into units of rollout work (leased to replicas)."""

    unit_prompts: int
    """Prompts per unit."""
    units_per_step: int
    replica_limit: int
    """The most rollout replicas the run may have (``max_replicas`` or ``replicas``)."""
    ragged: bool
    """Several units per step: token columns go on the bus unpadded (their layouts would differ)."""


class PlanHint(PlanPart):
    """A note on the plan that says what to change: ``relax plan`` shows it, and the overrides of
    ``fix`` act on it."""

    text: str
    """The note in words (also in ``Plan.notes``), ending with the fix as overrides when it has one."""
    fix: list[str] = Field(default_factory=list)
    """Command-line overrides (``key=value``) that act on the note and with which the spec still
    validates and plans; empty when no single change does."""


class UnusedGpus(PlanHint):
    """GPUs of the cluster that no role is placed on."""

    count: int
    """How many of ``cluster.nodes x cluster.gpus_per_node`` no role uses."""
    by_node: dict[str, list[int]]
    """The unused GPU indices, by node index (as text: JSON's keys)."""


class Plan(PlanPart):
    """Everything ``relax run`` needs to place a run, and ``relax plan`` shows."""

    run: str
    mode: Literal["colocate", "separate", "hybrid"]
    nodes: int
    gpus_per_node: int
    gpus_used: int
    model: str
    model_params: int | None
    """Total parameters when the architecture is known."""
    rollout_max_replicas: int | None = None
    """The most rollout replicas ``relax scale`` may run when the rollout is elastic
    (``roles.rollout.max_replicas`` above ``replicas``; each new one gets a bundle like the planned
    ones); null: the rollout keeps its planned replicas."""
    pools: list[Pool]
    instances: list[RoleInstance]
    bus: list[BusField]
    weight_sync: list[WeightSyncEdge]
    staleness: StalenessSchedule
    memory: list[DeviceMemory]
    workers: list[WorkerPlan] = Field(default_factory=list)
    """Every worker process ``relax run`` starts (before any elastic scaling), with the roles it
    hosts, their plugins and options, the bus columns each reads and writes, and its weight channels:
    the runtime builds its workers from these and nothing else."""
    rollout_replica: WorkerPlan | None = None
    """The worker an extra rollout replica gets when ``relax scale`` adds one to an elastic rollout
    (on a placement group of its own, like the planned ones' bundles); null: not elastic."""
    rollout_work: RolloutWork | None = None
    """How each step's rollout is cut into units of work."""
    settings: RunSettings | None = None
    """The run-wide settings (steps, checkpoints, batch shape, staleness, data keys, fault
    tolerance, tracing) the controller and the workers read."""
    notes: list[str] = Field(default_factory=list)
    """Assumptions and caveats of the estimate."""
    cores_note: PlanHint | None = None
    """Set when this machine's cores are too few for the placement mode (a CPU-only run outside
    colocate mode whose model processes get one torch thread each): the one note that changes what
    a user would run, so ``relax run`` prints it too (also in ``notes``), with the overrides that
    run it in colocate mode."""
    unused_gpus: UnusedGpus | None = None
    """Set when the cluster has GPUs no role is placed on: how many, where, and the overrides that
    use them (more rollout replicas, a larger actor) or, failing that, a cluster that has none to
    spare (also in ``notes``)."""

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def instances_of(self, role: str) -> list[RoleInstance]:
        return [i for i in self.instances if i.role == role]
