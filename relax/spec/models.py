"""The run spec as typed pydantic models.

Every field has a type, a default, its constraints and a docstring; the docstring becomes the help
text, the JSON Schema description and the generated spec reference (``docs/spec-reference.md``).
Only shape and single-field rules live here; rules that look at several sections, the model's
architecture or the installed plugins live in ``relax.spec.rules``.

The names of the sections and fields are the user-facing contract of ``SPEC.md``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from relax.contracts import LongPromptPolicy as _LongPromptPolicy
from relax.spec.attribute_docs import DocumentedModel
from relax.spec.lora import LoraSpec

Modality = Literal["text", "image", "audio", "video"]
DType = Literal["float32", "bfloat16", "float16"]
PlacementMode = Literal["colocate", "separate", "hybrid"]
Correction = Literal["none", "tis", "decoupled", "seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop", "opsm"]
MismatchAction = Literal["warn", "stop"]
TracingExporter = Literal["none", "console", "jsonl", "otlp"]
OtlpProtocol = Literal["http", "grpc"]
OptimizerName = Literal["adamw", "adam", "sgd"]
LRSchedule = Literal["constant", "linear", "cosine"]
BadSamplePolicy = Literal["error", "skip"]
LongPromptPolicy = _LongPromptPolicy
"""``data.on_long_prompt``: ``truncate`` or ``refuse`` (declared in ``relax.contracts``, which the
rollout backends read it from)."""
FailurePolicy = Literal["restart", "resume", "stop"]
WeightSync = Literal["auto", "object_store", "collective"]
ToolCallFormat = Literal["auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "glm", "harmony"]
TruncatedPolicy = Literal["score", "mask"]
HistoryPolicy = Literal["strict", "segments"]


def _none_is_empty(value: Any) -> Any:
    return {} if value is None else value


#: Plugin options are free-form here and validated by the plugin's own ``Config`` model. ``null``
#: means none (``{}``), so a file can clear the options its ``extends`` parent gave.
PluginOptions = Annotated[dict[str, Any], BeforeValidator(_none_is_empty)]


class Section(DocumentedModel):
    """Base of every spec section: unknown keys are errors and docstrings document fields (read
    when a schema asks for them: ``relax.spec.attribute_docs``)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSpec(Section):
    """The policy model and what it reads."""

    path: str = "builtin:tiny-lm"
    """A local Hugging Face folder, a hub-style id (``Qwen/Qwen3-4B``), or ``builtin:<name>`` for a
    model built locally by a ``relax.models`` plugin (no download)."""
    modalities: list[Modality] = Field(default_factory=lambda: ["text"], min_length=1)
    """The inputs the model reads: a subset of text, image, audio and video."""
    dtype: DType = "float32"
    """Parameter dtype for generation and training."""
    options: PluginOptions = Field(default_factory=dict)
    """Options of a built-in model (``builtin:<name>``), checked against its plugin's ``Config``
    (e.g. sizes, seed and warm-up of ``builtin:tiny-lm``)."""

    @field_validator("modalities")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("modalities are listed more than once; list each once")
        return value


class DataSource(Section):
    """A data set: a ``relax.datasets`` plugin name or a local file or folder (docs/config.md)."""

    source: str
    """A dataset plugin name (``synthetic:arithmetic``) or a path (``~`` expanded, relative to the
    spec's folder): a ``.jsonl``, ``.json``, ``.csv``, ``.parquet`` or ``.arrow`` file, or a folder
    written by ``Dataset.save_to_disk``."""
    options: PluginOptions = Field(default_factory=dict)
    """Options of the dataset plugin, checked against its ``Config``; null means none. A file in an
    ``extends`` chain that names another source drops its parent's options."""


