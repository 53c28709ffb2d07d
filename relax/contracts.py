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

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol, runtime_checkable

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
    # A data set may also define a classmethod ``length(config) -> int``: its size, known without
    # building it; ``trainer.epochs`` needs it for a data set that is not a file (relax.spec.run_length).
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

#: Methods a plugin of some kind may define; when it does, they must take these parameters. A
#: plugin without one keeps working: the engine just does not call it.
OPTIONAL_HOOKS: dict[PluginKind, tuple[Hook, ...]] = {
    # ``log_samples`` gets the few rows of a sampled step (trainer.log_samples_every): what
    # samples.jsonl holds, one dict per row (docs/runtime.md, "Samples"). A logger without it gets
    # the metrics only.
    PluginKind.loggers: (Hook("log_samples", ("step", "rows")),),
}


# -- engines and capabilities ------------------------------------------------------------------------
#
# The runtime talks to a trainer through HOOKS; below them sits an *engine* (how the model is held:
# one device, FSDP2 shards, Megatron's model parallelism) and above them the policy step written once
# (``relax_plugins.trainer.steps``). Weights leave a trainer only through a ``WeightExtractor``. The
# rollout side's optional abilities are declared as protocols here too, so the registry checks their
# signatures when a plugin is loaded and the validator and the runtime ask ``supports(...)`` instead
# of probing objects by name.


@runtime_checkable
class WeightExtractor(Protocol):
    """How weights leave a trainer: ``(name, tensor)`` buckets of bounded byte size, named as the
    rollout names them (Hugging Face keys), holding the full model or only an adapter. A sharded
    trainer gathers one parameter (or layer) at a time while a bucket fills, so no rank holds the
    whole model at once; every rank of the trainer iterates it (the gathers are collectives) and
    only the ranks that send keep the tensors. The implementation is
    ``relax_plugins.trainer.weight_extraction.BucketExtractor``."""

    bucket_bytes: int
    """Most bytes of one bucket (a tensor larger than this travels alone)."""
    adapter_only: bool
    """True when only an adapter's tensors leave (LoRA): the rollout keeps its base weights."""

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (dtype name, shape) of every tensor the buckets will hold, known before any
        gather (what a weight group announces before its data)."""
        ...

    def buckets(self) -> Iterator[list[tuple[str, Any]]]:
        """The tensors, bucket by bucket; a bucket's tensors are valid until the next is asked for
        (copy what must outlive that)."""
        ...


@runtime_checkable
class TrainerEngine(Protocol):
    """What the policy step needs from the layer that holds a model and its optimizer. The policy
    step itself (mini-batches, loss weights, accumulation, the optimizer step, metrics) is written
    once above the engines: ``relax_plugins.trainer.steps.policy_step``. The ``torch`` trainer (a
    replica or FSDP2 shards) and ``megatron`` (tensor, pipeline and expert parallel) are engines.
    Besides these methods an engine has ``model``, ``optimizer``, ``optimizer_info``, ``loss``,
    ``context``, ``updates_per_step``, ``router_replay``, ``version`` and ``own_routing(batch)``,
    and the trainer hooks (``save``/``load``: sharded where the engine shards)."""

    def data_parallel(self) -> bool:
        """Whether this rank has data-parallel peers."""
        ...

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the data-parallel ranks (unchanged on one rank)."""
        ...

    def begin_step(self) -> Any:
        """Reset the step's counters; the step's mismatch tally (``relax.algo.mismatch``) or None."""
        ...

    def forward_backward(self, minibatch: Any, weigh: Callable[..., Any], mismatch: Any) -> None:
        """Run the mini-batch's micro-batches forward with gradients. For each, the engine computes
        the loss and metrics and back-propagates ``weigh(micro, loss, metrics)``, the loss weighted by
        its share of the mini-batch (``weigh`` also records the metrics). ``mismatch``, when given,
        counts the first mini-batch's log-probs."""
        ...

    def finish_gradients(self, stats: dict[str, float]) -> float:
        """Complete the accumulated gradients over the ranks (and ``stats`` with them), then clip
        them to the role's ``grad_clip``. Returns the global gradient norm before clipping."""
        ...

    def end_step(self, totals: dict[str, float], mismatch: Any) -> tuple[dict[str, float], dict[str, float]]:
        """The step's summed stats as every rank reports them, and the engine's own figures."""
        ...

    def extractor(self, adapter_only: bool = False) -> WeightExtractor:
        """The weights, bucket by bucket, for a rollout, a forward-only role or an export."""
        ...


