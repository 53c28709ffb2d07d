"""Memory estimates per GPU from the model's architecture and each role's parallelism.

The accounting (documented with its error bars in ``docs/plan.md``):

- Trained roles keep weights and optimizer state, and gradients during a step (freed after it). Per parameter, in bytes:
float32
  4 + 4 + 8 (Adam m, v); bfloat16/float16 2 + 2 + 12 (fp32 master copy, m, v), as in the ZeRO
  paper. SGD keeps no state (plus the fp32 master copy in mixed precision).
- Parameters on one GPU: non-expert parameters / (tp x pp) + expert parameters / (ep x pp).
- Sharding over data parallel ranks follows the backend's ``memory_sharding`` attribute: ``full``
  (FSDP/ZeRO-3: weights, gradients and optimizer), ``optimizer`` (a distributed optimizer) or
  ``none``.
- Activations per layer with flash attention: s x b x h x (10 + 24 / tp) bytes at 2-byte precision
  (Korthikanti et al. 2022, without the attention-score term), for s tokens (sequence / cp) and a
  micro-batch of b; 1F1B pipelining keeps pp micro-batches in flight on the first stage, so the
  first stage holds about all L layers' worth. A backend whose ``pipeline_schedule`` is
  ``fill-drain`` (GPipe) keeps every micro-batch of a mini-batch: m x L / pp layers' worth. Gradient checkpointing keeps
  2 x s x b x h bytes per
  layer plus one full layer.
- Log-probs need the logits in float32: b x s x vocab / tp x 4 bytes, doubled in training (their
  gradient).
- Rollout engines keep weights / (tp x pp) and a KV cache for the step's sequences:
  2 x (L / pp) x ceil(kv_heads / tp) x head_dim x bytes per token.
- A backend's options can change how it holds a role (``TrainerLayout``, read by
  ``trainer_layout``): the torch trainer's ``fsdp`` block shards weights, gradients and optimizer
  state over the role's data-parallel ranks (FSDP2). The shards, their gradients and Adam's moments
  are in the model's dtype, as the trainer loads the model (``fsdp_state_bytes``: 2 + 2 + 4 bytes
  per parameter for a bfloat16 model, 4 + 4 + 8 for a float32 one, all / dp; no separate float32
  master copy); a rank also holds the gathered weights (bf16 in mixed precision) of the root
  (embeddings, head) and of two decoder layers (the one computing and the one prefetched), plus
  one layer's full float32 gradient before its reduce-scatter. ``cpu_offload`` keeps the
  shards, gradients and optimizer state in host memory (only the gathered units stay on the GPU).
- ``max_tokens_per_micro_batch`` sets the tokens of a micro-batch (in place of sequence x
  ``micro_batch_size``) in the activation and logits terms.
- LoRA (``roles.<role>.lora``, ``lora_state``): the base weights are frozen in the model's dtype
  (sharded like weights), with no gradients and no optimizer state; the adapter's parameters
  (``relax.spec.lora.adapter_params``) are float32 (peft keeps bf16/fp16 models' adapters in float32)
  with float32 gradients and Adam's two moments: 4 + 4 + 8 bytes each. Activations are those of
  full training (the backward pass still runs through every frozen layer).
- Colocated (``resident_phases``): while training, the rollout engine sleeps (its weights and KV
  cache freed); while generating, the trainer keeps what is not transient (its shards and optimizer
  state, unless offloaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relax.plan.model import MemoryItem
from relax.spec.architecture import ModelArchitecture
from relax.spec.models import ForwardRole, RunSpec, TrainRole

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gib(n_bytes: float) -> float:
    return round(n_bytes / GIB, 3)


def params_per_gpu(arch: ModelArchitecture, tp: int, pp: int, ep: int) -> float:
    """Parameters held by one model-parallel rank."""
    experts = arch.num_layers * arch.expert_params() if arch.is_moe else 0
    dense = arch.params_total() - experts
    return dense / (tp * pp) + experts / (ep * pp)


def state_bytes_per_param(dtype: str, optimizer: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter."""
    width = DTYPE_BYTES[dtype]
    mixed = width < 4
    if optimizer == "sgd":
        return width, width, 4 if mixed else 0
    return width, width, 12 if mixed else 8


def fsdp_state_bytes(dtype: str, optimizer: str, trains: bool = True) -> tuple[int, int, int]:
    """(shard, gradient, optimizer state) bytes per parameter of a role under the torch trainer's
    FSDP2: all in the model's dtype, as the trainer loads the model and shards it without upcasting
    (Adam's two moments take the parameters' dtype); a forward-only role has shards alone."""
    width = DTYPE_BYTES[dtype]
    if not trains:
        return width, 0, 0
    return width, width, 0 if optimizer == "sgd" else 2 * width