class DataSpec(Section):
    """Where prompts and labels come from."""

    train: DataSource = Field(
        default_factory=lambda: DataSource(source="synthetic:arithmetic", options={"size": 4096})
    )
    """The training prompts."""
    eval: DataSource | None = None
    """Held-out prompts the policy is evaluated on during training (``trainer.eval_every``,
    ``trainer.eval``); same columns as ``train``."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    label_key: str = "answer"
    """Column holding the label the rewards compare against."""
    media_keys: dict[Modality, str] = Field(default_factory=dict)
    """Modality -> column holding that media, e.g. ``{image: images, audio: audios}``. A cell holds
    nothing (null), one item or a list of items; an item is a path (relative paths are taken from
    the data file's folder), the bytes of a file, or an inline array."""
    media_options: dict[Modality, PluginOptions] = Field(default_factory=dict)
    """Budgets of each modality, checked against its ``relax.modalities`` plugin's ``Config``, e.g.
    ``{image: {max_pixels: 262144}, audio: {sample_rate: 16000, max_seconds: 10}, video: {fps: 2,
    max_frames: 16}}`` (see docs/omni.md)."""
    on_bad_sample: BadSamplePolicy = "error"
    """A sample whose media is missing, undecodable or over budget: ``error`` stops the run with a
    message naming the sample and the column; ``skip`` replaces it by the next usable sample of the
    data set and counts it in the ``data/skipped_samples`` metric."""
    shuffle: bool = True
    """Shuffle prompts each epoch with the run's seed (the order is reproducible and resumable)."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Longest prompt in tokens; longer prompts are truncated from the left. Used for memory plans."""
    on_long_prompt: LongPromptPolicy = "truncate"
    """A prompt past ``max_prompt_tokens``: ``truncate`` cuts it from the left (its text first to
    ``max_prompt_tokens`` x 32 characters, so it is never tokenized whole); ``refuse`` stops with
    its file and line (data files: at validation for the rows it reads, when the data is read for
    the rest; a prompt within the characters but over the tokens, when it is tokenized)."""
    chat_template: str = "auto"
    """How a text prompt becomes token ids: ``auto`` renders it as one user message through the
    tokenizer's own chat template when it has one (with the generation prompt, as
    ``apply_chat_template(..., add_generation_prompt=True)``) and tokenizes it raw otherwise;
    ``none`` tokenizes it raw; any other value is a Jinja template file (``~`` expanded, relative to
    the spec's folder) used instead of the tokenizer's. The rollout renders it, and the trainer
    trains on exactly the ids the rollout generated from. Media prompts always go through the
    model processor's template; agents render their own conversations."""
    reward_key: str | None = None
    """Column naming, per sample, the reward(s) that score it (a reward's ``id`` or ``name``, or a
    list of them); samples without a value are scored by every reward. null: every reward scores
    every sample."""


class ClipSpec(Section):
    """PPO-style ratio clipping: the ratio is kept in [1 - low, 1 + high]."""

    low: float = Field(0.2, ge=0.0, le=1.0)
    """Lower clip range (ratio >= 1 - low)."""
    high: float = Field(0.28, ge=0.0)
    """Upper clip range (ratio <= 1 + high); higher than ``low`` is DAPO's clip-higher."""
    c: float | None = Field(None, gt=1.0)
    """Dual-clip constant (ppo_clip): a token with a negative advantage loses at most ``c`` times
    its advantage, however far its ratio grows; null turns the dual clip off (3 is common)."""


LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["loss", "reward"]
RouterReplay = Literal["off", "r2", "r3"]


class DynamicSamplingSpec(Section):
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts."""

    enabled: bool | None = None
    """Drop every group whose rewards are all equal (no learning signal) and sample more prompts
    until a step has ``prompts_per_step`` groups; null: on for dapo, off for the other names."""
    max_rounds: int = Field(3, ge=1)
    """Most sampling rounds per step; after them the step trains on the groups kept so far."""


class AlgorithmSpec(Section):
    """The RL algorithm: an advantage estimator and a policy loss, named together.

    Fields left unset take the algorithm name's defaults (``relax.spec.algorithms``); a field set in
    the spec always wins. See docs/algorithms.md for each algorithm's objective."""

    name: str = "grpo"
    """Algorithm name: grpo, dr_grpo, rloo, ppo, reinforce_pp, reinforce_pp_baseline, gspo, cispo,
    sapo, dapo; it picks the advantage estimator, the loss and the defaults of the fields below
    unless they are set."""
    samples_per_prompt: int = Field(8, ge=1)
    """Responses sampled per prompt (the group size of group-based advantages)."""
    prompts_per_step: int = Field(16, ge=1, le=100_000)
    """Prompts per training step; a step trains on prompts_per_step x samples_per_prompt samples
    (at most 100000: the run plans every prompt of a step up front)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference policy; > 0 needs ``roles.reference``."""
    kl_in: KLPlacement | None = None
    """Where the KL penalty goes: ``loss`` (a term of the policy loss) or ``reward`` (a per-token
    penalty inside a token-level estimator: reinforce_pp, reinforce_pp_baseline, gae); null:
    reward for ppo, reinforce_pp and reinforce_pp_baseline, loss for the others."""
    kl_estimator: KLEstimator | None = None
    """KL estimator: k1 (log-ratio), k2 (half squared log-ratio) or k3 (``r - 1 - log r``); null:
    k3 in the loss, k1 in the reward."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus subtracted from the policy loss (0 turns it off)."""
    loss_aggregation: LossAggregation | None = None
    """How per-token losses become one: token-mean, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (a constant ``max_new_tokens`` denominator); null: the algorithm's
    (seq-mean-token-sum-norm for dr_grpo, seq-mean-token-mean for gspo, token-mean otherwise)."""
    clip: ClipSpec = Field(default_factory=ClipSpec)
    """Ratio clipping of the policy loss (default low 0.2, high 0.28; gspo's 3e-4, 4e-4)."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip range of the critic's value loss around the values the advantages used; null: none."""
    dynamic_sampling: DynamicSamplingSpec = Field(default_factory=DynamicSamplingSpec)
    """DAPO's filter of groups without learning signal."""
    advantage: str | None = None
    """A ``relax.advantages`` plugin overriding the one the algorithm name implies."""
    advantage_options: PluginOptions = Field(default_factory=dict)
    """Options of the advantage estimator, checked against its ``Config``."""
    loss: str | None = None
    """A ``relax.losses`` plugin overriding the one the algorithm name implies."""
    loss_options: PluginOptions = Field(default_factory=dict)
    """Options of the policy loss, checked against its ``Config``."""
    updates_per_step: int = Field(1, ge=1)
    """Optimizer steps per training step (the batch is split into this many mini-batches)."""
    router_replay: RouterReplay = "off"
    """Routing replay for mixture-of-experts models (docs/off-policy.md): ``r3`` records the
    experts the rollout's router chose for each response token and makes the actor's forward
    passes use them (gate weights from the current router), so the trainer scores the sampled
    tokens under the routing that generated them; ``r2`` makes each update of a step use the
    actor's own routing from the step's first forward pass (matters with updates_per_step > 1);
    ``off`` lets the router choose. Needs an MoE model and backends that can record and replay."""

    @field_validator("router_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare ``off`` as false: ``router_replay: off`` means "off".
        return "off" if value is False else value

    @model_validator(mode="after")
    def _name_defaults(self) -> AlgorithmSpec:
        # Unset fields take the algorithm name's defaults; an unknown name is reported by the rules.
        from relax.spec.algorithms import ALGORITHMS

        recipe = ALGORITHMS.get(self.name)
        if self.loss_aggregation is None:
            self.loss_aggregation = recipe.loss_aggregation if recipe else "token-mean"
        if self.kl_in is None:
            self.kl_in = recipe.kl_in if recipe else "loss"
        if self.kl_estimator is None:
            self.kl_estimator = "k1" if self.kl_in == "reward" else "k3"
        if self.dynamic_sampling.enabled is None:
            self.dynamic_sampling.enabled = bool(recipe and recipe.dynamic_sampling)
        if "clip" not in self.model_fields_set and recipe is not None and recipe.clip is not None:
            self.clip = ClipSpec(low=recipe.clip[0], high=recipe.clip[1])
        return self


RewardErrorPolicy = Literal["fail", "zero"]


class RewardSpec(Section):
    """One reward plugin; the rewards of all listed plugins are summed with their weights."""

    name: str
    """A ``relax.rewards`` plugin name."""
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)
    """A name for this entry, unique among the rewards (default: the plugin name): what
    ``data.reward_key`` values and the per-reward metrics (``reward/<id>/mean``) use. Needed when
    one plugin is listed twice."""
    weight: float = 1.0
    """Multiplier of this reward in the sum."""
    options: PluginOptions = Field(default_factory=dict)
    """Options of the reward plugin, checked against its ``Config``."""
    timeout_s: float | None = Field(300.0, gt=0.0)
    """Longest wait for this reward to score one batch; past it the batch is an error (see
    ``on_error``). null waits without limit."""
    on_error: RewardErrorPolicy = "fail"
    """What a failing sample (an exception, a non-finite score, a timeout) does: ``fail`` stops the
    run with an error naming the reward and the sample; ``zero`` scores it 0 and counts it in
    ``reward/<id>/errors``."""
    max_error_frac: float = Field(0.5, ge=0.0, le=1.0)
    """Under ``on_error: zero``, the largest share of a batch this reward may fail on: past it the
    run stops with an error naming the reward and the share, since a reward that fails on most
    samples trains on zeros, not on the task. 1.0 never stops."""
    always: bool = False
    """Score every sample, even those that ``data.reward_key`` routes to other rewards (e.g. a
    length penalty next to per-source correctness rewards)."""

    @property
    def key(self) -> str:
        """How routing and metrics name this entry: its ``id``, else its plugin name."""
        return self.id or self.name


class LoggerSpec(Section):
    """One experiment tracker (a ``relax.loggers`` plugin) that receives every metrics row."""

    name: str
    """A ``relax.loggers`` plugin name: ``tensorboard``, ``wandb`` and ``mlflow`` are built in."""
    options: PluginOptions = Field(default_factory=dict)
    """Options of the logger plugin, checked against its ``Config``."""


class ParallelSpec(Section):
    """Model parallelism of a role; data parallel is derived (GPUs / (tp x pp x cp))."""

    tp: int = Field(1, ge=1)
    """Tensor parallel size; must divide the attention heads."""
    pp: int = Field(1, ge=1)
    """Pipeline parallel size; must divide the layers."""
    cp: int = Field(1, ge=1)
    """Context (sequence) parallel size."""
    ep: int = Field(1, ge=1)
    """Expert parallel size (MoE models); must divide the number of experts."""

    @property
    def model_parallel(self) -> int:
        """GPUs holding one copy of the model: tp x pp x cp."""
        return self.tp * self.pp * self.cp


class SamplingSpec(Section):
    """How the rollout samples responses."""

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = Field(8, ge=1)
    """Longest response in tokens."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: a response ends right after the token that completes the first of them. Its
    tokens stay in the response and are trained on like the model's own stop token; the response
    text (what rewards read) ends before it, as it ends before the stop token."""
    repetition_penalty: float = Field(1.0, gt=0.0)
    """CTRL's repetition penalty on the tokens of the prompt and the response so far (a positive
    logit divided by it, a negative one multiplied); 1 turns it off."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("an empty stop string would end every response at once; remove it")
        return value


class OptimizerSpec(Section):
    """The optimizer of a trained role."""

    name: OptimizerName = "adamw"
    """Optimizer: adamw, adam or sgd."""
    lr: float = Field(3.0e-4, gt=0.0)
    """Learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (adamw) or L2 (adam, sgd)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1.0e-8, gt=0.0)
    """Adam epsilon."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    lr_schedule: LRSchedule = "constant"
    """How the learning rate moves over the run's steps after the warmup: constant, linear (decay to
    ``min_lr_ratio * lr`` at the last step) or cosine (the same, along a half cosine)."""
    warmup_steps: int = Field(0, ge=0)
    """Training steps of linear warmup: step s < warmup_steps trains at ``lr * (s + 1) / (warmup_steps
    + 1)``, step warmup_steps at ``lr``; 0: no warmup."""
    warmup_ratio: float | None = Field(None, ge=0.0, le=1.0)
    """Warmup as a share of the run's steps (``ceil(warmup_ratio * steps)`` steps), instead of
    ``warmup_steps``; null: ``warmup_steps`` says."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """The floor of linear and cosine decay, as a share of ``lr``: the last step trains at
    ``min_lr_ratio * lr``."""

    @model_validator(mode="after")
    def _one_warmup(self) -> OptimizerSpec:
        if self.warmup_ratio is not None and self.warmup_steps > 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio} are both "
                             "set; give one: remove warmup_ratio to warm up a fixed number of steps, or "
                             "warmup_steps to warm up a share of the run")
        return self


class GatewaySpec(Section):
    """The OpenAI-compatible endpoint an agent program drives the policy through (docs/agents.md)."""

    program: str
    """The agent program, as ``package.module:function``: called once per trajectory with the task
    (``relax.contracts.AgentTask``), the endpoint's base URL and the trajectory's API key; it talks to
    the policy with any OpenAI client and returns its reward (a float) or None (the reward plugins
    score the trajectory)."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on; loopback by default (set 0.0.0.0 only inside a trusted network)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 picks a free one."""
    processes: int = Field(0, ge=0, le=256)
    """Worker processes the program runs in (``relax.agents.program_processes``): each has its own
    interpreter, so programs that spend CPU a call (an agent framework, the ``openai`` client) do not
    take turns with the gateway and the model. 0: in the rollout worker's own process (a thread
    each for a plain program, one event loop for ``async def`` ones)."""

    @field_validator("program")
    @classmethod
    def _import_path(cls, value: str) -> str:
        import re

        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError(f"{value!r} is not an import path; write it as package.module:function")
        return value


