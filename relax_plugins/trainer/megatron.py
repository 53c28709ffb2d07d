"""``megatron``: a train backend on Megatron-core's ``GPTModel`` with tensor, pipeline, expert and
data parallelism.

It reads the same Hugging Face folder as the ``torch`` backend, converts it to Megatron's layout
(``relax_plugins.trainer.megatron_weights``), trains with Megatron's parallel layers, and hands
weights and checkpoints back in the HF layout, so rollout backends and ``relax`` checkpoints do not
know which trainer made them. Its contract, log-prob convention (``softmax(logits / T)``, entry t is
``log p(token_t | tokens_<t)``) and step semantics are those of ``torch``; the conformance tests
hold the two to the same losses and gradients, and each parallel layout to the one-process result.

Parallelism comes from ``roles.<role>.parallel``, over Megatron's process groups (rank order tp
fastest, then cp, then dp, then pp: ``initialize_model_parallel``'s default):

- ``tp`` splits every layer over ranks. MoE models run it with sequence parallelism (Megatron
  trains MoE layers under tp only so): each rank normalises and routes its part of every sequence,
  with ``megatron_norm``'s RMSNorm (Megatron's local one asserts against sequence parallelism),
  micro-batch columns padded to a multiple of tp, and the norms' and router's partial gradients
  summed over the tensor-parallel group.
- ``pp`` splits the layers into stages (stage s holds layers ``[s*L/pp, (s+1)*L/pp)``; the
  embedding is on the first, the final norm and output layer on the last). Micro-batches go
  through the stages in a fill-drain (GPipe) schedule over point-to-point sends: every forward,
  then every backward in reverse (so a stage holds the activations of all of a mini-batch's
  micro-batches, where 1F1B would hold pp of them). Megatron's own schedules cannot run here: they
  create a ``device="cuda"`` tensor unconditionally (``torch.zeros([], device="cuda")`` in
  ``pipeline_parallel/schedules.py``). Tied embeddings keep a copy of the embedding on the last
  stage whose gradient is all-reduced with the first stage's over Megatron's embedding group (the
  trainer's own copy: Megatron's sharing calls ``weight.data.cuda()`` while building).
  Loss and metrics are computed on the last stage and broadcast over the stage's pipeline group;
  log-probs are sent back to every stage.
- ``ep`` splits a MoE model's experts over ranks carved out of the data-parallel ones (so ep must
  divide the data-parallel size); tokens reach their experts through Megatron's all-gather
  dispatcher, which needs every expert-parallel peer to pass micro-batches of the same shape, so
  those are padded to the largest of the peers (padding rows and right-padding columns, which no
  real token attends to). Expert gradients are summed over the expert-data-parallel group.
- The ranks left over (world size / (tp x pp)) are data parallel: each is given its own rows.
- ``cp`` is refused: megatron-core 0.16.1 runs context parallelism only in Transformer Engine's
  attention (its local ``DotProductAttention`` asserts ``context_parallel_size == 1``), and TE needs
  CUDA.

Process groups, the vocabulary-parallel log-probs and the gradient reductions live in
``relax_plugins.trainer.megatron_parallel``. ``torch.distributed`` is initialised if the caller has not done so (gloo on CPU, nccl on CUDA;
world size and rank from the usual ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
variables, else a single process). Every method is a collective: every rank calls it. Each rank is
given the batch rows of its data-parallel index (the same rows for all tp/pp/ep peers of one index).

megatron-core needs CUDA for two things a CPU run reaches (``torch.cuda.current_device`` and the
tensor-parallel RNG tracker); it runs on CPU only in a process where something has stood in for
them first, as the tests' harness does (``tests/backends/megatron_cpu.py``). This module never
patches them itself.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar


from relax.contracts import TrainerContext
from relax_plugins.trainer.megatron_parallel import (
    all_reduce_grads,
    attention_mask,
    check_cuda_stand_ins,
    check_model_parallel_sizes,
    check_moe_router,
    data_parallel_group,
    init_distributed,
    init_model_parallel,
    sequence_parallel_block,
    vocab_parallel_token_stats,
    wait_sends,
)
from relax_plugins.trainer.steps import (
    TrainerConfig,
    add_weighted,
    atomic_folder,
    build_optimizer,
    logprob_temperature,
    micro_batch_share,
    minibatch_bounds,
    step_result,
)

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
#: Files of the source model folder copied into every checkpoint beside the weights.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")
#: Megatron's name of the embedding, whose copy the last pipeline stage holds when it is tied.
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class MicroBatch:
    """One micro-batch as the model runs it: the rows it scores (None for a stand-in that only
    keeps the expert-parallel peers' collectives in step) and the ``(rows, columns)`` it is padded to."""

    index: int
    batch: Any
    shape: tuple[int, int]


class MegatronTrainer:
    """Micro-batched forward/backward on a Megatron ``GPTModel``, gradient accumulation, grad
    clipping and one optimizer, with the ``torch`` backend's contract."""

    modalities: ClassVar[frozenset[str]] = frozenset({"text"})
    #: Tensor, pipeline and expert parallelism split the model; the remaining ranks are data
    #: parallel. cp is refused at build time with a message (it needs Transformer Engine).
    parallelism: ClassVar[frozenset[str]] = frozenset({"dp", "tp", "pp", "ep"})
    #: Each data-parallel rank holds a full replica of its tensor/pipeline shard (and, for MoE, its
    #: expert-parallel share of the experts) and its own optimizer state (no distributed optimizer
    #: yet); the planner divides by tp x pp (and ep for experts) only.
    memory_sharding: ClassVar[str] = "none"
    #: Under pp the first stage holds the activations of every micro-batch of a mini-batch (the
    #: fill-drain schedule, not 1F1B's pp in flight); the planner's estimate follows it.
    pipeline_schedule: ClassVar[str] = "fill-drain"

    class Config(TrainerConfig):
        """Options of the Megatron train backend."""

    def __init__(self, config: MegatronTrainer.Config, context: TrainerContext) -> None:
        import torch

        from relax_plugins.trainer.megatron_weights import check_tensor_parallel, layout_from_hf_config

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.context = context
        if context.role == "critic":
            raise ValueError("roles.critic: the megatron trainer has no value head yet; set "
                             "roles.critic.backend: torch")
        self.model_path = Path(context.model.path)
        config_file = self.model_path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.model_path} has no config.json; the megatron trainer needs a local "
                                    "Hugging Face model folder")
        self.layout = layout_from_hf_config(json.loads(config_file.read_text()))
        par = context.parallel
        self.tp, self.pp, self.ep = int(par.tp), int(par.pp), int(par.ep)
        # Megatron trains MoE layers under tensor parallelism only with sequence parallelism.
        self.sequence_parallel = self.layout.is_moe and self.tp > 1
        check_model_parallel_sizes(self.layout, self.tp, self.pp, self.ep, int(par.cp), context.role)
        check_tensor_parallel(self.layout, self.tp)
        self.device = torch.device(context.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # one GPU per rank: the launcher's LOCAL_RANK picks it
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, context.model.dtype)
        self.micro_batch_size = int(context.micro_batch_size)
        self.updates_per_step = int(context.updates_per_step)
        self.temperature = logprob_temperature(config, context)
        self.gradient_checkpointing = context.training is not None and context.training.gradient_checkpointing
        if self.gradient_checkpointing and self.device.type != "cuda":
            raise ValueError(f"roles.{context.role}.gradient_checkpointing: Megatron's activation recomputation "
                             "saves and restores CUDA RNG states, so it needs a GPU; set it to false on CPU")
        init_distributed(self.device)
        init_model_parallel(self.tp, self.pp, self.ep, context.role)
        check_cuda_stand_ins(self.device, context.seed)
        if self.layout.is_moe:
            check_moe_router()
        torch.manual_seed(context.seed)
        self.model = self._build_model()
        self._load_hf(_read_safetensors(self.model_path))
        self.model.eval()
        self.loss = context.loss
        self.optimizer_info = context.training.optimizer if context.training is not None else None
        self.optimizer = self._build_optimizer() if self.optimizer_info is not None else None
        self.version = 0
        """Optimizer steps taken (the policy version of the current weights)."""

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel index (Megatron's): the rows it is given are that share's."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel shares: world size / (tp x pp)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    # -- building --------------------------------------------------------------------------------

    def _build_model(self) -> Any:
        import torch
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        from relax_plugins.trainer.megatron_weights import padded_vocab_size

        layout = self.layout
        moe: dict[str, Any] = {}
        if layout.is_moe:
            moe = dict(num_moe_experts=layout.num_experts, moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
                       moe_router_topk=layout.moe_top_k, moe_router_pre_softmax=not layout.moe_renormalize,
                       moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                       moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                       expert_model_parallel_size=self.ep)
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if self.gradient_checkpointing else {}
        config = TransformerConfig(
            num_layers=layout.num_layers, hidden_size=layout.hidden_size,
            num_attention_heads=layout.num_heads, num_query_groups=layout.num_kv_heads,
            kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=layout.norm_eps,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=layout.qkv_bias, qk_layernorm=layout.qk_norm,
            hidden_dropout=0.0, attention_dropout=0.0,
            # Megatron's fused kernels are CUDA-only or need apex/TE; the plain paths are exact.
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=self.tp, sequence_parallel=self.sequence_parallel,
            pipeline_model_parallel_size=self.pp, pipeline_dtype=self.dtype,
            params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False,  # every weight is loaded from the checkpoint next
            **moe, **recompute,
        )
        spec = get_gpt_layer_local_spec(num_experts=layout.num_experts or None, moe_grouped_gemm=False,
                                        qk_layernorm=layout.qk_norm, normalization="RMSNorm")
        if self.sequence_parallel:
            spec = sequence_parallel_block(spec, config, qk_norm=layout.qk_norm)
        model = GPTModel(
            config=config, transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(layout, self.tp), max_sequence_length=layout.max_positions,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            # Under pp the last stage keeps its own copy of a tied embedding (see _tied_weight):
            # Megatron's sharing moves the copy to CUDA while building (``weight.data.cuda()``).
            share_embeddings_and_output_weights=layout.tied_embeddings and self.pp == 1,
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=layout.rope_theta,
        )
        # Megatron numbers a stage's layers and a rank's experts from 0; these map them to the full model.
        self._layer_offset = model.decoder.layers[0].layer_number - 1
        self._expert_offset = parallel_state.get_expert_model_parallel_rank() * (layout.num_experts // self.ep)
        return model.to(self.device)

    def _build_optimizer(self) -> Any:
        return build_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optimizer_info,
                               "megatron")

    def _local_state(self) -> dict[str, Any]:
        """This rank's Megatron weights by their local name (``_extra_state`` entries left out)."""
        return {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    def _global_name(self, name: str) -> str:
        """The full model's Megatron name of this rank's weight ``name``; the last stage's copy of a
        tied embedding is named after the embedding."""
        from relax_plugins.trainer.megatron_weights import global_name

        if name == "output_layer.weight" and self.layout.tied_embeddings:
            return EMBEDDING
        return global_name(name, self._layer_offset, self._expert_offset)

    def _load_hf(self, hf: dict[str, Any]) -> None:
        """Copy a full HF ``state_dict`` into this rank's shard of the model, checking every name."""
        import torch
        from megatron.core import parallel_state

        from relax_plugins.trainer.megatron_weights import hf_to_megatron, shard

        full = hf_to_megatron(hf, self.layout)
        mine = shard(full, self.layout, parallel_state.get_tensor_model_parallel_rank(), self.tp)
        local = {self._global_name(k): v for k, v in self._local_state().items()}
        missing = sorted(set(local) - set(mine))
        # One stage or one expert-parallel rank holds only part of the model: the rest is another's.
        unexpected = sorted(set(mine) - set(local)) if self.pp == self.ep == 1 else []
        if missing or unexpected:
            raise ValueError(f"converted weights do not fit the Megatron model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}; this is a bug in the {self.layout.model_type} mapping")
        with torch.no_grad():
            for name, tensor in local.items():
                if tensor.shape != mine[name].shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(mine[name].shape)} != model shape "
                                     f"{tuple(tensor.shape)}; the checkpoint is of another model size")
                tensor.copy_(mine[name])

    # -- running micro-batches through the stages ---------------------------------------------------

    def _micro_batches(self, parts: list[Any]) -> list[MicroBatch]:
        """The micro-batches to run for this rank's ``parts`` (trimmed micro-batches). Under sequence
        parallelism the columns are padded to a multiple of tp. Under expert parallelism the peers
        all-gather their tokens, so they must run the same number of micro-batches of the same
        shapes: each is padded to the peers' largest, and a rank with fewer runs stand-ins."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        shapes = [tuple(part.input_ids.shape) for part in parts]
        if self.sequence_parallel:  # the sequence splits into tp equal parts
            shapes = [(rows, -(-cols // self.tp) * self.tp) for rows, cols in shapes]
        if self.ep == 1:
            return [MicroBatch(i, part, shape) for i, (part, shape) in enumerate(zip(parts, shapes))]
        group = parallel_state.get_expert_tensor_and_model_parallel_group()
        count = torch.tensor([len(parts)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        table = torch.zeros(int(count), 2, dtype=torch.int64, device=self.device)
        if shapes:
            table[:len(shapes)] = torch.tensor(shapes, dtype=torch.int64, device=self.device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        parts = parts + [None] * (int(count) - len(parts))
        return [MicroBatch(i, part, (int(rows), int(cols))) for i, (part, (rows, cols)) in
                enumerate(zip(parts, table.tolist()))]

    def _model_inputs(self, micro: MicroBatch) -> dict[str, Any]:
        """The model's keyword inputs for ``micro``, padded (below and to the right) to its shape."""
        import torch

        rows, cols = micro.shape
        tensors = {"input_ids": torch.zeros(rows, cols, dtype=torch.int64),
                   "position_ids": torch.zeros(rows, cols, dtype=torch.int64),
                   "attention_mask": torch.zeros(rows, cols, dtype=torch.int64)}
        if micro.batch is not None:
            r, c = micro.batch.input_ids.shape
            if (r, c) == (rows, cols):
                tensors = {k: getattr(micro.batch, k) for k in tensors}
            else:
                for key, tensor in tensors.items():
                    tensor[:r, :c] = getattr(micro.batch, key)
        mask = attention_mask(tensors["attention_mask"].to(self.device))
        return {"input_ids": tensors["input_ids"].to(self.device),
                "position_ids": tensors["position_ids"].to(self.device), "attention_mask": mask}

    def _run(self, micros: list[MicroBatch], on_logits: Callable[[MicroBatch, Any], Any], train: bool) -> None:
        """Run ``micros`` through the model, and backward when ``train``. On the last stage
        ``on_logits(micro, logits)`` gets each real micro-batch's logits (its own rows and columns)
        and returns the loss to backpropagate (when training).

        Without pipeline parallelism each micro-batch goes forward and backward in turn. With it,
        the stages run a fill-drain schedule: every micro-batch forward (receiving hidden states
        from the previous stage, sending them on), then every backward in reverse order (receiving
        the gradient from the next stage, sending the input's gradient back). Each phase sends in
        one direction only, so blocking receives cannot deadlock."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        group = parallel_state.get_pipeline_model_parallel_group() if self.pp > 1 else None
        held: list[tuple[Any, Any]] = []
        sends: list[tuple[Any, Any]] = []
        for micro in micros:
            inputs = self._model_inputs(micro)
            received = None
            if not first:
                rows, cols = micro.shape
                if self.sequence_parallel:
                    cols //= self.tp
                received = torch.empty(cols, rows, self.layout.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank(), group=group)
                received.requires_grad_(train)
                self.model.set_input_tensor(received)
            output = self.model(**inputs)
            if last:
                if micro.batch is not None:
                    rows, cols = micro.batch.input_ids.shape
                    output = on_logits(micro, output[:rows, :cols])
                elif train:  # a stand-in: no loss, but its backward runs the peers' collectives
                    output = output.sum() * 0.0
            else:
                sent = output.detach().contiguous()
                sends.append((dist.isend(sent, dst=parallel_state.get_pipeline_model_parallel_next_rank(),
                                         group=group), sent))
            if not train:
                continue
            if self.pp == 1:
                output.backward()
            else:
                held.append((received, output))
        wait_sends(sends)
        for received, output in reversed(held):
            if last:
                output.backward()
            else:
                grad = torch.empty_like(output)
                dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank(), group=group)
                output.backward(grad)
            if not first:
                sent = received.grad.contiguous()
                sends.append((dist.isend(sent, dst=parallel_state.get_pipeline_model_parallel_prev_rank(),
                                         group=group), sent))
        wait_sends(sends)

    def _tied_weight(self) -> Any:
        """Under pipeline parallelism with tied embeddings, this stage's copy of the embedding: the
        first stage's embedding or the last stage's output layer, kept equal by summing their
        gradients over Megatron's embedding group (as its ``finalize_model_grads`` does). None
        on other stages and otherwise."""
        from megatron.core import parallel_state

        if self.pp == 1 or not self.layout.tied_embeddings or not parallel_state.is_rank_in_embedding_group():
            return None
        if parallel_state.is_pipeline_first_stage():
            return self.model.embedding.word_embeddings.weight
        return self.model.output_layer.weight

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` as the last pipeline stage has it (a tensor or a picklable object), on every stage."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.pp == 1:
            return value
        group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        if isinstance(value, torch.Tensor):
            moved = value.to(self.device)
            dist.broadcast(moved, src=src, group=group)
            return moved.to(value.device)
        box = [value]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # -- forward ----------------------------------------------------------------------------------

    def compute_logprobs(self, batch: Any) -> Any:
        """``[B, T]`` float32 log-probs of every token under the current weights (CPU, no grad);
        entry t is ``log p(token_t | tokens_<t)``, 0 at column 0. Every stage returns them (the last
        stage computes them and broadcasts them over its pipeline group)."""
        import torch

        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        places, parts = [], []
        for start in range(0, batch.batch_size, self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            part = batch.select(rows)
            cols = part.used_columns()
            places.append((rows, cols))
            parts.append(part.select_columns(cols))

        def on_logits(micro: MicroBatch, logits: Any) -> None:
            ids = micro.batch.input_ids.to(self.device)
            stats = vocab_parallel_token_stats(logits, ids, self.temperature, self.layout.vocab_size)[0]
            out[places[micro.index]] = stats.float().cpu()

        self.model.eval()
        with torch.no_grad():
            self._run(self._micro_batches(parts), on_logits, train=False)
        return self._from_last_stage(out)

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> dict[str, float]:
        """One training step: ``updates_per_step`` optimizer updates over consecutive mini-batches
        of the batch, each accumulated over micro-batches of ``micro_batch_size`` rows.

        The same semantics as the ``torch`` backend: each micro-batch's loss is weighted by its share
        of the mini-batch (``micro_batch_share``), so the gradient is that of the whole mini-batch.
        Data-parallel ranks each pass their own shard of the step's samples; shares count the
        tokens of all of them and gradients are summed over them (expert gradients over the
        expert-data-parallel group). The tensor, pipeline and expert-parallel peers of one
        data-parallel index must be given the same samples.

        Returns, on every rank, the mean over updates of ``loss``, ``grad_norm`` (before clipping,
        over the whole model) and the loss's metrics, summed over data-parallel ranks, plus ``lr``,
        ``tokens`` (this rank's response tokens), ``updates`` and ``version``.
        """
        import torch
        from megatron.core import parallel_state

        if self.optimizer is None or self.loss is None:
            raise RuntimeError(f"roles.{self.context.role} is forward-only (no optimizer or loss); "
                               "it can compute log-probs but not train")
        dp_group = data_parallel_group()
        updates = self.updates_per_step
        if dp_group is not None and batch.batch_size < updates:
            raise ValueError(f"this rank got {batch.batch_size} samples, fewer than "
                             f"algorithm.updates_per_step={updates}; give each rank at least that many")
        wants_entropy = bool(getattr(self.loss, "needs_entropy", False))
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        last = parallel_state.is_pipeline_last_stage()
        totals: dict[str, float] = {}
        taken = 0
        self.model.train()
        for lo, hi in minibatch_bounds(batch.batch_size, updates):
            minibatch = batch.select(slice(lo, hi))
            tokens, rows = float(minibatch.num_response_tokens), float(minibatch.batch_size)
            if dp_group is not None:
                counts = torch.tensor([tokens, rows], dtype=torch.float64, device=self.device)
                torch.distributed.all_reduce(counts, group=dp_group)
                tokens, rows = float(counts[0]), float(counts[1])
            self.optimizer.zero_grad(set_to_none=True)
            stats: dict[str, float] = {}

            def on_logits(micro: MicroBatch, logits: Any, tokens: float = tokens, rows: float = rows,
                          stats: dict[str, float] = stats) -> Any:
                part = micro.batch.to(self.device)
                share = micro_batch_share(self.loss, part, tokens, rows)
                logprobs, entropy = vocab_parallel_token_stats(logits, part.input_ids, self.temperature,
                                                               self.layout.vocab_size, wants_entropy)
                if wants_entropy:
                    loss, metrics = self.loss.compute(part, logprobs, entropy=entropy)
                else:
                    loss, metrics = self.loss.compute(part, logprobs)
                add_weighted(stats, float(loss.item()), metrics, share)
                return loss * share

            self._run(self._micro_batches(list(minibatch.split(self.micro_batch_size))), on_logits, train=True)
            self._reduce_grads(named, dp_group, stats if last else None)
            stats["grad_norm"] = self._clip_grad_norm(named, self.optimizer_info.grad_clip)
            self.optimizer.step()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            taken += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.version += 1
        totals = self._from_last_stage(totals)
        return step_result(totals, taken, batch.num_response_tokens, self.optimizer, self.version)

    def _reduce_grads(self, named: list[tuple[str, Any]], dp_group: Any, stats: dict[str, float] | None) -> None:
        """Complete this rank's gradients: the tensor-parallel parts of replicated weights summed,
        a tied embedding's two pipeline copies summed, dense gradients (and the stats, on the last
        stage) summed over the data-parallel group, expert ones over the expert-data-parallel group."""
        import torch
        from megatron.core import parallel_state

        from relax_plugins.trainer.megatron_weights import grad_summed_over_tensor_parallel, is_expert

        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.tp > 1:
            partial = [p for name, p in named
                       if grad_summed_over_tensor_parallel(name) or getattr(p, "sequence_parallel", False)]
            if partial:
                all_reduce_grads(partial, parallel_state.get_tensor_model_parallel_group())
        tied = self._tied_weight()
        if tied is not None:
            all_reduce_grads([tied], parallel_state.get_embedding_group())
        if dp_group is not None:
            dense = [p for name, p in named if not is_expert(name)]
            all_reduce_grads(dense, dp_group)
            if stats is not None:
                keys = sorted(stats)
                values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
                torch.distributed.all_reduce(values, group=dp_group)
                stats.update({k: float(v) for k, v in zip(keys, values)})
        experts = [p for name, p in named if is_expert(name)]
        if experts and parallel_state.get_expert_data_parallel_world_size() > 1:
            all_reduce_grads(experts, parallel_state.get_expert_data_parallel_group())

    def _clip_grad_norm(self, named: list[tuple[str, Any]], max_norm: float) -> float:
        """The global gradient norm over the whole model, before clipping; gradients are scaled as
        ``torch.nn.utils.clip_grad_norm_`` scales them when ``max_norm > 0``. A weight every
        tensor-parallel rank holds (norms, the router) is counted once, as is a tied embedding
        (on the first stage); dense squares are summed over the model-parallel group (tp x pp),
        expert ones over the expert-tensor-model-pipeline group (tp x ep x pp)."""
        import torch
        from megatron.core import parallel_state

        from relax_plugins.trainer.megatron_weights import is_expert, is_split

        first = parallel_state.get_tensor_model_parallel_rank() == 0
        last_stage_copy = self._tied_weight() if not parallel_state.is_pipeline_first_stage() else None
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in named:
            if p.grad is None or p is last_stage_copy or not (first or is_split(name)):
                continue
            square = p.grad.detach().double().pow(2).sum()
            if is_expert(name):
                experts += square
            else:
                dense += square
        if self.tp * self.pp > 1:
            torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if self.layout.is_moe and self.tp * self.pp * self.ep > 1:
            torch.distributed.all_reduce(experts,
                                         group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        norm = float((dense + experts).sqrt())
        if max_norm > 0:
            coef = min(max_norm / (norm + 1e-6), 1.0)
            if coef < 1.0:
                for _, p in named:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm

    # -- weights and checkpoints -------------------------------------------------------------------

    def _full_megatron_state(self) -> dict[str, Any]:
        """The full Megatron weights on CPU, on every rank (a collective: the tensor-parallel shards
        are joined over the tensor-parallel group, then the stages and expert shares over all ranks)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        from relax_plugins.trainer.megatron_weights import is_expert, unshard

        last_stage_copy = self.pp > 1 and self.layout.tied_embeddings and not parallel_state.is_pipeline_first_stage()
        local = {self._global_name(k): v.detach() for k, v in self._local_state().items()
                 if not (last_stage_copy and k == "output_layer.weight")}
        if self.tp == 1:
            full = {k: v.cpu() for k, v in local.items()}
        else:
            group = parallel_state.get_tensor_model_parallel_group()
            shards: list[dict[str, Any]] = [{} for _ in range(self.tp)]
            for name, tensor in local.items():
                parts = [torch.empty_like(tensor) for _ in range(self.tp)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                for rank, part in enumerate(parts):
                    shards[rank][name] = part.cpu()
            full = unshard(shards, self.layout)
        if self.pp == self.ep == 1:
            return full
        # One copy of each weight: a stage's dense weights from its first data-parallel rank, a
        # rank's experts from the first of its expert-data-parallel group.
        keep = {}
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            dense_owner = parallel_state.get_data_parallel_rank() == 0
            expert_owner = parallel_state.get_expert_data_parallel_rank() == 0
            keep = {k: v for k, v in full.items() if (expert_owner if is_expert(k) else dense_owner)}
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, keep)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    def weights(self) -> dict[str, Any]:
        """The full HF ``state_dict`` (a tied ``lm_head.weight`` included) as detached CPU clones, on
        every rank. Every rank must call it (it gathers the shards and the stages)."""
        from relax_plugins.trainer.megatron_weights import megatron_to_hf

        return {k: v.clone() for k, v in megatron_to_hf(self._full_megatron_state(), self.layout).items()}

    def save(self, path: str) -> None:
        """Write a checkpoint folder atomically: an HF model folder (``model.safetensors``, the
        source folder's config and tokenizer files) plus ``optimizer.pt`` (the optimizer state of
        every model-parallel rank: each tp x pp x ep coordinate) and ``trainer_state.json``. It is
        written beside ``path`` and renamed into place, so ``path`` is either the old checkpoint or
        the new one. Every rank calls it (a collective); global rank 0 writes, and no rank returns
        before the folder is in place."""
        import torch.distributed as dist

        from relax_plugins.trainer.megatron_weights import megatron_to_hf

        # The checkpoint (file) layout: per-expert MoE matrices, as save_pretrained writes them.
        weights = {k: v.clone() for k, v in
                   megatron_to_hf(self._full_megatron_state(), self.layout, fused_experts=False).items()}
        if self.layout.tied_embeddings:
            weights.pop("lm_head.weight")  # as HF save_pretrained writes a tied model
        optimizer_states = self._gather_optimizer_states()
        try:
            if dist.get_rank() == 0:
                self._write_checkpoint(path, weights, optimizer_states)
        finally:  # no rank returns (and, say, loads it) before the folder is in place
            dist.barrier()

    def _write_checkpoint(self, path: str, weights: dict[str, Any], optimizer_states: list[Any] | None) -> None:
        import torch
        from safetensors.torch import save_file

        with atomic_folder(path) as staging:
            for name in MODEL_FILES:
                if (self.model_path / name).is_file():
                    shutil.copy2(self.model_path / name, staging / name)
            save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / WEIGHTS_FILE),
                      metadata={"format": "pt"})
            if optimizer_states is not None:
                torch.save({"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "expert_parallel": self.ep,
                            "ranks": optimizer_states}, staging / OPTIMIZER_FILE)
            (staging / STATE_FILE).write_text(json.dumps({"version": self.version, "backend": "megatron"}))

    def _model_parallel_index(self) -> int:
        """This rank's place among the model-parallel coordinates: ``(pp_rank * ep + ep_rank) * tp +
        tp_rank`` (the tensor-parallel rank alone when there is no pp or ep)."""
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        return (pp_rank * self.ep + ep_rank) * self.tp + parallel_state.get_tensor_model_parallel_rank()

    def _gather_optimizer_states(self) -> list[dict[str, Any]] | None:
        """On global rank 0, every model-parallel rank's optimizer ``state_dict`` in
        ``_model_parallel_index`` order (None on the other ranks, and if forward-only)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.optimizer is None:
            return None
        mine = _to_cpu(self.optimizer.state_dict())
        if dist.get_world_size() == 1:
            return [mine]
        # Dense weights' states are the same on every data-parallel rank, experts' on every
        # expert-data-parallel rank: the first of each expert-data-parallel group holds a full set.
        entry = (self._model_parallel_index(), mine) if parallel_state.get_expert_data_parallel_rank() == 0 else None
        entries: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(entry, entries, dst=0)
        if dist.get_rank() != 0:
            return None
        states: list[Any] = [None] * (self.tp * self.pp * self.ep)
        for item in entries:
            if item is not None:
                states[item[0]] = item[1]
        return states

    def load(self, path: str) -> None:
        """Restore the weights, the optimizer state and the version from a ``save`` folder (or the
        weights alone from any HF folder of the same model). Every rank calls it."""
        import torch

        folder = Path(path)
        self._load_hf(_read_safetensors(folder))
        optimizer_file = folder / OPTIMIZER_FILE
        if self.optimizer is not None and optimizer_file.is_file():
            saved = torch.load(optimizer_file, map_location="cpu", weights_only=False)
            if not isinstance(saved, dict) or "ranks" not in saved:
                raise ValueError(f"{optimizer_file} was not written by the megatron trainer (another backend's "
                                 "optimizer state); load the weights only, from a folder without it")
            have = {"tp": self.tp, "pp": self.pp, "ep": self.ep}
            was = {"tp": saved["tensor_parallel"], "pp": saved.get("pipeline_parallel", 1),
                   "ep": saved.get("expert_parallel", 1)}
            if was != have:
                show = lambda sizes: ", ".join(f"{k}={v}" for k, v in sizes.items())  # noqa: E731
                raise ValueError(f"{optimizer_file} holds the optimizer state of {show(was)} but this trainer runs "
                                 f"{show(have)}; resume with the same tp, pp and ep")
            self.optimizer.load_state_dict(saved["ranks"][self._model_parallel_index()])
        state_file = folder / STATE_FILE
        if state_file.is_file():
            self.version = int(json.loads(state_file.read_text()).get("version", 0))


def _read_safetensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights; give an HF model folder (or one "
                                "written by save())")
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(load_file(str(file), device="cpu"))
    return weights


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
