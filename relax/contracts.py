"""The contracts between the engine and its plugins.

A plugin is a class with a nested pydantic ``Config`` (its options) registered under one entry-point
group per kind. This module states, per kind, which methods the class must have and with which
parameters, so the registry can reject a plugin whose hooks do not match before a run starts, with a
message naming the plugin and the expected signature.

It also declares, per kind, the class attributes ("traits") a plugin may set to tell the planner
and the validator what it can do (``TRAITS``; the registry checks their types and values), and
the typed contexts the runtime hands a plugin when it builds one (``RolloutContext``,
``TrainerContext``, ``AlgorithmContext``, ``RewardContext``): a plugin reads what it needs from its
context and never sees the run spec, so a spec change cannot silently change what a plugin reads.
The contexts are plain data (JSON round-trip) apart from the runtime-only objects they carry
(a trainer's built loss, a reward's backend factory), which are left out of dumps.

It also holds the small, dependency-free records that cross the plugin boundary (a reward sample, a
generation). Tensors never appear here: this module is imported by ``relax validate`` (pydantic
and the standard library only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TransientError(RuntimeError):
    """Raised by a plugin for a failure that may pass on a retry (a service that is down for a
    moment, a sandbox that did not start). The role's worker is then restarted as its
    ``fault_tolerance.roles`` policy says, like a process that died. Any other exception a plugin
    raises is taken as one that would repeat (a bug, bad data, a bad option) and stops the run at
    once with its message (``relax.runtime.failure_class``). Wrap the original:
    ``raise TransientError("judge service unreachable") from exc``."""


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
    environments = "environments"
    loggers = "loggers"

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
    # Published contract for third parties: keep it stable. A reward may also take a keyword-only
    # ``context: RewardContext | None = None`` (model-based rewards build their judge through it).
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
        Hook("__init__", ("config", "context")),
        Hook("compute", ("rewards", "group_ids")),
    ),
    PluginKind.losses: (Hook("__init__", ("config", "context")), Hook("compute", ("batch", "logprobs"))),
    PluginKind.modalities: (Hook("__init__", ("config",)), Hook("load", ("item",))),
    PluginKind.models: (
        Hook("__init__", ("config",)),
        Hook("architecture", ()),
        Hook("materialize", ("cache_dir",)),
    ),
    # Published contract for third parties: keep it stable (docs/agents.md). ``start`` and ``step``
    # may be ``async def``; either runs off the rollout's generation thread, under the tool timeout.
    PluginKind.environments: (
        Hook("__init__", ("config",)),
        Hook("tools", ()),
        Hook("start", ("task",)),
        Hook("step", ("state", "turn")),
    ),
    # Published contract for third parties: keep it stable (docs/runtime.md, "Experiment trackers").
    # Built in the driver only; ``log`` gets every metrics.jsonl row, ``close`` runs once at the end.
    PluginKind.loggers: (
        Hook("__init__", ("config", "run")),
        Hook("log", ("step", "metrics")),
        Hook("close", ("status",)),
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
    loss_mask: list[int] | None = None
    """Per response token, 1 where the policy chose it and 0 where it did not (a multi-turn
    trajectory's observation and chat-template tokens); None: every response token is the policy's."""
    token_versions: list[int] | None = None
    """Per response token, the policy version that chose it (0 off the policy's tokens); None: the
    generation's one version (the rollout's, recorded per row)."""
    routed_experts: list[list[list[int]]] | None = None
    """Mixture-of-experts models with routing replay on (``RolloutContext.record_routing``): per
    response token, per MoE layer (model order), the ``k`` expert ids the router chose in the
    forward pass that gave this token's distribution (the prompt's last token for the first
    response token, the previous response token after), ``[tokens][layers][k]``; None: not recorded.
    An engine capturing per-position routing gives positions ``P-1 .. P+R-2`` of the sequence."""


@dataclass
class TokenPrompt:
    """A prompt given as token ids (``generate_tokens``): a multi-turn trajectory's tokens so far,
    never re-tokenized. ``media`` are the references of every media item in ``ids``, in order (their
    placeholders are already expanded in ``ids``)."""

    ids: list[int]
    media: list[Any] = field(default_factory=list)
    max_new_tokens: int | None = None
    """This call's budget (a turn's, or what is left of the trajectory's); None: the sampling's."""


@dataclass(frozen=True)
class RunInfo:
    """What a ``relax.loggers`` plugin is told about the run it records (the driver builds one)."""

    name: str
    """The run's name (``name`` in the spec)."""
    output_dir: str
    """The run's absolute output folder: a logger writes its local files under it."""
    config: dict[str, Any]
    """The resolved spec as JSON-able data (what a tracker records as the run's configuration)."""
    start_step: int = 0
    """The step the run starts after: 0 for a fresh run, a checkpoint's step when resumed (the rows
    of the steps after it may reach a logger a second time)."""


