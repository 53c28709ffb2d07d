"""``torch``: a plain PyTorch train backend on a Hugging Face causal LM (CPU or one GPU).

Forward-only roles (reference, actor_fwd) build it too and only call ``compute_logprobs``; a role
with an ``optimizer`` block (actor, critic) also trains. The critic is the same model body with a
one-output token head (``AutoModelForTokenClassification``, head initialised to zero so the first
values are 0): ``compute_values`` gives the value of every token's state and ``train_step``
minimises the clipped value loss against the advantage role's ``returns``. Log-probs are those of
``softmax(logits / T)`` with ``T`` the rollout's sampling temperature (1 when sampling is greedy),
matching the distribution the ``hf`` rollout samples from.

Policies on text models run their forward passes on packed rows (``relax.algo.packing``): no
padding, and each prompt once for all its samples, with an attention mask that keeps every sample
to its own tokens. On the tiny CPU preset that halves the token slots of a step. The model's
attention is checked once to give the same log-probs packed as padded; ``pack_sequences: false``
turns packing off.

Mixture-of-experts routing replay (``TrainerContext.router_replay``, ``relax_plugins.moe_routing``):
with ``r3`` every forward pass over a batch that carries the rollout's ``routed_experts`` routes its
response tokens with them; with ``r2`` a step that takes several updates first records the actor's
own routing over the whole batch (no grad, at the weights the step starts from) and each update
replays it, so later mini-batches are not routed by weights the earlier updates moved.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from relax.contracts import TrainerContext
from relax_plugins.trainer.fsdp import FsdpOptions
from relax_plugins.trainer.steps import TrainerConfig, build_optimizer, logprob_temperature

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


class TorchTrainer:
    """Micro-batched forward/backward with gradient accumulation, grad clipping and one optimizer."""

    #: Inputs the backend accepts: media through the model's own Hugging Face processor
    #: (``relax_plugins.processing``, shared with the hf rollout).
    modalities: ClassVar[frozenset[str]] = frozenset({"text", "image", "audio", "video"})
    parallelism: ClassVar[frozenset[str]] = frozenset({"dp"})
    #: Routing replay modes it honours (Qwen2/Qwen3-MoE routers, ``relax_plugins.moe_routing``).
    router_replay: ClassVar[frozenset[str]] = frozenset({"r2", "r3"})
    #: Trains a LoRA adapter on the frozen model when the context carries one (relax_plugins.trainer.lora).
    lora: ClassVar[bool] = True
    #: Micro-batches by ``max_tokens_per_micro_batch`` (``relax.algo.micro_batches``).
    token_budget: ClassVar[bool] = True

    class Config(TrainerConfig):
        """Options of the torch train backend."""

        pack_sequences: bool = True
        """Run each micro-batch's forward on packed rows (``relax.algo.packing``: no padding, a
        prompt once for all its samples) rather than padded ones. Used only for text policies
        without routing replay, on ``sdpa`` or ``eager`` attention, and only when the model is
        checked, once, to give the same log-probs packed as padded; false always uses padded rows."""
        fsdp: FsdpOptions = Field(default_factory=FsdpOptions)
        """FSDP2: parameters, gradients and optimizer state sharded over the role's data-parallel
        ranks (``relax_plugins.trainer.fsdp``): per decoder layer, with mixed precision,
        activation checkpointing and CPU offload as its options say."""
        packed_attention: Literal["auto", "dense", "flex"] = "auto"
        """How packed rows attend: ``flex`` (PyTorch flex attention with a block mask, the
        variable-length path: memory grows with the blocks the samples touch, so a packed row may be
        up to ``max(16384, max_tokens_per_micro_batch)`` columns wide), ``dense`` (an additive
        capacity x capacity mask on the model's sdpa or eager attention, rows at most 4096 columns),
        or ``auto``: flex on CUDA, dense elsewhere (flex attention has no backward on CPU)."""

    def __init__(self, config: TorchTrainer.Config, context: TrainerContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.context = context
        self.device = torch.device(context.device)
        self.micro_batch_size = int(context.micro_batch_size)
        self.max_tokens = context.max_tokens_per_micro_batch
        """Token budget of a micro-batch (None: ``micro_batch_size`` rows)."""
        self.flex = config.packed_attention == "flex" or (config.packed_attention == "auto"
                                                          and self.device.type == "cuda")
        """Packed rows attend through flex attention's block mask (else the dense mask)."""
        self.slots = [0, 0]
        """Token slots the forward passes since the last reset computed, and how many held a real
        token: ``train/pad_frac`` of a step."""
        self.updates_per_step = int(context.updates_per_step)
        self.temperature = logprob_temperature(config, context)
        torch.manual_seed(context.seed)
        self.model_path = context.model.path
        dtype = getattr(torch, context.model.dtype)
        self.is_critic = context.role == "critic"
        from relax.media import MediaSet

        self.media = MediaSet.from_info(context.media)
        """The run's modality plugins (None for text runs): each row's media are rebuilt from their
        references through the same plugins and processor the rollout used."""
        self.encoder: Any = None
        self._items: Any = None
        """Media tensors per reference, for agentic trajectories (built on first use)."""
        self.masked: list[int] = []
        if self.media is not None:
            if self.is_critic:
                raise ValueError("the torch critic reads text only; a multimodal run (data.media_keys) cannot have "
                                 "roles.critic: use a critic-free algorithm such as grpo")
            from relax_plugins.processing import SampleEncoder, load_processor

            self.processor = load_processor(self.model_path)
            self.tokenizer = self.processor.tokenizer
            self.encoder = SampleEncoder(self.processor, self.media, int(context.max_prompt_tokens))
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.media is not None:
            from relax_plugins.processing import load_policy_model, placeholder_token_ids

            self.model = load_policy_model(self.model_path, dtype, multimodal=True)
            self.masked = placeholder_token_ids(self.model.config)
        elif self.is_critic:
            from transformers import AutoConfig, AutoModelForTokenClassification

            config = AutoConfig.from_pretrained(self.model_path, num_labels=1)
            config.classifier_dropout = 0.0  # a value target needs no dropout noise
            self.model = AutoModelForTokenClassification.from_pretrained(self.model_path, config=config, dtype=dtype)
            head = getattr(self.model, "score", None) or getattr(self.model, "classifier", None)
            if head is None:
                raise ValueError(f"{self.model_path}: the token-classification head of this architecture is "
                                 "neither 'score' nor 'classifier'; the torch critic cannot zero it")
            with torch.no_grad():
                for param in head.parameters():
                    param.zero_()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self.sharded = bool(self.config.fsdp.enabled)
        """The model is sharded over the data-parallel ranks (FSDP2, ``relax_plugins.trainer.fsdp``):
        built whole on the host here, sharded onto the device before the optimizer is built."""
        (self.model if self.sharded else self.model.to(self.device)).eval()
        if context.training is not None and context.training.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.adapter: Any = None
        """The LoRA adapter this role trains or follows (``relax_plugins.trainer.lora``); None: the
        whole model trains and syncs. Attached before the optimizer, which then holds it alone."""
        if context.lora is not None:
            from relax_plugins.trainer.lora import TrainedAdapter

            head = ("score" if hasattr(self.model, "score") else "classifier",) if self.is_critic else ()
            self.adapter = TrainedAdapter(self.model, context.lora, trainable=context.training is not None,
                                          extra_modules_to_save=head, gradient_checkpointing=bool(
                                              context.training is not None and context.training.gradient_checkpointing))
            self.adapter_names, self.adapter_rename = self.adapter.names, self.adapter.rename
        if self.sharded:
            from relax_plugins.trainer.fsdp import shard_model

            _ensure_process_group(self.device)
            shard_model(self.model, self.config.fsdp, self.device, checkpointing=bool(
                context.training is not None and context.training.gradient_checkpointing))
        self.loss = ValueObjective(context.value_clip) if self.is_critic else context.loss
        self.optimizer_info = context.training.optimizer if context.training is not None else None
        self.optimizer = self._build_optimizer() if self.optimizer_info is not None else None
        self.version = 0
        """Optimizer steps taken (the policy version of the current weights)."""
        self.router_replay = context.router_replay
        if self.router_replay != "off":
            from relax_plugins.moe_routing import routers

            if not routers(self.model):
                raise ValueError(f"algorithm.router_replay={self.router_replay} but {self.model_path} is a dense "
                                 "model (no MoE router); set algorithm.router_replay: off")
        self._replay_stats: dict[str, float] = {}
        self._pack: bool | None = None if self.config.pack_sequences and self.encoder is None and not self.is_critic \
            else False
        """Whether policy forwards run on packed rows: None until checked on the first batch."""

    def _build_optimizer(self) -> Any:
        return build_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optimizer_info, "torch")

    # -- forward ----------------------------------------------------------------------------------

    def _logits(self, batch: Any) -> Any:
        if self.router_replay != "off" and batch.routed_experts is not None:
            from relax_plugins.moe_routing import replayed_routing

            with replayed_routing(self.model, batch.routed_experts.to(self.device),
                                  batch.response_mask.to(self.device), self._replay_stats):
                return self._plain_logits(batch)
        return self._plain_logits(batch)

    def _plain_logits(self, batch: Any) -> Any:
        if self.encoder is not None:
            return self._media_logits(batch)
        return self.model(
            input_ids=batch.input_ids.to(self.device),
            attention_mask=batch.attention_mask.to(self.device),
            position_ids=batch.position_ids.to(self.device),
            use_cache=False,
        ).logits

    def model_inputs(self, batch: Any) -> dict[str, Any]:
        """The full model inputs of a multimodal batch: tokens and mask, plus each row's media
        tensors rebuilt from its references by ``relax_plugins.processing`` (the rollout's own
        function). Each row's prompt tokens must equal the ones rebuilt here, so the log-probs
        are recomputed on exactly what the rollout generated from. Positions are left to the
        model (multimodal rotary positions follow from the tokens, the mask and the grids)."""
        from relax.media import loads_context
        from relax_plugins.processing import batch_media

        if batch.media is None:
            raise ValueError("a multimodal run's batch has no media contexts; the 'media' column did not reach "
                             "the trainer (read it with the batch: relax.runtime.worker.rows.token_columns)")
        from relax.media import context_gives_tokens
        from relax_plugins.processing import ItemEncoder, pad_token_ids, placeholder_count

        samples = []
        prompt_part = batch.attention_mask.bool() & ~batch.response_mask.bool()
        for i, context in enumerate(batch.media):
            prompt, refs = loads_context(context)
            if context_gives_tokens(context):
                # An agentic trajectory: its tokens are final; rebuild each media item's tensors and
                # check the row holds exactly the placeholders they expand to.
                if self._items is None:
                    self._items = ItemEncoder(self.processor, self.media)
                sample = self._items(refs)
                pads = pad_token_ids(self.processor)
                row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
                held, expected = placeholder_count(row, pads), placeholder_count(sample.prompt_ids, pads)
                if held != expected:
                    raise RuntimeError(f"row {i}: the trajectory's tokens hold {held} media placeholders but its "
                                       f"{len(refs)} media items expand to {expected}; the rollout and the trainer "
                                       "must use the same processor and media options")
                samples.append(sample)
                continue
            sample = self.encoder(prompt, refs)
            given = batch.input_ids[i][prompt_part[i]].tolist()
            if given != sample.prompt_ids:
                raise RuntimeError(f"row {i}: the rollout generated from {len(given)} prompt tokens but the trainer "
                                   f"rebuilt {len(sample.prompt_ids)} different ones from the same media references; "
                                   "the rollout and the trainer must use the same processor and media options")
            samples.append(sample)
        return {"input_ids": batch.input_ids.to(self.device), "attention_mask": batch.attention_mask.to(self.device),
                **{k: v.to(self.device) for k, v in batch_media(samples).items()}}

    def _media_logits(self, batch: Any) -> Any:
        from relax_plugins.processing import mask_placeholders

        logits = self.model(**self.model_inputs(batch), use_cache=False).logits
        return mask_placeholders(logits, self.masked)

    def _logprobs(self, batch: Any) -> Any:
        """Token log-probs ``[b, t]`` of a (trimmed) micro-batch, with the graph when grad is on."""
        return self._policy_outputs(batch, entropy=False)[0]

    def _policy_outputs(self, batch: Any, entropy: bool, entropy_figure: bool = False) -> tuple[Any, Any]:
        """Token log-probs ``[b, t]`` of a micro-batch and, when ``entropy``, the per-token
        entropies (else None), from one forward pass: on packed rows when packing applies.
        ``entropy_figure``: the entropies too, without a graph (for the ``entropy`` metric only)."""
        import torch

        from relax.algo.batch import token_logprobs

        packed = self._packed(batch)
        self.slots[0] += batch.input_ids.numel() if packed is None else packed.slots
        self.slots[1] += int(batch.attention_mask.sum()) if packed is None else packed.used
        if packed is None:
            logits = self._logits(batch)
            input_ids = batch.input_ids.to(self.device)

            def entropies() -> Any:
                return _token_entropy(logits, self.temperature)
            logprobs = token_logprobs(logits, input_ids, self.temperature)
        else:
            mask = packed.block_mask() if self.flex else packed.attention(self.model.dtype)
            logits = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                attention_mask=mask, use_cache=False).logits

            def entropies() -> Any:
                return packed.token_entropy(logits, self.temperature)
            logprobs = packed.token_logprobs(logits, self.temperature)
        if entropy:
            return logprobs, entropies()
        if entropy_figure:
            with torch.no_grad():
                return logprobs, entropies()
        return logprobs, None

    def _packed(self, batch: Any) -> Any:
        """The micro-batch laid out as packed rows on this device, or None where padded rows are
        used: media models, the critic, routing replay, ``pack_sequences: false``, or a model
        whose attention does not honour packing."""
        if self._pack is False or (self.router_replay != "off" and batch.routed_experts is not None):
            return None
        from relax.algo.packing import WIDEST_DEFAULT, pack_rows

        if self._pack is None:
            if self.flex:
                self.flex = _use_flex_attention(self.model)
            self._pack = _packing_is_exact(self.model, self.device, self.flex)
            if not self._pack:
                return None
        widest = max(4 * WIDEST_DEFAULT, self.max_tokens or 0) if self.flex else WIDEST_DEFAULT
        return pack_rows(batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                         batch.position_ids.to(self.device), batch.response_mask.to(self.device), widest=widest)

    def _values(self, batch: Any) -> Any:
        """Critic values ``[b, t]``: entry t is the value of the state before token t (the head's
        output at column t - 1), the alignment of the log-probs; 0 at column 0."""
        import torch

        self.slots[0] += batch.input_ids.numel()
        self.slots[1] += int(batch.attention_mask.sum())
        head = self._logits(batch)[..., 0].float()
        return torch.nn.functional.pad(head[:, :-1], (1, 0), value=0.0)

    def _objective(self, micro: Any, mismatch: Any = None) -> tuple[Any, dict[str, float]]:
        """The loss of one micro-batch: the value loss (critic) or the policy loss, which gets the
        per-token entropy too when it asks for it (``needs_entropy``). ``mismatch`` (a
        ``relax.algo.mismatch.MismatchTally``) counts the log-probs of the rows generated by the
        version these weights are."""
        if self.is_critic:
            return self.loss.compute(micro, self._values(micro))
        from relax.algo.losses import masked_mean

        wants_entropy = bool(getattr(self.loss, "needs_entropy", False))
        logprobs, entropy = self._policy_outputs(micro, entropy=wants_entropy, entropy_figure=True)
        self._count_mismatch(mismatch, micro, logprobs)
        if wants_entropy:
            loss, metrics = self.loss.compute(micro, logprobs, entropy=entropy)
        else:
            loss, metrics = self.loss.compute(micro, logprobs)
        if "entropy" not in metrics:  # the run's ``entropy`` figure: the policy's, over response tokens
            metrics = {**metrics, "entropy": masked_mean(entropy.detach(), micro.response_mask).item()}
        return loss, metrics

    def _count_mismatch(self, mismatch: Any, micro: Any, logprobs: Any) -> None:
        if mismatch is not None:
            from relax.algo.mismatch import same_version_mask

            mask = same_version_mask(micro.response_mask, micro.policy_version, self.version, micro.token_versions)
            mismatch.add(logprobs, micro.rollout_logprobs, mask, micro.response_mask)

    def compute_logprobs(self, batch: Any) -> Any:
        """``[B, T]`` float32 log-probs of every token under the current weights (CPU, no grad);
        entry t is ``log p(token_t | tokens_<t)``, 0 at column 0."""
        if self.is_critic:
            raise RuntimeError("roles.critic holds a value model: it computes values, not log-probs")
        return self._per_token(batch, self._logprobs)

    def compute_values(self, batch: Any) -> Any:
        """``[B, T]`` float32 critic values (CPU, no grad), aligned like the log-probs."""
        if not self.is_critic:
            raise RuntimeError(f"roles.{self.context.role} is a policy, not a critic: it has no values")
        return self._per_token(batch, self._values)

    def own_routing(self, batch: Any) -> Any:
        """The ``[B, T, layers, k]`` routed-experts column of this model's own routing of the batch
        under the current weights (no grad; the form of the rollout's, ``moe_routing``): what
        ``router_replay: r2`` replays in the step's updates."""
        import torch

        from relax_plugins.moe_routing import recorded_routing

        out = None
        self.model.eval()
        with torch.no_grad():
            for (rows, cols, part), real in self._in_lockstep(list(batch.parts(self.micro_batch_size))):
                with recorded_routing(self.model, *part.input_ids.shape) as recorded:
                    self._plain_logits(part)
                if not real:
                    continue
                table = recorded[0].cpu()
                if out is None:
                    out = torch.zeros((*batch.input_ids.shape, *table.shape[2:]), dtype=torch.uint8
                                      if table.max() < 256 else torch.int32)
                out[rows, cols] = table.to(out.dtype)
        return out

    def compute_base_logprobs(self, batch: Any) -> Any:
        """Like ``compute_logprobs`` under the frozen base model, the LoRA adapter disabled for the
        call: the reference policy of a LoRA run, from the actor's own model (no second copy)."""
        if self.adapter is None:
            raise RuntimeError(f"roles.{self.context.role} trains no LoRA adapter, so it has no base model apart "
                               "from its weights; the reference needs a trainer of its own")
        with self.adapter.disabled():
            return self.compute_logprobs(batch)

    def _per_token(self, batch: Any, forward: Any) -> Any:
        import torch

        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        self.model.eval()
        from relax.algo.micro_batches import micro_batch_parts

        with torch.no_grad():
            parts = list(micro_batch_parts(batch, self.micro_batch_size, self.max_tokens))
            for (rows, cols, part), real in self._in_lockstep(parts):
                result = forward(part)
                if real:
                    out[rows, cols] = result.float().cpu()
        return out

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> dict[str, float]:
        """One training step: ``updates_per_step`` optimizer updates over consecutive mini-batches
        of the batch, each accumulated over micro-batches of ``micro_batch_size`` rows, or of at most
        ``max_tokens_per_micro_batch`` tokens (``relax.algo.micro_batches``).

        A token-mean loss is weighted per micro-batch by its share of the mini-batch's response
        tokens (other losses by their share of rows), so the gradient equals that of the whole
        mini-batch at once. Under ``torch.distributed`` (a default process group of more than one
        rank, set up by the runtime) each rank passes its own shard of the step's samples: the
        shares use the token count of all ranks together and gradients are summed over ranks, so
        every rank takes the update of the whole batch and the replicas stay identical.

        Every update of the step trains at the step's learning rate (``optimizer.lr_schedule`` at
        step ``version``, ``relax.algo.schedules``).

        Returns the mean over updates of ``loss``, ``grad_norm`` (before clipping) and the loss's
        metrics (a policy's include ``entropy``, its mean token entropy over the response tokens),
        plus ``lr`` (the step's), ``tokens`` (this rank's response tokens), ``updates``, ``version``
        and ``pad_frac`` (the share of this rank's forward token slots that held padding);
        a policy also returns the ``mismatch/*`` figures (``relax.algo.mismatch``) of its first
        mini-batch, computed before any optimizer step, over all ranks.
        """
        from relax_plugins.trainer.steps import policy_step

        return policy_step(self, batch)

    # -- the engine under the policy step (relax.contracts.TrainerEngine) ---------------------------

    def data_parallel(self) -> bool:
        """Whether this rank is one of several data-parallel ranks (a default process group of more than one)."""
        return _data_parallel() is not None

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the data-parallel ranks (as they are on one rank)."""
        import torch

        dist = _data_parallel()
        if dist is None:
            return [float(v) for v in values]
        summed = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(summed)
        return [float(v) for v in summed]

    def begin_step(self) -> Any:
        """Reset the step's counters; the step's ``MismatchTally`` (None for the critic)."""
        from relax.algo.mismatch import MismatchTally

        self._replay_stats.clear()
        self.slots = [0, 0]
        return None if self.is_critic else MismatchTally(self.context.mismatch_ratio_bound)

    def forward_backward(self, minibatch: Any, weigh: Any, mismatch: Any) -> None:
        """Forward and backward over the mini-batch's micro-batches (``micro_batch_size`` rows or
        ``max_tokens_per_micro_batch`` tokens), each loss weighted by ``weigh``. A sharded model's
        rank with fewer micro-batches than another repeats its last with weight 0, so the gathers
        and reductions of the ranks pair up."""
        from relax.algo.micro_batches import micro_batches

        micros = list(micro_batches(minibatch, self.micro_batch_size, self.max_tokens))
        for micro, real in self._in_lockstep(micros):
            micro = micro.to(self.device)
            loss, metrics = self._objective(micro, mismatch if real else None)
            (weigh(micro, loss, metrics) if real else loss * 0.0).backward()

    def finish_gradients(self, stats: dict[str, float]) -> float:
        """Sum the gradients (a replica's; a sharded model's backward already summed them) and
        ``stats`` over the data-parallel ranks, clip to ``grad_clip``; the norm before clipping."""
        import torch

        params = [p for p in self.model.parameters() if p.requires_grad]
        dist = _data_parallel()
        if dist is not None:
            _sum_over_ranks(dist, [] if self.sharded else params, stats)
        clip = self.optimizer_info.grad_clip
        return _as_float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))

    def end_step(self, totals: dict[str, float], mismatch: Any) -> tuple[dict[str, float], dict[str, float]]:
        """The step's totals and this engine's figures: ``pad_frac``, ``mismatch/*`` over all
        ranks, and ``router_replay/changed``."""
        from relax.algo.micro_batches import pad_fraction

        figures = {"pad_frac": pad_fraction(*self.slots)}
        if mismatch is not None:
            dist = _data_parallel()
            if dist is not None:
                mismatch.all_reduce(dist)
            figures.update(mismatch.metrics())
        replayed = self._replay_stats.get("replayed", 0.0)
        if replayed:
            # Share of replayed (token, layer) routings whose expert set the current router would
            # have chosen differently: the mismatch replay removed.
            figures["router_replay/changed"] = self._replay_stats.get("changed", 0.0) / replayed
        return totals, figures

    # -- weights and checkpoints -------------------------------------------------------------------

    def shareable_model(self) -> Any:
        """The policy model, for a rollout in this process to generate with directly (colocate
        mode: ``relax.runtime.worker.weight_channels.share_policy_model``); None for a critic, whose
        model is no policy, and for a sharded model (each rank holds only its shards; its rollout
        takes the weights through the extractor instead)."""
        return None if self.is_critic or self.sharded else self.model

    def extractor(self, adapter_only: bool = False, bucket_bytes: int | None = None) -> Any:
        """The weights as ``(name, tensor)`` buckets in the rollouts' (Hugging Face) naming: the
        full ``state_dict`` (a tied ``lm_head.weight`` included), or with ``adapter_only`` only the
        tensors ``adapter_names`` accepts, renamed by ``adapter_rename`` (LoRA). A relax.contracts
        ``WeightExtractor`` (``relax_plugins.trainer.weight_extraction``)."""
        from relax_plugins.trainer.weight_extraction import BUCKET_BYTES, BucketExtractor

        options: dict[str, Any] = {"bucket_bytes": bucket_bytes or BUCKET_BYTES}
        if adapter_only:
            if self.adapter_names is None:
                raise ValueError(f"roles.{self.context.role} trains no adapter, so there are no adapter-only "
                                 "weights to extract; extract the full weights")
            options.update(adapter_only=True, include=self.adapter_names, rename=self.adapter_rename)
        return BucketExtractor(lambda: self.model.state_dict().items(), **options)

    adapter_names: Any = None
    """``name -> bool``: which ``state_dict`` names are an adapter's (None: the model has none)."""
    adapter_rename: Any = None
    """``name -> name``: an adapter tensor's name in the rollout's naming (None: unchanged)."""

    def weights(self) -> dict[str, Any]:
        """The full HF ``state_dict`` (a tied ``lm_head.weight`` included) as detached clones; with a
        LoRA adapter only the adapter's tensors, under their PEFT names."""
        return self.extractor(adapter_only=self.adapter is not None).state_dict()

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        """Replace the weights in place with a full HF ``state_dict`` (how a forward-only role
        such as actor_fwd follows the actor) and record their policy ``version``."""
        from relax_plugins.hf_weights import load_state

        if self.adapter is not None:  # the actor's adapter tensors only (PEFT names)
            self.adapter.load(weights)
        elif self.sharded:  # each rank keeps its own slice of each full tensor
            from relax_plugins.trainer.fsdp import load_full_state

            load_full_state(self.model, weights)
        else:
            load_state(self.model, weights)
        self.version = int(version)

    def save_merged_model(self, path: str) -> bool:
        """With a LoRA adapter whose ``export_merged`` is on, write the model with the adapter merged
        into its weights to ``path`` (a plain Hugging Face folder with the tokenizer, loadable without
        peft; an export's ``merged/``, ``relax.runtime.checkpoint.export_model``); whether it did.
        Only rank 0 writes; a sharded model's ranks all call it (its tensors are gathered)."""
        if self.adapter is None or not self.adapter.info.export_merged:
            return False
        if self.sharded:
            return self._save_merged_sharded(Path(path))
        dist = _data_parallel()
        if dist is not None and dist.get_rank() != 0:
            return False
        self.adapter.save_merged(Path(path))
        (self.processor if self.encoder is not None else self.tokenizer).save_pretrained(path)
        return True

    def save(self, path: str) -> None:
        """Write a checkpoint folder atomically: an HF model folder (safetensors + tokenizer) plus
        ``optimizer.pt`` and ``trainer_state.json``. It is written beside ``path`` and renamed into
        place, so ``path`` is either the old checkpoint or the new one, never half of one. Under data
        parallelism every rank may call it; only rank 0 writes (the replicas are identical)."""
        import torch

        from relax_plugins.trainer.steps import atomic_folder

        if self.sharded:
            return self._save_sharded(path)
        dist = _data_parallel()
        if dist is not None and dist.get_rank() != 0:
            return
        with atomic_folder(path) as staging:
            if self.adapter is not None:  # the adapter alone, as PEFT's folder: the base is the model's own
                self.adapter.save(staging)
            else:
                self.model.save_pretrained(staging, safe_serialization=True)
            # A multimodal checkpoint carries its processor (what AutoProcessor loads), else the tokenizer.
            (self.processor if self.encoder is not None else self.tokenizer).save_pretrained(staging)
            if self.optimizer is not None:
                torch.save(self.optimizer.state_dict(), staging / OPTIMIZER_FILE)
            (staging / STATE_FILE).write_text(json.dumps({"version": self.version}))

    def load(self, path: str) -> None:
        """Restore the weights, the optimizer state and the version from a ``save`` folder."""
        from safetensors.torch import load_file

        from relax_plugins.hf_weights import load_state

        folder = Path(path)
        if self.sharded:
            return self._load_sharded(folder)
        files = sorted(folder.glob("*.safetensors"))
        if self.adapter is not None:  # a LoRA checkpoint holds the adapter alone
            self.adapter.restore(folder)
            files = []
        elif not files:
            raise FileNotFoundError(f"{folder} holds no *.safetensors weights; give a folder written by save()")
        weights: dict[str, Any] = {}
        for file in files:
            weights.update(load_file(str(file), device="cpu"))
        if weights:
            load_state(self.model, weights)
        if self.optimizer is not None and (folder / OPTIMIZER_FILE).is_file():
            self.optimizer.load_state_dict(_load_optimizer_state(folder / OPTIMIZER_FILE, self.device))
        state_file = folder / STATE_FILE
        if state_file.is_file():
            self.version = int(json.loads(state_file.read_text()).get("version", 0))

    # -- sharded (FSDP2) ---------------------------------------------------------------------------

    def _in_lockstep(self, parts: list[Any]) -> list[tuple[Any, bool]]:
        """``(part, real)`` for each of ``parts``, then, for a sharded model, the last part again with
        ``real`` False until this rank runs as many forward passes as the rank with the most: a
        sharded model's forward and backward are collectives that every rank must enter together."""
        out = [(part, True) for part in parts]
        if not self.sharded:
            return out
        import torch
        import torch.distributed as dist

        if not parts:
            raise RuntimeError(f"roles.{self.context.role}: this rank got no rows, but a sharded model needs every "
                               "rank in each forward pass; give each rank at least one row")
        most = torch.tensor([len(parts)], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return out + [(parts[-1], False)] * (int(most) - len(parts))

    def _save_sharded(self, path: str) -> None:
        """A sharded checkpoint, written by every rank together (a collective), atomically as a
        replica's: ``sharded/`` (model and optimizer shards, ``torch.distributed.checkpoint``: what
        ``load`` resumes from exactly; with a LoRA adapter only the adapter's shards and their
        optimizer state), the Hugging Face model folder (weights gathered one bucket at a time by
        ``relax_plugins.trainer.fsdp.export_hf``, config, tokenizer or processor: what
        ``transformers`` loads; with a LoRA adapter PEFT's adapter folder instead) and
        ``trainer_state.json``. Rank 0 names the staging folder
        and renames it into place once every rank has written its shards."""
        import torch.distributed as dist

        from relax_plugins.trainer.fsdp import SHARDED_FOLDER, export_hf, save_sharded, untied_names
        from relax_plugins.trainer.steps import atomic_folder

        first = dist.get_rank() == 0
        with atomic_folder(path) if first else _nothing() as staging:
            names = [str(staging) if first else None]
            dist.broadcast_object_list(names, src=0)
            folder = Path(names[0])
            save_sharded(self.model, self.optimizer, folder / SHARDED_FOLDER, only=self.adapter_names)
            if self.adapter is not None:  # the adapter, gathered (a collective), as PEFT's own folder
                adapter = self.weights()
                if first:
                    self.adapter.save_gathered(adapter, folder)
            else:
                export_hf(self.extractor().buckets(), untied_names(self.model), folder if first else None)
            if first:
                if self.adapter is None:
                    self.model.config.save_pretrained(folder)
                    generation = getattr(self.model, "generation_config", None)
                    if generation is not None:
                        generation.save_pretrained(folder)
                (self.processor if self.encoder is not None else self.tokenizer).save_pretrained(folder)
                (folder / STATE_FILE).write_text(json.dumps({"version": self.version}))
            dist.barrier()  # every rank's shards are in the staging folder before rank 0 renames it
        dist.barrier()  # and the checkpoint is in place before any rank goes on

    def _save_merged_sharded(self, folder: Path) -> bool:
        """``save_merged_model`` of a sharded model, every rank together (a collective): the model's
        tensors gathered one bucket at a time (``export_hf``), each adapted weight merged on rank 0
        as its base weight and adapter arrive (``TrainedAdapter.merged``), so no rank holds the whole
        model. Whether this rank wrote."""
        import torch.distributed as dist

        from relax_plugins.trainer.fsdp import export_hf, untied_names
        from relax_plugins.trainer.lora import merged_name

        first = dist.get_rank() == 0
        buckets = self.extractor().buckets()
        keep = {merged_name(name) for name in untied_names(self.model)} - {None}
        if first:
            folder.mkdir(parents=True, exist_ok=True)
            buckets = self.adapter.merged(buckets)
        export_hf(buckets, keep, folder if first else None)
        if first:
            self.model.config.save_pretrained(folder)
            generation = getattr(self.model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(folder)
            (self.processor if self.encoder is not None else self.tokenizer).save_pretrained(folder)
        dist.barrier()
        return first

    def _load_sharded(self, folder: Path) -> None:
        """Resume a sharded model from a checkpoint folder: its ``sharded/`` state when it has one
        (exactly: weights and optimizer), else its Hugging Face weights (a replica's checkpoint;
        the optimizer starts afresh)."""
        from safetensors.torch import load_file

        from relax_plugins.trainer.fsdp import SHARDED_FOLDER, load_full_state, load_sharded

        if (folder / SHARDED_FOLDER).is_dir():
            load_sharded(self.model, self.optimizer, folder / SHARDED_FOLDER, only=self.adapter_names)
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{folder} holds neither a sharded/ state nor *.safetensors weights; give a "
                                        "folder written by save()")
            weights: dict[str, Any] = {}
            for file in files:
                weights.update(load_file(str(file), device="cpu"))
            load_full_state(self.model, weights)
        state_file = folder / STATE_FILE
        if state_file.is_file():
            self.version = int(json.loads(state_file.read_text()).get("version", 0))


@contextlib.contextmanager
def _nothing() -> Any:
    """What a rank other than 0 writes a sharded checkpoint into: nothing of its own (rank 0's
    staging folder is broadcast)."""
    yield None


def _ensure_process_group(device: Any) -> None:
    """A process group for FSDP2: the role's own when it spans ranks (``relax.runtime.worker.ranks``
    sets it up), else one of a single rank in this process (sharding then only places the weights:
    mixed precision and CPU offload still apply)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def _as_float(value: Any) -> float:
    """A scalar tensor (a ``DTensor`` of a sharded model's gradient norm too) as a float."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)


def _load_optimizer_state(path: Path, device: Any) -> dict[str, Any]:
    """A checkpoint's optimizer state, loaded with ``weights_only=True`` (tensors, numbers, strings and
    containers: unpickling it runs no code); a file that is not such a state is refused naming it."""
    import torch

    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle, zip and torch errors alike: the file is unusable
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path} is not an optimizer state this trainer can load ({reason}); it must be the "
                         f"{OPTIMIZER_FILE} a torch trainer's save() wrote. Delete it to resume with a fresh "
                         "optimizer, or resume from another checkpoint") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not an optimizer state; delete it to resume "
                         "with a fresh optimizer, or resume from another checkpoint")
    return state


def _data_parallel() -> Any:
    """``torch.distributed`` when a default process group of more than one rank is set up, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _sum_over_ranks(dist: Any, params: list[Any], stats: dict[str, float]) -> None:
    """Sum gradients and share-weighted metrics over all ranks, in one flat buffer each."""
    import torch

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0)
    if params:
        dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
    keys = sorted(stats)
    values = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    stats.update({k: float(v) for k, v in zip(keys, values)})


def _use_flex_attention(model: Any) -> bool:
    """Switch ``model`` to Hugging Face's ``flex_attention`` (a packed row's ``BlockMask`` is then
    its attention mask); False, leaving it as it was, where the model or this torch cannot."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401

        model.set_attn_implementation("flex_attention")
    except (ImportError, ValueError, AttributeError):
        return False
    return True


def _packing_is_exact(model: Any, device: Any, flex: bool = False) -> bool:
    """Whether ``model`` computes the same log-probs on packed rows as on padded ones, on a small
    batch where two rows share a prompt and a third stands alone. Packing needs an attention that
    takes an explicit mask (``sdpa`` or ``eager`` with the dense additive one; ``flex_attention``
    with the block mask when ``flex``) and no sliding-window layers (the mask would override the
    window); a model whose attention ignores the mask fails the comparison. Either way the trainer
    keeps padded rows."""
    import torch

    from relax.algo.batch import token_logprobs
    from relax.algo.packing import pack_rows

    config = model.config
    kernels = ("flex_attention",) if flex else ("sdpa", "eager")
    if getattr(config, "_attn_implementation", None) not in kernels or \
            "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return False
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 8), generator=generator)
    ids[1, :4] = ids[0, :4]  # rows 0 and 1: the same prompt, different responses
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    response = torch.zeros(3, 8)
    response[:, 4:] = mask[:, 4:].float()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    packed = pack_rows(ids.to(device), mask.to(device), positions.to(device), response.to(device))
    if packed.input_ids.numel() >= int(mask.sum()):
        return False  # the shared prompt was not shared
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            padded = token_logprobs(model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                          position_ids=positions.to(device), use_cache=False).logits,
                                    ids.to(device)).cpu()
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                           attention_mask=packed.block_mask() if flex else packed.attention(model.dtype),
                           use_cache=False).logits
            flat = packed.token_logprobs(logits).cpu()
    finally:
        model.train(was_training)
    check = mask.bool() & (positions > 0)
    # Round-off of the model's own dtype; attending across sequences moves them far more.
    tolerance = 1e-4 if model.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(flat[check], padded[check].float(), atol=tolerance, rtol=0.0))


def _token_entropy(logits: Any, temperature: float) -> Any:
    """Entropy ``[b, t]`` of the policy's distribution over token t (from the logits at column
    t - 1, scaled by the temperature), aligned like the log-probs; 0 at column 0."""
    import torch

    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.nn.functional.pad(entropy, (1, 0), value=0.0)


class ValueObjective:
    """The critic's loss: the clipped value loss (``relax.algo.losses.value_loss``) of its values
    against the step's ``returns``, around the values it wrote for the step (``batch.values``),
    averaged over response tokens."""

    aggregation = "token-mean"

    def __init__(self, clip: float | None) -> None:
        self.clip = clip

    def compute(self, batch: Any, values: Any) -> tuple[Any, dict[str, float]]:
        from relax.algo.losses import value_loss

        if batch.returns is None or batch.values is None:
            raise ValueError("the critic's batch has no returns or values; they come from the advantage role "
                             "and the critic's own forward pass")
        return value_loss(values, batch.values, batch.returns, batch.response_mask, self.clip)