class AgentSpec(Section):
    """Multi-turn, tool-using rollouts: an environment (or an agent program through the gateway)
    answers every model turn until the trajectory ends (docs/agents.md)."""

    environment: str | None = None
    """A ``relax.environments`` plugin (``calculator``, or any registered one)."""
    environment_options: PluginOptions = Field(default_factory=dict)
    """Options of the environment, checked against its ``Config``."""
    gateway: GatewaySpec | None = None
    """Serve ``/v1/chat/completions`` to an agent program instead of driving an environment."""
    max_turns: int = Field(4, ge=1)
    """Model turns per trajectory at most; the trajectory is truncated after the last one."""
    max_tokens: int = Field(512, ge=1)
    """Tokens after the prompt per trajectory at most (model, observation and chat-template tokens
    together); a trajectory that reaches it is truncated."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Tokens per model turn at most; null: ``roles.rollout.sampling.max_new_tokens``."""
    tool_timeout_s: float = Field(30.0, gt=0.0)
    """Seconds one environment call (start, or a step with its tool calls) may take; past it the
    trajectory ends with an error (it is kept with a zero loss mask)."""
    tool_call_format: ToolCallFormat = "hermes"
    """How tool calls are written in a model turn: ``hermes`` (Hermes, Qwen2.5/Qwen3:
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), ``qwen3_coder`` (Qwen3-Coder XML),
    ``llama3_json`` (Llama 3.x), ``mistral``, ``deepseek_v3``, ``glm`` (GLM-4.5), ``harmony``
    (gpt-oss); ``auto`` reads it from the model's chat template (docs/agents.md, "Tool-call formats")."""
    max_failed_frac: float | None = Field(0.5, ge=0.0, le=1.0)
    """Stop the run (exit 1, the failures' cause and first message on the last line) when more than
    this share of a step's trajectories fail: end by ``env_error``, ``env_timeout``, ``program_error``
    or ``infra`` (checked per rollout unit; a step has one unless the rollout is elastic); null: never
    stop for them (they are kept out of training either way). Formerly ``max_infra_fraction``."""
    regenerate_failed: int = Field(0, ge=0, le=8)
    """Environments: a trajectory that fails (``env_error``, ``env_timeout``, ``infra``) is run again
    from its start, in its own unit (the same policy version: within the staleness bound), up to this
    many times; the last try is the sample, and ``agent/regenerated`` counts the tries. 0: never.
    ``max_failed_frac`` counts the trajectories still failed after their tries. Agent programs behind
    the gateway are not regenerated."""
    concurrency: int = Field(32, ge=1)
    """Environment calls running at once per rollout replica."""
    truncated: TruncatedPolicy = "score"
    """A truncated trajectory (turn or token budget spent): ``score`` scores and trains on it as it
    is; ``mask`` keeps it in the batch with a zero loss mask (it teaches nothing)."""
    turn_reward_weight: float = 1.0
    """Weight of the environment's turn rewards, added to the reward plugins' score."""
    history: HistoryPolicy = "segments"
    """Gateway: a call that does not extend the conversation (an edited, trimmed or summarized
    history): ``segments`` continues the trajectory as a new segment (its prompt the newly rendered
    history, linked to its parent; the sample is one row per segment, each training its own model
    tokens with the trajectory's reward and advantage), ``strict`` refuses the call with 400
    ``history_edited``."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_infra_fraction" in data:
            raise ValueError("max_infra_fraction was renamed max_failed_frac (the same share: trajectories ended by "
                             "env_error, env_timeout, program_error or infra); write max_failed_frac instead. Its "
                             "default is now 0.5 (was null: never stop); null keeps the old default")
        return data

    @model_validator(mode="after")
    def _one_driver(self) -> AgentSpec:
        if (self.environment is None) == (self.gateway is None):
            raise ValueError("give exactly one of environment (a relax.environments plugin) and gateway "
                             "(an agent program behind the OpenAI endpoint)")
        return self


class RolloutRole(Section):
    """The rollout role: generates responses with behaviour log-probs."""

    backend: str = "hf"
    """A ``relax.rollout`` plugin: hf, vllm, or any registered one."""
    replicas: int = Field(1, ge=1)
    """Independent rollout engines (each gets ``gpus_per_replica`` GPUs)."""
    gpus_per_replica: int = Field(0, ge=0)
    """GPUs per engine (tp x pp of the engine); 0 runs on CPU."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Parallelism inside one engine."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling parameters."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Share of each GPU the engine may use for weights plus KV cache."""
    options: PluginOptions = Field(default_factory=dict)
    """Options of the rollout backend, checked against its ``Config``."""
    max_replicas: int | None = Field(None, ge=1)
    """Elastic rollout (separate mode): ``relax scale RUN_DIR rollout=N`` may run up to this many
    replicas mid-run (each new one gets a bundle like the planned ones). null: fixed at ``replicas``."""
    unit_prompts: int | None = Field(None, ge=1)
    """Prompts per unit of rollout work: a unit is leased to one replica and generated again whole
    if that replica fails. null: the whole step when one replica runs and the run is not elastic,
    else ``prompts_per_step / max(replicas, max_replicas)`` rounded up."""
    weight_sync: WeightSync = "auto"
    """How new policy weights reach the rollout outside colocate mode: ``object_store`` puts the
    whole state_dict in Ray's object store; ``collective`` has the actor's rank 0 broadcast it to the
    engine's workers (NCCL on GPUs, gloo on CPU), pulled by each replica when it needs a newer
    version. auto: collective where the rollout backend can receive collectively and the actor and
    the rollout are on GPUs, object_store otherwise."""
    agent: AgentSpec | None = None
    """Multi-turn agentic rollouts with an environment or an agent program (docs/agents.md); null:
    one response per sample."""
    partial: bool = False
    """Partial rollouts (separate or hybrid mode, docs/off-policy.md): when a newer policy is
    published, generation pauses at a token boundary, the weights are swapped and every unfinished
    sample continues under the new policy; the next step's samples are started beside the long
    tail of this one once the staleness bound admits them. Each token keeps the version that chose
    it and a sample's staleness counts from its oldest token; nothing is dropped."""

    @property
    def gpus(self) -> int:
        """GPUs of all replicas together."""
        return self.replicas * self.gpus_per_replica

    @property
    def replica_limit(self) -> int:
        """The most replicas this run may have at once."""
        return max(self.replicas, self.max_replicas or self.replicas)