LoggerStatus = Literal["finished", "failed", "killed"]
"""How a run ended, as ``close`` is told: every step done, an error, or interrupted (Ctrl-C)."""


# -- agents ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """A tool an environment offers the model: rendered into the prompt by the chat template (the
    OpenAI function-tool form), and checked when the model calls it."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """The JSON schema of the arguments object."""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry (what Hugging Face chat templates take as ``tools``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call parsed from a model turn."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class AgentTask:
    """What an environment starts a trajectory from: one data row (``data.prompt_key`` and
    ``data.label_key``, the row itself) and which sample of its group this trajectory is."""

    prompt: str
    label: Any
    row: dict[str, Any]
    index: int
    """The row's index in the data set."""
    sample: int
    """Which of the ``samples_per_prompt`` trajectories of the row this is."""
    trajectory_id: str


@dataclass
class Turn:
    """One model turn, as the environment receives it."""

    index: int
    """0 for the first model turn."""
    text: str
    """The turn's decoded text (without the stop token)."""
    tool_calls: list[ToolCall]
    """The well-formed calls to declared tools, in order (a malformed one never reaches ``step``:
    the model gets an error observation instead)."""
    finished: bool
    """The model ended the turn itself (False: cut at the turn's or the trajectory's token budget)."""


@dataclass
class Observation:
    """What an environment returns after a turn: the next message the model sees (unless ``done``),
    whether the trajectory ends, and an optional turn reward.

    ``content`` is text, or a list of items: ``{"type": "text", "text": ...}`` and media items such
    as ``{"type": "image", "image": <path, bytes or array>}`` (``audio``, ``video`` alike), which
    travel by reference like the data's media and reach the model in its next turn."""

    content: str | list[dict[str, Any]] = ""
    done: bool = False
    reward: float | None = None
    """A turn reward, added to the trajectory's reward (``roles.rollout.agent.turn_reward_weight``)."""
    role: str = "tool"
    """The chat role of the message: ``tool`` (a tool result) or ``user``."""
    info: dict[str, Any] = field(default_factory=dict)
    """Small JSON-able facts kept with the trajectory's metadata (not shown to the model)."""



# -- traits ---------------------------------------------------------------------------------------

#: Input modalities a backend may read (``model.modalities`` values).
MODALITIES = frozenset({"text", "image", "audio", "video"})
#: Parallelism dimensions a backend may support (``roles.<role>.parallel`` keys, and ``dp``).
PARALLELISM = frozenset({"dp", "tp", "pp", "cp", "ep"})
#: Token columns of other model roles an advantage estimator may read (its ``needs``): the
#: critic's ``values`` and the reference's ``ref_logprobs``.
TOKEN_COLUMNS = frozenset({"ref_logprobs", "values"})
#: ``algorithm.router_replay`` modes a backend may support (besides ``off``, which all do).
ROUTER_REPLAY = frozenset({"r2", "r3"})
#: ``async_policy.correction`` values a loss may honour (``relax.algo.corrections``).
CORRECTIONS = frozenset({"none", "tis", "decoupled", "seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop",
                         "opsm"})