@runtime_checkable
class TokenGeneration(Protocol):
    """A rollout that continues prompts given as token ids (``TokenPrompt``): agentic trajectories
    and partial rollouts need it."""

    def generate_tokens(self, prompts: list[TokenPrompt], sampling: Any, seed: int) -> list[Generation]: ...

    def encode_prompt(self, prompt: str) -> list[int]: ...


@runtime_checkable
class PausableGeneration(Protocol):
    """A rollout whose ``generate_tokens`` stops every row where ``pause(rows_done)`` answers True
    (partial rollouts swap weights there and continue). Declared by the ``pausable`` trait too."""

    def generate_tokens(self, prompts: list[TokenPrompt], sampling: Any, seed: int, pause: Any = None
                        ) -> list[Generation]: ...

    def encode_prompt(self, prompt: str) -> list[int]: ...


@runtime_checkable
class CollectiveReceive(Protocol):
    """A rollout that receives weights from a weight group (``relax.weight_group``), bucket by
    bucket, straight into its model."""

    def join_weight_group(self, address: dict[str, Any]) -> None: ...

    def receive_weights(self) -> int: ...


@runtime_checkable
class ModelSharing(Protocol):
    """A rollout that generates with a trainer's model in its own process (colocation: no copy)."""

    def adopt_model(self, model: Any) -> bool: ...


@runtime_checkable
class InProcessHandover(Protocol):
    """A rollout engine that takes a trainer's weights in its own process, bucket by bucket, as the
    trainer's extractor yields them (colocation across ranks: each actor rank hands its own engine
    the weights gathered from its shards; nothing travels between processes but the gathers), and
    that frees its device memory while the trainer trains (``sleep``) until ``wake``."""

    def load_buckets(self, shapes: dict[str, Any], buckets: Any, version: int) -> int: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class ModelOffer(Protocol):
    """A trainer that offers its policy model to a rollout in its process (``ModelSharing``)."""

    def shareable_model(self) -> Any: ...


def protocol_hooks(protocol: type) -> tuple[Hook, ...]:
    """The hooks a capability protocol declares: each method with the parameters (after ``self``)
    that have no default; those with one may be left out by an implementation's signature only when
    it declares them with a default too."""
    hooks = []
    for name, member in vars(protocol).items():
        if name.startswith("_") or not callable(member):
            continue
        params = list(inspect.signature(member).parameters.values())[1:]
        hooks.append(Hook(name, tuple(p.name for p in params)))
    return tuple(hooks)