class ForwardRole(Section):
    """A role that only computes log-probs (reference, actor_fwd)."""

    backend: str = "torch"
    """A ``relax.trainer`` plugin: it trains the actor and the critic, and only computes log-probs
    (forward passes) for the reference and actor_fwd."""
    gpus: int = Field(0, ge=0)
    """GPUs of this role (in its own pool in separate mode, shared with the actor otherwise)."""
    cpu_ranks: int = Field(1, ge=1)
    """Processes of this role when it runs on CPU (``gpus: 0``): data-parallel ranks over gloo, each
    a process of its own (FSDP2 shards the model over them). For small models and for trying a
    multi-rank layout on a laptop; on GPUs every GPU is a rank, so leave it 1 there."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Model parallelism."""

    @property
    def ranks(self) -> int:
        """Processes of the role: one per GPU, or ``cpu_ranks`` on CPU."""
        return self.gpus or self.cpu_ranks
    micro_batch_size: int = Field(16, ge=1)
    """Samples per forward pass."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of a micro-batch: rows are grouped by their real tokens (prompt and response)
    into micro-batches of at most this many (a longer row alone), balanced in tokens, instead of
    ``micro_batch_size`` rows each, which it then replaces. Bounds activation memory however long the
    step's rows are. Null: ``micro_batch_size`` rows. Needs a backend with the ``token_budget``
    trait (torch)."""
    options: PluginOptions = Field(default_factory=dict)
    """Options of the backend, checked against its ``Config``."""