#: The corrections whose weight is a function of the proximal / behaviour ratio: they need the
#: proximal log-probs of ``roles.actor_fwd`` (without them that ratio is 1 and they do nothing).
PROXIMAL_CORRECTIONS = frozenset({"decoupled", "seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop"})


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _subset_of(allowed: frozenset[str]) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return isinstance(value, (set, frozenset)) and all(isinstance(v, str) for v in value) and value <= allowed
    return check


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _one_of(*allowed: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in allowed


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Trait:
    """A class attribute a plugin of some kind may declare, read by the planner, the validator or
    the runtime. ``check`` says whether a declared value is acceptable; ``expected`` says so in
    words for the error message; ``default`` is what an undeclared trait means."""

    name: str
    expected: str
    default: Any
    meaning: str
    check: Callable[[Any], bool]
    per_instance: bool = False
    """The value may depend on the instance (a ``property`` on the class): only instances know it."""

    def accepts(self, value: Any) -> bool:
        return (self.per_instance and isinstance(value, property)) or bool(self.check(value))


def _traits(*traits: Trait) -> dict[str, Trait]:
    return {t.name: t for t in traits}


_MODALITIES = Trait("modalities", f"a frozenset of {', '.join(sorted(MODALITIES))}, or None", None,
                    "Inputs the backend accepts; None: not declared (not checked).",
                    _optional(_subset_of(MODALITIES)))
_PARALLELISM = Trait("parallelism", f"a frozenset of {', '.join(sorted(PARALLELISM))}, or None", None,
                     "Parallel dimensions the backend supports; None: not declared (not checked).",
                     _optional(_subset_of(PARALLELISM)))
_TOLERATED = Trait("tolerated_staleness", "an int >= 0, or None", None,
                   "Most async_policy.max_staleness the part is sound for; None: any (it has an "
                   "importance ratio).", _optional(_count))

#: Traits each kind may declare. A plugin class that sets one to a value its ``check`` refuses is
#: rejected by the registry's contract check; the registry's ``trait`` accessor gives the default
#: when a class does not declare one. Kinds without an entry declare no traits.
TRAITS: dict[PluginKind, dict[str, Trait]] = {
    PluginKind.rollout: _traits(
        _MODALITIES, _PARALLELISM,
        Trait("weight_group_ranks", "an int >= 1 (or a property, when it depends on the instance)", 1,
              "Ranks the backend joins a weight group with (collective weight sync).", _positive,
              per_instance=True),
        Trait("router_replay", "a frozenset of r3", frozenset(),
              "Routing replay modes the rollout serves: r3, it records each response token's routed "
              "experts (Generation.routed_experts) when its context asks (record_routing).",
              _subset_of(frozenset({"r3"}))),
        Trait("pausable", "a bool", False,
              "generate_tokens(prompts, sampling, seed, pause=...) stops every row at the token where "
              "pause(rows_done) answers True and returns them as far as they got: partial rollouts "
              "(roles.rollout.partial) swap weights there and continue.", _is_bool),
    ),
    PluginKind.trainer: _traits(
        _MODALITIES, _PARALLELISM,
        Trait("memory_sharding", "one of none, optimizer, full", "none",
              "What the backend shards over data-parallel ranks (the planner's memory estimate): "
              "none (full replicas), optimizer (optimizer state), full (weights, gradients and "
              "optimizer state).", _one_of("none", "optimizer", "full")),
        Trait("pipeline_schedule", "one of 1f1b, fill-drain", "1f1b",
              "The pipeline schedule (the planner's activation estimate under pp > 1).",
              _one_of("1f1b", "fill-drain")),
        Trait("router_replay", f"a frozenset of {', '.join(sorted(ROUTER_REPLAY))}", frozenset(),
              "Routing replay modes the trainer honours (TrainerContext.router_replay): r3 replays the "
              "batch's routed_experts, r2 its own routing from the step's first forward pass.",
              _subset_of(ROUTER_REPLAY)),
    ),
    PluginKind.advantages: _traits(
        Trait("token_level", "a bool", False,
              "The estimator computes [B, T] advantages with compute_tokens (it reads token tensors).",
              _is_bool),
        Trait("group_based", "a bool", False,
              "The estimator compares samples of one prompt (needs samples_per_prompt >= 2).", _is_bool),
        Trait("needs", f"a frozenset of {', '.join(sorted(TOKEN_COLUMNS))}", frozenset(),
              "Token columns of other roles a token-level estimator reads.", _subset_of(TOKEN_COLUMNS)),
        _TOLERATED,
    ),
    PluginKind.losses: _traits(
        _TOLERATED,
        Trait("corrections", f"a frozenset of {', '.join(sorted(CORRECTIONS))}, or None", None,
              "The async_policy.correction values the loss honours; None: not declared (not checked).",
              _optional(_subset_of(CORRECTIONS))),
        Trait("needs_entropy", "a bool, or None", None,
              "None: compute takes no entropy. A bool: compute takes per-token entropy when it is "
              "True (an instance sets it from its context).", _optional(_is_bool)),
    ),
    PluginKind.environments: _traits(
        Trait("observation_modalities", f"a frozenset of {', '.join(sorted(MODALITIES - {'text'}))}",
              frozenset(), "Media an environment's observations may carry (each needs its "
              "data.media_keys entry, so the rollout and the trainer build its modality plugin).",
              _subset_of(MODALITIES - {"text"})),
    ),
    PluginKind.rewards: _traits(
        Trait("model_based", "a bool", False,
              "The reward serves a model (a judge): it must run in its own reward worker.", _is_bool),
    ),
}


# -- contexts -------------------------------------------------------------------------------------


class ContextData(BaseModel):
    """Base of the plain-data parts of the contexts: frozen, no unknown fields, JSON round-trip."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(ContextData):
    """The model a backend loads."""

    path: str
    """A local folder (built-in models are materialized before any backend is built)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    modalities: tuple[str, ...] = ("text",)
    """Inputs the run gives the model."""


class SamplingInfo(ContextData):
    """How the rollout samples (``roles.rollout.sampling``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k truncation."""
    max_new_tokens: int = 8


class ParallelInfo(ContextData):
    """A role's model-parallel sizes per replica (``roles.<role>.parallel``)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1


class MediaInfo(ContextData):
    """The media columns of the data and their modality plugins' options: what a backend needs to
    build its ``relax.media.MediaSet`` (``MediaSet.from_info``)."""

    keys: dict[str, str]
    """Modality -> data column."""
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Modality -> options of its ``relax.modalities`` plugin."""
    on_bad_sample: Literal["error", "skip"] = "error"


class OptimizerInfo(ContextData):
    """A trained role's optimizer (``roles.<role>.optimizer``)."""

    name: str = "adamw"
    lr: float = 3.0e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""


class TrainingInfo(ContextData):
    """What a role that trains (actor, critic) has beyond a forward-only one."""

    optimizer: OptimizerInfo = Field(default_factory=OptimizerInfo)
    gradient_checkpointing: bool = False


class RolloutContext(ContextData):
    """What the runtime hands a ``relax.rollout`` backend when it builds one."""

    role: str = "rollout"
    """The role the backend serves (``rollout``; ``reward`` for a judge a reward builds)."""
    model: ModelInfo
    sampling: SamplingInfo = Field(default_factory=SamplingInfo)
    """The run's sampling settings (``generate`` also receives them per call)."""
    parallel: ParallelInfo = Field(default_factory=ParallelInfo)
    gpu_memory_utilization: float = 0.9
    """Share of each GPU an engine may take (engines that preallocate)."""
    max_prompt_tokens: int = 256
    """Prompts are cut from the left to this many tokens."""
    chat_template: str = "none"
    """How a text prompt is rendered before it is tokenized: ``auto`` (the tokenizer's chat
    template when it has one), ``none`` (raw), or the absolute path of a Jinja template file
    (``relax_plugins.rollout.chat_template.PromptEncoder`` does it for the built-in backends). A run
    passes ``data.chat_template`` (default ``auto``); a context built elsewhere (a judge that renders
    its own prompts) tokenizes raw unless it asks."""
    media: MediaInfo | None = None
    """None for text runs."""
    max_trajectory_tokens: int | None = None
    """Agentic runs (``roles.rollout.agent.max_tokens``): tokens after the prompt a multi-turn
    trajectory may hold, so an engine sizes its sequences for ``max_prompt_tokens`` plus these;
    None: one response of ``sampling.max_new_tokens``."""
    device: str = "cpu"
    seed: int = 0
    record_routing: bool = False
    """Record each response token's routed experts (``Generation.routed_experts``): the run
    replays the rollout's routing in the trainer (``algorithm.router_replay: r3``)."""


class TrainerContext(ContextData):
    """What the runtime hands a ``relax.trainer`` backend for one model role (actor, critic,
    reference, actor_fwd)."""

    role: str
    model: ModelInfo
    parallel: ParallelInfo = Field(default_factory=ParallelInfo)
    micro_batch_size: int = 16
    training: TrainingInfo | None = None
    """The optimizer and its settings; None for a forward-only role (reference, actor_fwd)."""
    updates_per_step: int = 1
    """Optimizer steps per training step (the batch splits into this many mini-batches)."""
    sampling_temperature: float = 1.0
    """The rollout's sampling temperature: log-probs are those of ``softmax(logits / T)``."""
    max_prompt_tokens: int = 256
    media: MediaInfo | None = None
    value_clip: float | None = 0.2
    """The critic's value clip (``algorithm.value_clip``; None: unclipped)."""
    mismatch_ratio_bound: float = 2.0
    """``async_policy.mismatch.ratio_bound``: a token counts in the actor's ``mismatch/frac_over``
    when its trainer / rollout ratio is outside ``[1/bound, bound]`` (``relax.algo.mismatch``)."""
    router_replay: Literal["off", "r2", "r3"] = "off"
    """``algorithm.router_replay`` (MoE models): ``r3`` routes the response tokens with the
    rollout's recorded experts (the batch's ``routed_experts``), ``r2`` with the trainer's own from
    the step's first forward pass, ``off`` as the router chooses."""
    device: str = "cpu"
    seed: int = 0
    loss: Any = Field(None, exclude=True)
    """The built ``relax.losses`` plugin the actor optimises (None for other roles). Runtime-only:
    left out of dumps."""


class AlgorithmContext(ContextData):
    """The algorithm's settings that advantage estimators and losses read."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    """Dual-clip bound (> 1) on negative advantages; None: no dual clip."""
    kl_coef: float = 0.0
    kl_in: Literal["loss", "reward"] | None = None
    """Where the KL penalty to the reference goes (None: nowhere)."""
    kl_estimator: str | None = None
    """k1, k2 or k3; None lets each part choose its default."""
    entropy_coef: float = 0.0
    loss_aggregation: str | None = None
    """How per-token losses are reduced; None: ``token-mean``."""
    correction: Literal["none", "tis", "decoupled", "seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop",
                        "opsm"] = "tis"
    """``async_policy.correction`` (``relax.algo.corrections``)."""
    tis_cap: float = 2.0
    """The weight cap of tis, decoupled and seq_tis."""
    mis_low: float = 0.5
    mis_high: float = 2.0
    """The ratio band ``[mis_low, mis_high]`` token_mis and seq_mis keep."""
    geo_low: float = 0.999
    geo_high: float = 1.001
    """The geometric-mean sequence ratio band geo_reject keeps."""
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    """The token ratio band icepop keeps."""
    opsm_delta: float = 0.05
    """opsm's drift bound on a negative-advantage sequence's mean log(behaviour / policy)."""
    max_new_tokens: int = 8
    """The rollout's generation budget (the constant denominator of ``seq-mean-token-sum-norm``)."""


@dataclass(frozen=True)
class RewardContext:
    """What the runtime offers a reward that serves a model (a judge), so the reward builds it
    without importing the runtime or reading the spec. Rewards that take no ``context`` keyword
    never see it. Runtime-only (holds callables): it is never serialized."""

    device: str
    """Where the reward worker's models go (``cuda`` when the plan gave it a GPU, else ``cpu``)."""
    materialize_model: Callable[[str, dict[str, Any]], str]
    """``(model, model_options) -> local folder``: a Hugging Face folder as given (relative to the
    working directory), or ``builtin:<name>`` built by its ``relax.models`` plugin (cached)."""
    build_rollout: Callable[[str, dict[str, Any], RolloutContext], Any]
    """``(backend, backend_options, context) -> backend``: a ``relax.rollout`` plugin built through
    the registry with its options checked against its ``Config``."""