#: The optional abilities each kind may have, by name. A plugin claims one by defining the
#: protocol's first method (``pausing``: by declaring the ``pausable`` trait); a claimed one must
#: have all the protocol's methods with its parameters, or the registry refuses the plugin naming
#: the capability. ``relax.registry.supports`` answers whether a class has one.
CAPABILITIES: dict[PluginKind, dict[str, type]] = {
    PluginKind.rollout: {"token_generation": TokenGeneration, "pausing": PausableGeneration,
                         "collective_receive": CollectiveReceive, "model_sharing": ModelSharing,
                         "in_process_handover": InProcessHandover},
    PluginKind.trainer: {"model_offer": ModelOffer},
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
    grammar: str | None = None
    """A grammar the response must follow (llguidance's Lark dialect, ``relax.agents.constraints``),
    enforced by masking each step's distribution; None: unconstrained. Only a backend whose
    ``constrained_decoding`` holds ``grammar`` is sent one."""
    structured_outputs: dict[str, Any] | None = None
    """The same constraint as vLLM's ``StructuredOutputsParams`` keyword arguments (for a backend
    whose ``constrained_decoding`` holds ``structured_outputs``); None with ``grammar``: it has no
    such form."""


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



# -- bounds on data rows -----------------------------------------------------------------------------

#: ``data.on_long_prompt``: a prompt longer than ``data.max_prompt_tokens`` is cut from the left
#: (``truncate``) or refused with its file and line (``refuse``).
LongPromptPolicy = Literal["truncate", "refuse"]
#: Characters of prompt text kept per token of ``data.max_prompt_tokens`` before a prompt is
#: tokenized: no tokenizer's token covers this many characters in real text, so the cut never
#: removes a token the token cut would keep, and a 10 MB prompt is never tokenized whole.
PROMPT_CHARS_PER_TOKEN = 32
#: Largest row a data file may hold, in bytes (a JSON line, a CSV record, a table row's text and
#: binary cells); a larger one is refused with its file and line (``max_row_bytes`` of the file
#: plugins raises it).
MAX_ROW_BYTES = 32 * 1024 * 1024
#: Most columns a data file may have (``max_columns`` of the file plugins raises it).
MAX_COLUMNS = 10_000


def prompt_char_limit(max_prompt_tokens: int) -> int:
    """The characters of prompt text a prompt of ``max_prompt_tokens`` tokens is cut to (or, under
    ``data.on_long_prompt: refuse``, refused past) before it is tokenized."""
    return max(1, int(max_prompt_tokens)) * PROMPT_CHARS_PER_TOKEN


def cut_prompt(text: str, max_prompt_tokens: int, policy: LongPromptPolicy = "truncate") -> str:
    """``text`` within ``prompt_char_limit``: its end kept (prompts are cut from the left, as their
    tokens are), or ValueError under ``refuse``."""
    limit = prompt_char_limit(max_prompt_tokens)
    if len(text) <= limit:
        return text
    if policy == "refuse":
        raise ValueError(f"a prompt of {len(text)} characters is longer than data.max_prompt_tokens="
                         f"{max_prompt_tokens} x {PROMPT_CHARS_PER_TOKEN} characters (data.on_long_prompt: refuse); "
                         "shorten it, raise data.max_prompt_tokens, or set data.on_long_prompt: truncate")
    return text[-limit:]


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
        Trait("lora_adapters", "a bool", False,
              "With a context's lora (the actor trains a LoRA adapter) the backend keeps its base weights "
              "and load_weights takes only the adapter's tensors (PEFT naming), applying them to a new "
              "policy version.", _is_bool),
        Trait("adapter_weight_group", "a bool", False,
              "With a context's lora the backend also takes the adapter's tensors from a weight group "
              "(roles.rollout.weight_sync: collective); False: only through load_weights (the object store).",
              _is_bool),
    ),
    PluginKind.trainer: _traits(
        _MODALITIES, _PARALLELISM,
        Trait("memory_sharding", "one of none, optimizer, full", "none",
              "What the backend shards over data-parallel ranks (the planner's memory estimate): "
              "none (full replicas), optimizer (optimizer state), full (weights, gradients and "
              "optimizer state).", _one_of("none", "optimizer", "full")),
        Trait("token_budget", "a bool", False,
              "The backend cuts micro-batches by TrainerContext.max_tokens_per_micro_batch "
              "(relax.algo.micro_batches) rather than by rows.", _is_bool),
        Trait("pipeline_schedule", "one of 1f1b, fill-drain", "1f1b",
              "The pipeline schedule (the planner's activation estimate under pp > 1).",
              _one_of("1f1b", "fill-drain")),
        Trait("router_replay", f"a frozenset of {', '.join(sorted(ROUTER_REPLAY))}", frozenset(),
              "Routing replay modes the trainer honours (TrainerContext.router_replay): r3 replays the "
              "batch's routed_experts, r2 its own routing from the step's first forward pass.",
              _subset_of(ROUTER_REPLAY)),
        Trait("lora", "a bool", False,
              "The backend trains a LoRA adapter on a frozen base when its context carries lora "
              "(roles.<role>.lora), and its weights() then hold only the adapter.", _is_bool),
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
    stop: tuple[str, ...] = ()
    """Stop strings: a response ends with the token that completes the first of them; that token
    and those before it stay in the response (trained on like a stop token), the text ends before
    the stop string (``relax.algo.stop_strings``)."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens already in the prompt or the response (1: none)."""


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
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate over the run's steps after the warmup (``relax.algo.schedules``)."""
    warmup_steps: int = 0
    """Steps of linear warmup (when ``warmup_ratio`` is None)."""
    warmup_ratio: float | None = None
    """Warmup as a share of the run's steps; None: ``warmup_steps``."""
    min_lr_ratio: float = 0.0
    """The floor of linear and cosine decay, as a share of ``lr``."""


#: The linear layers of a Llama / Qwen decoder layer that ``lora.target_modules: all-linear``
#: means: attention, then the dense MLP (an MoE layer's experts are left out). Here, not in the
#: spec, because the rollout plugins that serve adapters name the same layers.
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class LoraInfo(ContextData):
    """A LoRA adapter a role trains or follows (``roles.<role>.lora``; ``relax.spec.lora`` documents
    the fields): the base model stays frozen and only the adapter's tensors train, sync and save."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    """Last names of the linear layers that get an adapter, or ``all-linear``."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained in full beside the adapter (synced and saved with it)."""
    init_adapter: str | None = None
    """A PEFT adapter folder to start from (absolute path); None starts a new adapter."""
    export_merged: bool = False
    """Exports also write ``merged/``, the model with the adapter merged in."""


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
    """Prompts are cut from the left to this many tokens (their text first to
    ``prompt_char_limit`` characters, so a huge prompt is never tokenized whole)."""
    on_long_prompt: LongPromptPolicy = "truncate"
    """``data.on_long_prompt``: ``refuse`` makes a prompt over ``max_prompt_tokens`` an error
    instead of cutting it."""
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
    lora: LoraInfo | None = None
    """The actor's LoRA adapter (``roles.actor.lora``): weight syncs carry only its tensors, named as
    PEFT saves them, and the backend applies them to its frozen base (None: full weights)."""


class TrainerContext(ContextData):
    """What the runtime hands a ``relax.trainer`` backend for one model role (actor, critic,
    reference, actor_fwd)."""

    role: str
    model: ModelInfo
    parallel: ParallelInfo = Field(default_factory=ParallelInfo)
    micro_batch_size: int = 16
    max_tokens_per_micro_batch: int | None = None
    """``roles.<role>.max_tokens_per_micro_batch``: micro-batches of at most this many real tokens
    (``relax.algo.micro_batches``) instead of ``micro_batch_size`` rows; None: rows."""
    training: TrainingInfo | None = None
    """The optimizer and its settings; None for a forward-only role (reference, actor_fwd)."""
    updates_per_step: int = 1
    """Optimizer steps per training step (the batch splits into this many mini-batches)."""
    total_steps: int = 1
    """The run's training steps (``trainer.steps``, or as ``trainer.epochs`` resolve): the length the
    learning-rate schedule spans."""
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
    lora: LoraInfo | None = None
    """The LoRA adapter the role trains (actor, critic: ``roles.<role>.lora``) or follows
    (actor_fwd: the actor's); None trains or holds the full model. A reference never has one: it
    is the base model."""
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