class TrainRole(ForwardRole):
    """A trained role (actor, critic)."""

    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """The optimizer."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about 30% more compute)."""
    lora: LoraSpec | None = None
    """Train a LoRA adapter on the frozen model instead of the whole model (docs/lora.md); null
    trains every weight."""


class CpuRole(Section):
    """A CPU role (reward, advantage)."""

    replicas: int = Field(1, ge=1)
    """Worker actors of this role."""
    cpus: float = Field(1.0, gt=0.0)
    """Logical CPUs per worker."""


RewardHost = Literal["rollout", "own"]


class RewardRole(CpuRole):
    """The reward role: scoring responses with the reward plugins."""

    gpus_per_replica: int = Field(0, ge=0)
    """GPUs of each reward worker (``host: own`` only): for a model-based reward such as a
    ``genrm`` judge, whose backend then runs on them; 0 runs the workers on CPU."""
    host: RewardHost = "rollout"
    """Where scoring runs: ``rollout`` scores each batch inside the rollout worker that generated it
    (no bus round trip: right for cheap rule-based rewards; one scorer per rollout replica, and the
    advantage estimator runs there too outside hybrid mode), ``own`` runs ``replicas`` reward workers
    of their own that read responses from the bus (for slow or model-based rewards)."""


class RolesSpec(Section):
    """Every role of the run; a role set to null does not run."""

    rollout: RolloutRole = Field(default_factory=RolloutRole)
    """Generation."""
    actor: TrainRole = Field(default_factory=TrainRole)
    """The policy update."""
    reference: ForwardRole | None = None
    """Frozen reference policy log-probs; needed when ``algorithm.kl_coef > 0``."""
    critic: TrainRole | None = None
    """Value model; needed by ppo."""
    actor_fwd: ForwardRole | None = None
    """Proximal log-probs of the latest policy; needed by ``async_policy.correction: decoupled``."""
    reward: RewardRole = Field(default_factory=RewardRole)
    """Reward scoring."""
    advantage: CpuRole = Field(default_factory=CpuRole)
    """Advantage computation."""


class ClusterSpec(Section):
    """Where the run executes."""

    address: str | None = None
    """null starts an embedded local Ray; ``auto`` or ``ray://host:port`` joins a cluster."""
    nodes: int = Field(1, ge=1)
    """Nodes in the cluster."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs on each node."""
    cpus_per_node: int = Field(2, ge=1)
    """CPU cores on each node."""
    gpu_memory_gb: float = Field(80.0, gt=0.0)
    """Memory of one GPU in GiB; plans whose estimate exceeds it are rejected."""
    bus_node_resource: str | None = None
    """A Ray custom resource that marks the nodes allowed to hold the bus's storage (start them with
    ``--resources '{"<name>": 1}'``): keep the run's data off nodes that may go away. null: the
    first alive node."""

    @property
    def gpus(self) -> int:
        """GPUs of the whole cluster."""
        return self.nodes * self.gpus_per_node