@dataclass(frozen=True)
class TrainerLayout:
    """How a trainer backend holds one role's state on its GPUs: its ``memory_sharding`` trait, or
    what its options choose (``trainer_layout``)."""

    sharding: str = "none"
    """none, optimizer or full (``relax.contracts`` trait ``memory_sharding``)."""
    fsdp: bool = False
    """FSDP2 (per-unit all-gathers): the gathered units count, and the shards' dtype below."""
    mixed_precision: bool = True
    """FSDP2 in mixed precision: the gathered units in bfloat16 (the shards stay in the model's dtype)."""
    gather_unit: str = "decoder_layer"
    """FSDP2: what one all-gather holds (``decoder_layer`` or ``model``)."""
    offload: bool = False
    """Shards, gradients and optimizer state in host memory."""
    checkpointing: bool = False
    """The backend recomputes activations (besides the role's ``gradient_checkpointing``)."""


def trainer_layout(sharding: str, config: Any) -> TrainerLayout:
    """The layout of a role from its backend's ``memory_sharding`` trait and built ``Config``: a
    config with an enabled ``fsdp`` block (the torch trainer's ``FsdpOptions``) shards fully."""
    fsdp = getattr(config, "fsdp", None)
    if fsdp is None or not getattr(fsdp, "enabled", False):
        return TrainerLayout(sharding=sharding)
    return TrainerLayout(sharding="full", fsdp=True,
                         mixed_precision=getattr(fsdp, "mixed_precision", "auto") != "off",
                         gather_unit=getattr(fsdp, "shard_unit", "decoder_layer"),
                         offload=bool(getattr(fsdp, "cpu_offload", False)),
                         checkpointing=bool(getattr(fsdp, "activation_checkpointing", False)))


def layer_params(arch: ModelArchitecture) -> int:
    """Parameters of one decoder layer (attention, MLP or experts, two norms)."""
    return arch.attention_params() + arch.mlp_params() + 2 * arch.hidden_size


def sequence_tokens(spec: RunSpec) -> int:
    """The longest sample: prompt plus response tokens."""
    return spec.data.max_prompt_tokens + spec.roles.rollout.sampling.max_new_tokens


def trained_role_memory(
    name: str, role: ForwardRole, spec: RunSpec, arch: ModelArchitecture, sharding: str | TrainerLayout,
    data_parallel: int, schedule: str = "1f1b",
) -> list[MemoryItem]:
    """Per-GPU memory of one rank of a trained (or forward-only) role; ``sharding`` is the
    backend's ``memory_sharding`` trait or the ``TrainerLayout`` its options give, ``schedule`` its
    pipeline schedule (``1f1b`` or ``fill-drain``)."""
    layout = sharding if isinstance(sharding, TrainerLayout) else TrainerLayout(sharding=sharding)
    par = role.parallel
    width = DTYPE_BYTES[spec.model.dtype]
    params = params_per_gpu(arch, par.tp, par.pp, par.ep)
    trains = isinstance(role, TrainRole)
    optimizer = role.optimizer.name if isinstance(role, TrainRole) else "sgd"
    w_bytes, g_bytes, o_bytes = state_bytes_per_param(spec.model.dtype, optimizer)
    if layout.fsdp:
        w_bytes, g_bytes, o_bytes = fsdp_state_bytes(spec.model.dtype, optimizer, trains)
    dp = max(1, data_parallel)
    shard_w = dp if layout.sharding == "full" else 1
    shard_o = dp if layout.sharding in ("full", "optimizer") else 1
    items: list[MemoryItem] = []
    if not layout.offload:
        items.append(MemoryItem(role=name, what="weights", gib=gib(params * w_bytes / shard_w)))
        if trains:
            items.append(MemoryItem(role=name, what="gradients", gib=gib(params * g_bytes / shard_w),
                                    transient=True))
            items.append(MemoryItem(role=name, what="optimizer", gib=gib(params * o_bytes / shard_o)))
    if isinstance(role, TrainRole) and role.lora is not None and not layout.offload:
        items = lora_state(name, role, arch, base_bytes=params * width / shard_w)
    if layout.fsdp:
        compute = 2 if layout.mixed_precision else width  # bf16 gathers in mixed precision
        root = arch.params_total() - arch.num_layers * layer_params(arch)  # embeddings, head, encoders
        gathered = params if layout.gather_unit == "model" else root + 2 * layer_params(arch)
        full_grad = (layer_params(arch) if layout.gather_unit != "model" else params) * 4 if trains else 0
        items.append(MemoryItem(role=name, what="gathered units", gib=gib(gathered * compute + full_grad),
                                transient=True))
    seq = sequence_tokens(spec) / par.cp
    tokens = role.max_tokens_per_micro_batch / par.cp if role.max_tokens_per_micro_batch else \
        seq * role.micro_batch_size
    scale = width / 2  # the activation formula is for 2-byte activations
    per_layer = tokens * arch.hidden_size * (10 + 24 / par.tp) * scale
    # Layers' worth of activations alive on the first stage: L (1F1B keeps pp micro-batches of
    # L / pp layers in flight; no pipeline keeps one of L), or every micro-batch of an update.
    in_flight = arch.num_layers
    if par.pp > 1 and schedule == "fill-drain":
        in_flight = micro_batches_per_update(spec, role, dp) * arch.num_layers / par.pp
    if not trains:
        activations = per_layer  # forward only: one layer's tensors are alive at a time
    elif isinstance(role, TrainRole) and (role.gradient_checkpointing or layout.checkpointing):
        activations = in_flight * 2 * tokens * arch.hidden_size * scale + per_layer
    else:
        activations = in_flight * per_layer
    logits = tokens * arch.vocab_size / par.tp * 4 * (2 if trains else 1)
    items.append(MemoryItem(role=name, what="activations", gib=gib(activations), transient=True))
    items.append(MemoryItem(role=name, what="logits", gib=gib(logits), transient=True))
    return items