class PlacementSpec(Section):
    """How roles share GPUs."""

    mode: PlacementMode = "separate"
    """colocate: rollout and actor time-share one pool (on-policy); separate: a pool per role,
    streaming with bounded staleness; hybrid: rollout alone, reference/actor_fwd/advantage in the
    actor's pool."""


class MismatchSpec(Section):
    """The rollout-trainer mismatch figures (``mismatch/*`` in metrics.jsonl) and their alarm."""

    ratio_bound: float = Field(2.0, gt=1.0)
    """A token counts in mismatch/frac_over when its trainer / rollout probability ratio is outside
    [1/ratio_bound, ratio_bound] (2: the TIS cap of Yao et al. 2025)."""
    kl_alarm: float | None = Field(0.05, gt=0.0)
    """mismatch/kl above this raises the alarm (a console line, a mismatch_alarm attribute on the
    train_step span, and with action stop the end of the run); null: no alarm. Healthy engines on
    the same weights stay around 1e-3 or below."""
    action: MismatchAction = "warn"
    """What the alarm does: warn (console line and trace) or stop (also ends the run with an error
    naming the step and the value)."""


class AutoStalenessSpec(Section):
    """``max_staleness: auto``: the bound the run sets itself, step by step (docs/off-policy.md)."""

    start: int = Field(1, ge=0)
    """The bound of the first steps."""
    max: int = Field(4, ge=1)
    """The widest bound it may choose: what the actor's check, the plan and the losses' tolerated
    staleness see."""
    kl_budget: float = Field(0.05, gt=0.0)
    """Off-policy budget: offpolicy/kl (the k3 estimate of KL(behaviour || trainer) over every token
    of a step, staleness and mismatch together, smoothed over steps) above this narrows the bound;
    the bound widens only while it stays below half of it. 0.05 is a typical |log ratio| of about
    0.3, well inside the [1/2, 2] band the corrections clip to."""
    wait_frac: float = Field(0.1, gt=0.0, lt=1.0)
    """The rollout is the bottleneck when the actor waited for rows more than this share of the
    step (time/data_wait_s / time/step_s); only then does a wider bound buy speed."""
    hold_steps: int = Field(2, ge=1)
    """Steps to keep a new bound before the next change (its effect shows only after the rollout
    ran ahead under it)."""

    @model_validator(mode="after")
    def _start_within_max(self) -> AutoStalenessSpec:
        if self.start > self.max:
            raise ValueError(f"start ({self.start}) must not exceed max ({self.max})")
        return self


class AsyncPolicySpec(Section):
    """The staleness bound between generation and training, and the off-policy correction."""

    max_staleness: int | Literal["auto"] = 1
    """A sample made by policy version v is trained at step t only if t - v <= max_staleness;
    0 is strictly on-policy. auto: the run chooses the bound each step between 0 and auto.max,
    widening it while the rollout is the bottleneck and offpolicy/kl stays within auto.kl_budget,
    narrowing it when it does not (separate and hybrid modes; never by dropping samples)."""
    auto: AutoStalenessSpec = Field(default_factory=AutoStalenessSpec)
    """How max_staleness: auto chooses its bound (read only with auto)."""
    correction: Correction = "tis"
    """Off-policy correction (docs/off-policy.md), each a per-token weight on the loss from the
    ratio rho = proximal / behaviour: none; tis (min(rho, tis_cap)); decoupled (the ratio against
    proximal log-probs recomputed by actor_fwd, times the tis weight); seq_tis (the sequence ratio,
    capped at tis_cap); token_mis / seq_mis (masked IS: tokens / sequences whose ratio is outside
    [mis_low, mis_high] are dropped); geo_reject (sequences whose geometric-mean ratio is outside
    [geo_low, geo_high] are dropped); icepop (tokens outside [icepop_low, icepop_high] dropped);
    opsm (negative-advantage sequences that drifted more than opsm_delta are dropped). All but none,
    tis and opsm need roles.actor_fwd."""
    tis_cap: float = Field(2.0, gt=0.0)
    """Upper truncation of the importance weight in tis, decoupled and seq_tis (2: Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training")."""
    mis_low: float = Field(0.5, ge=0.0)
    """Lower bound of the ratio kept by token_mis and seq_mis (0.5 = 1 / mis_high; 0 keeps every
    ratio below mis_high, the one-sided form)."""
    mis_high: float = Field(2.0, gt=0.0)
    """Upper bound of the ratio kept by token_mis and seq_mis (2: the threshold C of Liu et al.
    2025, "When speed kills stability")."""
    geo_low: float = Field(0.999, ge=0.0)
    """Lower bound of the geometric-mean sequence ratio kept by geo_reject (a per-token average, so
    the band is far narrower than a token band)."""
    geo_high: float = Field(1.001, gt=0.0)
    """Upper bound of the geometric-mean sequence ratio kept by geo_reject."""
    icepop_low: float = Field(0.5, ge=0.0)
    """Lower bound of the token ratio kept by icepop (0.5: IcePop, Ring-1T 2025)."""
    icepop_high: float = Field(5.0, gt=0.0)
    """Upper bound of the token ratio kept by icepop (5: IcePop, Ring-1T 2025)."""
    opsm_delta: float = Field(0.05, gt=0.0)
    """opsm drops a negative-advantage sequence when its mean log(behaviour / current policy)
    exceeds this. DeepSeek-V3.2 publishes no value; 0.05 sits well above the on-policy round-off
    (mismatch/kl ~1e-3) so it drops only truly drifted samples."""
    mismatch: MismatchSpec = Field(default_factory=MismatchSpec)
    """The mismatch/* metrics and their alarm."""

    @field_validator("max_staleness")
    @classmethod
    def _non_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"must be 0 or more, or auto (got {value})")
        return value

    @property
    def staleness_cap(self) -> int:
        """The most staleness a sample may have: max_staleness, or auto.max with auto."""
        return self.auto.max if self.max_staleness == "auto" else self.max_staleness

    @model_validator(mode="after")
    def _bands(self) -> AsyncPolicySpec:
        for name in ("mis", "geo", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if low >= high:
                raise ValueError(f"{name}_low ({low}) must be below {name}_high ({high}); the band of "
                                 "ratios kept is [low, high]")
        return self


class EvalSpec(Section):
    """How the held-out prompts (``data.eval``) are sampled and scored (``trainer.eval_every``)."""

    samples_per_prompt: int = Field(4, ge=1)
    """Responses per held-out prompt: ``eval/pass@k`` is reported for k = 1, 2, 4, ... up to this."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate the first this many prompts of ``data.eval`` (in file order); null: all of them."""
    temperature: float | None = Field(None, ge=0.0)
    """Sampling temperature of the evaluation; null: the rollout's ``sampling.temperature``. 0 is
    greedy (then one sample per prompt says all)."""
    pass_threshold: float = 1.0
    """A response passes when its reward (the weighted sum of ``rewards``) is at least this."""
    host: Literal["auto", "own", "rollout"] = "auto"
    """Where the evaluation generates. ``own``: an evaluation worker of its own (a copy of the
    rollout engine on ``roles.rollout.gpus_per_replica`` free GPUs, or a CPU worker that takes only
    the CPU time training leaves idle) loads each evaluated version from the object store, so
    training never waits for it. ``rollout``: the rollout evaluates right after producing a step,
    which delays its next step by the evaluation's length. ``auto``: ``own`` outside colocate mode
    when the cluster has the GPUs for it (always on CPU), else ``rollout``; ``relax plan`` shows
    which."""


class TrainerSpec(Section):
    """The training loop."""

    steps: int | None = Field(100, ge=1)
    """Training steps (optimizer updates of the policy version). Leave it out (or null, when a
    preset gives it) to train for ``epochs`` instead."""
    epochs: float | None = Field(None, gt=0.0)
    """Passes over the training data instead of ``steps``: the run then takes
    ``ceil(epochs * training-set size / algorithm.prompts_per_step)`` steps (``relax plan`` shows
    them); null: ``steps`` says."""
    output_dir: str = "runs/${name}"
    """Folder for metrics, checkpoints and traces."""
    checkpoint_every: int = Field(25, ge=0)
    """Write a checkpoint every this many steps; 0 writes only the final one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk (the oldest are deleted)."""
    export_every: int | None = Field(None, ge=0)
    """Write a Hugging Face export (``<output_dir>/export/step-<n>/``: ``save_pretrained`` layout
    with the tokenizer or processor, no optimizer state) every this many steps and after the last
    step. null or 0: no export (checkpoints still load with ``AutoModelForCausalLM`` from
    ``checkpoints/step-<n>/trainer``)."""
    eval_every: int | None = Field(None, ge=0)
    """Evaluate the policy on ``data.eval`` before training, every this many steps and after the
    last step (``eval/*`` metrics). Each evaluation generates with one policy version, named by
    ``eval/version``: the first the rollout holds at or after each multiple. In separate mode it runs
    on the rollout while the actor trains. null or 0 with ``data.eval`` set: after the last step only."""
    eval: EvalSpec = Field(default_factory=EvalSpec)
    """How the evaluation samples and what counts as a pass."""
    log_samples_every: int = Field(10, ge=0)
    """Every this many steps, write a few of the step's rows (prompt, response, label, rewards) to
    ``<output_dir>/samples.jsonl``, the ``logging:`` trackers and the console, so you see what the
    model generates, not only its figures. 0: no samples."""
    log_samples: int = Field(4, ge=1)
    """How many rows of a sampled step are kept (the first, the best, the worst and the middle ones
    by reward): a few, so samples stay small and off the hot path."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainerSpec:
        # ``steps`` has a default: only a value the spec gives conflicts with ``epochs``.
        if self.epochs is not None:
            if self.steps is not None and "steps" in self.model_fields_set:
                raise ValueError(f"trainer.steps={self.steps} and trainer.epochs={self.epochs:g} are both given; "
                                 "give one: remove trainer.steps (set it to null when a preset gives it) to "
                                 "train for epochs, or remove trainer.epochs")
            self.steps = None  # resolved from the data set's size (relax.spec.run_length)
        elif self.steps is None:
            raise ValueError("trainer.steps is null and trainer.epochs is not given; give trainer.steps (the "
                             "training steps) or trainer.epochs (passes over the training data)")
        return self


class RoleFaultPolicy(Section):
    """What a failure of one role does."""

    on_failure: FailurePolicy = "restart"
    """restart: start the role again in place, on its planned bundle (stateless roles only);
    resume: restart the whole run from its last checkpoint; stop: end the run with a report."""
    max_restarts: int = Field(3, ge=0)
    """Failures of this role that are recovered; the next one stops the run with a report."""


def _stateful(max_restarts: int = 2) -> RoleFaultPolicy:
    return RoleFaultPolicy(on_failure="resume", max_restarts=max_restarts)


class FaultRoles(Section):
    """The recovery policy of each role. A worker process that hosts several roles (colocate's
    rollout and actor) follows the strictest of them: stop, then resume, then restart."""

    rollout: RoleFaultPolicy = Field(default_factory=RoleFaultPolicy)
    """A rollout replica: restarted in place, it loads the current weights before generating; its
    unacknowledged units are generated again."""
    reward: RoleFaultPolicy = Field(default_factory=RoleFaultPolicy)
    """The reward role: restarted in place, it scores again the step it had not reported."""
    advantage: RoleFaultPolicy = Field(default_factory=RoleFaultPolicy)
    """The advantage role: restarted in place, like the reward role."""
    reference: RoleFaultPolicy = Field(default_factory=RoleFaultPolicy)
    """The frozen reference model: restarted in place (its weights never change)."""
    actor_fwd: RoleFaultPolicy = Field(default_factory=RoleFaultPolicy)
    """The proximal-policy forward role: restarted in place, it loads the current weights first."""
    actor: RoleFaultPolicy = Field(default_factory=_stateful)
    """The trainer holds the policy and optimizer state: a failure resumes the run from its last
    checkpoint."""
    critic: RoleFaultPolicy = Field(default_factory=_stateful)
    """The critic holds its value head and optimizer state, like the actor."""
    controller: RoleFaultPolicy = Field(default_factory=_stateful)
    """The run's control-plane service (versions, data-ready signals, the rollout work ledger)."""


class FaultToleranceSpec(Section):
    """How failures are detected and recovered. Every wait in the runtime is bounded."""

    heartbeat_s: float = Field(1.0, gt=0.0)
    """How often each role worker reports that it is alive and what it is doing."""
    heartbeat_timeout_s: float = Field(30.0, gt=0.0)
    """A worker silent this long (frozen, or its node lost) is declared hung and handled as failed."""
    progress_timeout_s: float = Field(1800.0, gt=0.0)
    """One piece of work (a rollout unit, a scoring batch, a train step) may last this long; past it
    the worker is declared hung. Waiting on another role does not count."""
    wait_timeout_s: float = Field(300.0, gt=0.0)
    """The longest any wait on another role may last (bus reads, weight sync, data-ready signals)
    before the run stops with an error naming what it waited for."""
    restart_timeout_s: float = Field(120.0, gt=0.0)
    """How long a restarted worker may take to be placed and ready before the run gives up on it."""
    roles: FaultRoles = Field(default_factory=FaultRoles)
    """Per role: restart in place, resume the run from its checkpoint, or stop."""


class TracingSpec(Section):
    """OpenTelemetry tracing of the run."""

    exporter: TracingExporter = "jsonl"
    """none, console, jsonl (a local file) or otlp (a collector)."""
    endpoint: str | None = None
    """The OTLP endpoint, or the jsonl file (default ``<output_dir>/traces.jsonl``)."""
    protocol: OtlpProtocol = "http"
    """OTLP transport: http or grpc."""
    service_name: str | None = None
    """Service name of the spans (default: the run name)."""
    sampling_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Share of traces recorded."""
    resource_attributes: dict[str, str] = Field(default_factory=dict)
    """Extra resource attributes on every span."""


class RunSpec(Section):
    """A complete Relax run."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128)
    """Run name: output folders and the trace service name. Letters, digits, '.', '_' and '-'."""
    extends: str | None = None
    """A preset name or a path merged under this file (resolved by the loader)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of every random choice (data order, sampling, initialisation); below 2**32, the largest
    seed numpy takes (vLLM seeds numpy with it)."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The policy model."""
    data: DataSpec = Field(default_factory=DataSpec)
    """Prompts and labels."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """The RL algorithm."""
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="exact_match")], min_length=1
    )
    """Reward plugins, summed with weights."""
    roles: RolesSpec = Field(default_factory=RolesSpec)
    """The roles and their resources."""
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    """The cluster."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """How roles share GPUs."""
    async_policy: AsyncPolicySpec = Field(default_factory=AsyncPolicySpec)
    """The staleness bound."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """The training loop."""
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    """Tracing."""
    logging: list[LoggerSpec] = Field(default_factory=list)
    """Experiment trackers (``relax.loggers`` plugins): each gets every metrics row the run writes
    to ``metrics.jsonl``. Empty: ``metrics.jsonl`` only."""
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    """Failure detection and recovery."""

    @model_validator(mode="after")
    def _default_output_dir(self) -> RunSpec:
        # The default names the run; a spec file's own ${name} is resolved by the loader.
        self.trainer.output_dir = self.trainer.output_dir.replace("${name}", self.name)
        return self

    def rollout_units(self) -> tuple[int, int]:
        """How a step's prompts are cut into units of rollout work: (prompts per unit, units per
        step). A unit is leased to one rollout replica and generated again whole if that replica
        fails. Unless ``roles.rollout.unit_prompts`` sets it, a unit is the whole step when the run
        has one replica and is not elastic, else ``prompts_per_step / replica_limit`` rounded up
        (one unit per replica)."""
        prompts = self.algorithm.prompts_per_step
        limit = self.rollout_producers
        unit = self.roles.rollout.unit_prompts or (prompts if limit == 1 else -(-prompts // limit))
        return unit, -(-prompts // unit)

    @property
    def engine_per_rank(self) -> bool:
        """Colocation across ranks (a hybrid engine): colocate mode with an actor of several ranks and
        one rollout replica per rank, each hosted in its rank's process, where that rank hands it
        the weights. The replicas then produce each step together as one (``rollout_producers``)."""
        actor, rollout = self.roles.actor, self.roles.rollout
        return (self.placement.mode == "colocate" and actor.ranks > 1 and rollout.replicas == actor.ranks
                and rollout.max_replicas in (None, rollout.replicas))

    @property
    def rollout_producers(self) -> int:
        """Rollout processes that lease a step's units: the replica limit, or one where an engine
        in every actor rank generates a share of the step the rank 0 leased (``engine_per_rank``)."""
        return 1 if self.engine_per_rank else self.roles.rollout.replica_limit

    def trained_roles(self) -> dict[str, ForwardRole]:
        """The GPU-capable model roles that are present, by name."""
        roles = {"actor": self.roles.actor}
        for name in ("reference", "critic", "actor_fwd"):
            role = getattr(self.roles, name)
            if role is not None:
                roles[name] = role
        return roles