def micro_batches_per_update(spec: RunSpec, role: ForwardRole, data_parallel: int) -> int:
    """Micro-batches one data-parallel rank runs per optimizer update."""
    rows = spec.algorithm.prompts_per_step * spec.algorithm.samples_per_prompt / max(1, data_parallel)
    return max(1, math.ceil(rows / spec.algorithm.updates_per_step / role.micro_batch_size))


def rollout_memory(spec: RunSpec, arch: ModelArchitecture) -> list[MemoryItem]:
    """Per-GPU memory of one GPU of a rollout engine."""
    rollout = spec.roles.rollout
    par = rollout.parallel
    width = DTYPE_BYTES[spec.model.dtype]
    weights = arch.params_total() * width / (par.tp * par.pp)
    sequences = math.ceil(spec.algorithm.prompts_per_step * spec.algorithm.samples_per_prompt / rollout.replicas)
    per_token = 2 * (arch.num_layers / par.pp) * math.ceil(arch.num_kv_heads / par.tp) * arch.head_dim * width
    kv = sequences * sequence_tokens(spec) * per_token
    logits = sequences * arch.vocab_size * 4
    return [
        MemoryItem(role="rollout", what="weights", gib=gib(weights)),
        MemoryItem(role="rollout", what="kv_cache", gib=gib(kv), transient=True),
        MemoryItem(role="rollout", what="logits", gib=gib(logits), transient=True),
    ]


def resident_phases(items: list[MemoryItem], colocate: bool) -> dict[str, float]:
    """GiB resident per phase on one device.

    Roles sharing a device run their transient work at different times, so a phase holds every
    role's persistent state plus the largest transient footprint of the roles active in it. In
    colocate mode the rollout engine sleeps (frees its weights and KV cache) while training.
    """
    def transient_peak(roles: set[str]) -> float:
        by_role: dict[str, float] = {}
        for item in items:
            if item.transient and item.role in roles:
                by_role[item.role] = by_role.get(item.role, 0.0) + item.gib
        return max(by_role.values(), default=0.0)

    roles = {item.role for item in items}
    trained = roles - {"rollout"}
    persistent = {r: sum(i.gib for i in items if i.role == r and not i.transient) for r in roles}
    if colocate and "rollout" in roles:
        generate = sum(persistent.values()) + transient_peak({"rollout"})
        train = sum(persistent[r] for r in trained) + transient_peak(trained)
        return {"generate": round(generate, 3), "train": round(train, 3)}
    return {"run": round(sum(persistent.values()) + transient_peak(roles), 3)}


def lora_state(name: str, role: TrainRole, arch: ModelArchitecture, base_bytes: float) -> list[MemoryItem]:
    """Weights, gradients and optimizer state of one rank of a role training a LoRA adapter: the
    frozen base (``base_bytes``, as the role holds it) plus the float32 adapter, its gradients
    (transient) and its Adam moments (none for SGD)."""
    from relax.spec.lora import adapter_params

    par = role.parallel
    adapter = adapter_params(role.lora, arch) / (par.tp * par.pp)
    moments = 0 if role.optimizer.name == "sgd" else 8
    return [MemoryItem(role=name, what="weights", gib=gib(base_bytes + adapter * 4)),
            MemoryItem(role=name, what="gradients", gib=gib(adapter * 4), transient=True),
            MemoryItem(role=name, what="optimizer", gib=gib(adapter * moments))]


def weight_sync_bytes(spec: RunSpec, arch: ModelArchitecture) -> int:
    """Bytes one weight sync moves to a rollout: the whole model in its dtype (a tied output head
    travels as its own tensor), or with ``roles.actor.lora`` the float32 adapter alone."""
    lora = spec.roles.actor.lora
    if lora is not None:
        from relax.spec.lora import adapter_params

        return int(adapter_params(lora, arch) * 4)
    head = arch.vocab_size * arch.hidden_size if arch.tie_embeddings else 0
    return int((arch.params_total() + head) * DTYPE_BYTES[spec.model.dtype])
