"""``megatron``: a train backend on Megatron-core's ``GPTModel`` with tensor and data parallelism.

It reads the same Hugging Face folder as the ``torch`` backend, converts it to Megatron's layout
(``relax_plugins.trainer.megatron_weights``), trains with Megatron's tensor-parallel layers, and
hands weights and checkpoints back in the HF layout, so rollout backends and ``relax`` checkpoints
do not know which trainer made them. Its contract, log-prob convention (``softmax(logits / T)``,
entry t is ``log p(token_t | tokens_<t)``) and step semantics are those of ``torch``; the
conformance tests hold the two to the same losses and gradients.

Parallelism comes from ``roles.<role>.parallel``: ``tp`` splits every layer over ranks; the ranks
left over (world size / tp) are data parallel. Pipeline, context and expert parallelism are
refused at build time (not wired up here yet). ``torch.distributed`` is initialised if the caller
has not done so (gloo on CPU, nccl on CUDA; world size and rank from the usual ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` variables, else a single process).

megatron-core needs CUDA for two things a CPU run reaches (``torch.cuda.current_device`` and the
tensor-parallel RNG tracker); it runs on CPU only in a process where something has stood in for
them first, as the tests' harness does (``tests/backends/megatron_cpu.py``). This module never
patches them itself.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, ClassVar


from relax.contracts import BackendContext
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


class MegatronTrainer:
    """Micro-batched forward/backward on a Megatron ``GPTModel``, gradient accumulation, grad
    clipping and one optimizer, with the ``torch`` backend's contract."""

    modalities: ClassVar[frozenset[str]] = frozenset({"text"})
    #: Tensor parallelism splits the layers; the remaining ranks are data parallel. pp, cp and ep
    #: are refused at build time with a message.
    parallelism: ClassVar[frozenset[str]] = frozenset({"dp", "tp"})
    #: Each data-parallel rank holds a full replica of its tensor-parallel shard and its own
    #: optimizer state (no distributed optimizer yet); the planner divides by tp only.
    memory_sharding: ClassVar[str] = "none"

    class Config(TrainerConfig):
        """Options of the Megatron train backend."""

    def __init__(self, config: MegatronTrainer.Config, context: BackendContext) -> None:
        import torch

        from relax_plugins.trainer.megatron_weights import check_tensor_parallel, layout_from_hf_config

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.context = context
        spec = context.spec
        if context.role == "critic":
            raise ValueError("roles.critic: the megatron trainer has no value head yet; set "
                             "roles.critic.backend: torch")
        self.role = getattr(spec.roles, context.role)
        if self.role is None:
            raise ValueError(f"roles.{context.role} is not in the spec; the megatron trainer has nothing to run")
        self.model_path = Path(context.model_path)
        config_file = self.model_path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.model_path} has no config.json; the megatron trainer needs a local "
                                    "Hugging Face model folder")
        self.layout = layout_from_hf_config(json.loads(config_file.read_text()))
        par = self.role.parallel
        self.tp = int(par.tp)
        refused = {key: size for key, size in (("pp", par.pp), ("cp", par.cp), ("ep", par.ep)) if size != 1}
        if refused:
            raise ValueError(f"roles.{context.role}.parallel: {', '.join(f'{k}={v}' for k, v in refused.items())} is "
                             "not supported by the megatron trainer yet (it runs tp and data parallelism); set "
                             f"{', '.join(refused)} to 1")
        check_tensor_parallel(self.layout, self.tp)
        if self.layout.is_moe and self.tp > 1:
            raise ValueError(f"roles.{context.role}.parallel.tp={self.tp}: megatron-core trains MoE layers under "
                             "tensor parallelism only with sequence parallelism, which its local RMSNorm (used here, "
                             "without Transformer Engine) does not support; use tp=1 for this "
                             f"{self.layout.model_type} model (data parallelism still applies)")
        self.device = torch.device(context.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # one GPU per rank: the launcher's LOCAL_RANK picks it
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, spec.model.dtype)
        self.micro_batch_size = int(self.role.micro_batch_size)
        self.updates_per_step = int(spec.algorithm.updates_per_step)
        self.temperature = logprob_temperature(config, spec)
        self.gradient_checkpointing = bool(getattr(self.role, "gradient_checkpointing", False))
        if self.gradient_checkpointing and self.device.type != "cuda":
            raise ValueError(f"roles.{context.role}.gradient_checkpointing: Megatron's activation recomputation "
                             "saves and restores CUDA RNG states, so it needs a GPU; set it to false on CPU")
        _init_distributed(self.device)
        _init_model_parallel(self.tp, context.role)
        _check_cuda_stand_ins(self.device, context.seed)
        if self.layout.is_moe:
            _check_moe_router()
        torch.manual_seed(context.seed)
        self.model = self._build_model()
        self._load_hf(_read_safetensors(self.model_path))
        self.model.eval()
        self.loss = context.loss
        self.optimizer_spec = getattr(self.role, "optimizer", None)
        self.optimizer = self._build_optimizer() if self.optimizer_spec is not None else None
        self.version = 0
        """Optimizer steps taken (the policy version of the current weights)."""

    # -- building --------------------------------------------------------------------------------

    def _build_model(self) -> Any:
        import torch
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
                       moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
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
            tensor_model_parallel_size=self.tp, sequence_parallel=False,
            params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False,  # every weight is loaded from the checkpoint next
            **moe, **recompute,
        )
        spec = get_gpt_layer_local_spec(num_experts=layout.num_experts or None, moe_grouped_gemm=False,
                                        qk_layernorm=layout.qk_norm, normalization="RMSNorm")
        model = GPTModel(
            config=config, transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(layout, self.tp), max_sequence_length=layout.max_positions,
            pre_process=True, post_process=True, parallel_output=True,
            share_embeddings_and_output_weights=layout.tied_embeddings,
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=layout.rope_theta,
        )
        return model.to(self.device)

    def _build_optimizer(self) -> Any:
        return build_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optimizer_spec,
                               "megatron")

    def _local_state(self) -> dict[str, Any]:
        """This rank's Megatron weights by name (Megatron's ``_extra_state`` entries left out)."""
        return {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    def _load_hf(self, hf: dict[str, Any]) -> None:
        """Copy a full HF ``state_dict`` into this rank's shard of the model, checking every name."""
        import torch
        from megatron.core import parallel_state

        from relax_plugins.trainer.megatron_weights import hf_to_megatron, shard

        full = hf_to_megatron(hf, self.layout)
        mine = shard(full, self.layout, parallel_state.get_tensor_model_parallel_rank(), self.tp)
        local = self._local_state()
        missing, unexpected = sorted(set(local) - set(mine)), sorted(set(mine) - set(local))
        if missing or unexpected:
            raise ValueError(f"converted weights do not fit the Megatron model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}; this is a bug in the {self.layout.model_type} mapping")
        with torch.no_grad():
            for name, tensor in local.items():
                if tensor.shape != mine[name].shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(mine[name].shape)} != model shape "
                                     f"{tuple(tensor.shape)}; the checkpoint is of another model size")
                tensor.copy_(mine[name])

    # -- forward ----------------------------------------------------------------------------------

    def _token_stats(self, batch: Any, entropy: bool = False) -> tuple[Any, Any]:
        """Token log-probs ``[b, t]`` (and entropies, or None) of a trimmed micro-batch, with the
        graph when grad is on."""
        ids = batch.input_ids.to(self.device)
        logits = self.model(input_ids=ids, position_ids=batch.position_ids.to(self.device),
                            attention_mask=attention_mask(batch.attention_mask.to(self.device)))
        return vocab_parallel_token_stats(logits, ids, self.temperature, self.layout.vocab_size, entropy)

    def compute_logprobs(self, batch: Any) -> Any:
        """``[B, T]`` float32 log-probs of every token under the current weights (CPU, no grad);
        entry t is ``log p(token_t | tokens_<t)``, 0 at column 0."""
        import torch

        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        self.model.eval()
        with torch.no_grad():
            for start in range(0, batch.batch_size, self.micro_batch_size):
                rows = slice(start, start + self.micro_batch_size)
                part = batch.select(rows)
                cols = part.used_columns()
                out[rows, cols] = self._token_stats(part.select_columns(cols))[0].float().cpu()
        return out

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> dict[str, float]:
        """One training step: ``updates_per_step`` optimizer updates over consecutive mini-batches
        of the batch, each accumulated over micro-batches of ``micro_batch_size`` rows.

        The same semantics as the ``torch`` backend: each micro-batch's loss is weighted by its share
        of the mini-batch (``micro_batch_share``), so the gradient is that of the whole mini-batch.
        Data-parallel ranks each pass their own shard of the step's samples; shares count the
        tokens of all of them and gradients are summed over them. The ranks of one tensor-parallel
        group must be given the same samples.

        Returns the mean over updates of ``loss``, ``grad_norm`` (before clipping) and the loss's
        metrics, plus ``lr``, ``tokens`` (this rank's response tokens), ``updates`` and ``version``.
        """
        import torch

        if self.optimizer is None or self.loss is None:
            raise RuntimeError(f"roles.{self.context.role} is forward-only (no optimizer or loss); "
                               "it can compute log-probs but not train")
        dp_group = _data_parallel_group()
        updates = self.updates_per_step
        if dp_group is not None and batch.batch_size < updates:
            raise ValueError(f"this rank got {batch.batch_size} samples, fewer than "
                             f"algorithm.updates_per_step={updates}; give each rank at least that many")
        from relax_plugins.trainer.megatron_weights import grad_summed_over_tensor_parallel, is_split

        wants_entropy = bool(getattr(self.loss, "needs_entropy", False))
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        split = [is_split(name) for name, _ in named]
        partial = [p for name, p in named if self.tp > 1 and grad_summed_over_tensor_parallel(name)]
        clip = self.optimizer_spec.grad_clip
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
            for micro in minibatch.split(self.micro_batch_size):
                micro = micro.to(self.device)
                share = micro_batch_share(self.loss, micro, tokens, rows)
                logprobs, entropy = self._token_stats(micro, entropy=wants_entropy)
                if wants_entropy:
                    loss, metrics = self.loss.compute(micro, logprobs, entropy=entropy)
                else:
                    loss, metrics = self.loss.compute(micro, logprobs)
                (loss * share).backward()
                add_weighted(stats, float(loss.item()), metrics, share)
            if partial:
                _sum_partial_grads_over_tensor_parallel(partial)
            if dp_group is not None:
                _sum_over_data_parallel(dp_group, params, stats, self.device)
            stats["grad_norm"] = _clip_grad_norm(params, split, clip)
            self.optimizer.step()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            taken += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.version += 1
        return step_result(totals, taken, batch.num_response_tokens, self.optimizer, self.version)

    # -- weights and checkpoints -------------------------------------------------------------------

    def _full_megatron_state(self) -> dict[str, Any]:
        """The unsharded Megatron weights on CPU (a collective over the tensor-parallel group)."""
        import torch
        from megatron.core import parallel_state

        from relax_plugins.trainer.megatron_weights import unshard

        local = {k: v.detach() for k, v in self._local_state().items()}
        if self.tp == 1:
            return {k: v.cpu() for k, v in local.items()}
        group = parallel_state.get_tensor_model_parallel_group()
        shards: list[dict[str, Any]] = [{} for _ in range(self.tp)]
        for name, tensor in local.items():
            parts = [torch.empty_like(tensor) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part.cpu()
        return unshard(shards, self.layout)

    def weights(self) -> dict[str, Any]:
        """The full HF ``state_dict`` (a tied ``lm_head.weight`` included) as detached CPU clones.
        Under tensor parallelism every rank of the group must call it (it gathers the shards)."""
        from relax_plugins.trainer.megatron_weights import megatron_to_hf

        return {k: v.clone() for k, v in megatron_to_hf(self._full_megatron_state(), self.layout).items()}

    def save(self, path: str) -> None:
        """Write a checkpoint folder atomically: an HF model folder (``model.safetensors``, the
        source folder's config and tokenizer files) plus ``optimizer.pt`` (every tensor-parallel
        rank's optimizer state) and ``trainer_state.json``. It is written beside ``path`` and
        renamed into place, so ``path`` is either the old checkpoint or the new one. Every rank of
        the tensor-parallel group calls it (a collective); the first rank writes."""
        import torch
        from safetensors.torch import save_file

        from relax_plugins.trainer.megatron_weights import megatron_to_hf

        # The checkpoint (file) layout: per-expert MoE matrices, as save_pretrained writes them.
        weights = {k: v.clone() for k, v in
                   megatron_to_hf(self._full_megatron_state(), self.layout, fused_experts=False).items()}
        if self.layout.tied_embeddings:
            weights.pop("lm_head.weight")  # as HF save_pretrained writes a tied model
        optimizer_states = self._gather_optimizer_states()
        if not _is_first_rank_of_tp_group() or _data_parallel_rank() != 0:
            return
        with atomic_folder(path) as staging:
            for name in MODEL_FILES:
                if (self.model_path / name).is_file():
                    shutil.copy2(self.model_path / name, staging / name)
            save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / WEIGHTS_FILE),
                      metadata={"format": "pt"})
            if optimizer_states is not None:
                torch.save({"tensor_parallel": self.tp, "ranks": optimizer_states}, staging / OPTIMIZER_FILE)
            (staging / STATE_FILE).write_text(json.dumps({"version": self.version, "backend": "megatron"}))

    def _gather_optimizer_states(self) -> list[dict[str, Any]] | None:
        """Every tensor-parallel rank's optimizer ``state_dict``, in rank order (None if forward-only)."""
        import torch
        from megatron.core import parallel_state

        if self.optimizer is None:
            return None
        mine = _to_cpu(self.optimizer.state_dict())
        if self.tp == 1:
            return [mine]
        states: list[Any] = [None] * self.tp
        torch.distributed.all_gather_object(states, mine, group=parallel_state.get_tensor_model_parallel_group())
        return states

    def load(self, path: str) -> None:
        """Restore the weights, the optimizer state and the version from a ``save`` folder (or the
        weights alone from any HF folder of the same model)."""
        import torch
        from megatron.core import parallel_state

        folder = Path(path)
        self._load_hf(_read_safetensors(folder))
        optimizer_file = folder / OPTIMIZER_FILE
        if self.optimizer is not None and optimizer_file.is_file():
            saved = torch.load(optimizer_file, map_location="cpu", weights_only=False)
            if not isinstance(saved, dict) or "ranks" not in saved:
                raise ValueError(f"{optimizer_file} was not written by the megatron trainer (another backend's "
                                 "optimizer state); load the weights only, from a folder without it")
            if saved["tensor_parallel"] != self.tp:
                raise ValueError(f"{optimizer_file} holds the optimizer state of tp={saved['tensor_parallel']} but "
                                 f"this trainer runs tp={self.tp}; resume with the same tp")
            state = saved["ranks"][parallel_state.get_tensor_model_parallel_rank()]
            self.optimizer.load_state_dict(state)
        state_file = folder / STATE_FILE
        if state_file.is_file():
            self.version = int(json.loads(state_file.read_text()).get("version", 0))


# -- log-probs over a vocabulary split across tensor-parallel ranks ----------------------------------


def attention_mask(mask: Any) -> Any:
    """Megatron's boolean attention mask ``[b, 1, t, t]`` (True = may not attend) from a ``[b, t]``
    padding mask: causal, and no real query attends to padding. A padding query may attend to itself,
    so no softmax row is empty."""
    import torch

    t = mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
    allowed = causal & mask.bool()[:, None, :]
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=mask.device)
    return ~allowed[:, None]


def vocab_parallel_token_stats(logits: Any, input_ids: Any, temperature: float, vocab_size: int,
                               entropy: bool = False) -> tuple[Any, Any]:
    """Token log-probs ``[b, t]`` (and entropies when asked, else None) in float32, aligned like
    ``relax.algo.batch.token_logprobs``: entry t scores ``input_ids[t]`` under ``logits[t-1] / T``,
    entry 0 is 0. ``logits`` is this rank's vocabulary shard ``[b, t, V / tp]`` (rank r holds
    columns ``r*V/tp ...``); columns at or past ``vocab_size`` are padding and get no probability.

    ``log p = z_target - (m + log sum exp(z - m))`` with the max ``m``, the sum and the target logit
    each reduced over the tensor-parallel group; the entropy is ``m + log S - sum p z``. Sums are
    all-reduced forward and passed through unchanged backward (every rank computes the same loss
    from them), the max is a constant of the gradient. With tp = 1 the reductions are no-ops.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    padded = start + width > vocab_size
    if padded:
        valid = torch.arange(start, start + width, device=z.device) < vocab_size
        z = z.masked_fill(~valid, float("-inf"))
    m = z.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    shifted = z - m.unsqueeze(-1)
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    targets = input_ids[:, 1:] - start
    here = (targets >= 0) & (targets < width)
    picked = shifted.gather(-1, targets.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(torch.where(here, picked, torch.zeros_like(picked)))
    log_total = total.log()
    logprobs = torch.nn.functional.pad(picked - log_total, (1, 0), value=0.0)
    if not entropy:
        return logprobs, None
    finite = shifted.masked_fill(~torch.isfinite(shifted), 0.0) if padded else shifted
    weighted = reduce_from_tensor_model_parallel_region((exp * finite).sum(dim=-1))
    token_entropy = log_total - weighted / total
    return logprobs, torch.nn.functional.pad(token_entropy, (1, 0), value=0.0)


# -- process groups, gradients ----------------------------------------------------------------------


def _init_distributed(device: Any) -> None:
    """Start ``torch.distributed`` unless the caller did: from ``RANK``/``WORLD_SIZE``/``MASTER_*``
    when set (torchrun, a launcher), else as a single process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; set both to the "
                               "address of rank 0 to start torch.distributed")
        dist.init_process_group(backend, init_method="env://")
        return
    # One process: an in-memory store, so no port is taken (a probed free port can be grabbed by
    # another process before the TCP store binds it).
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _init_model_parallel(tp: int, role: str) -> None:
    """Megatron's process groups for ``tp`` (data parallel over the rest), or a check that the ones
    already set up in this process agree."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"roles.{role}.parallel.tp={tp} does not divide the world size {world} (ranks of this "
                         f"role); give the role a multiple of {tp} ranks, or a tp that divides {world}")
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tp:
            raise ValueError(f"Megatron's process groups in this process already use tp={have}, but "
                             f"roles.{role}.parallel.tp={tp}; one process runs one tensor-parallel layout")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _check_cuda_stand_ins(device: Any, seed: int) -> None:
    """Seed Megatron's tensor-parallel RNG on CUDA; on CPU, fail with what to do if nothing stands in
    for the CUDA calls megatron-core makes."""
    import torch
    from megatron.core import tensor_parallel

    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    try:
        torch.cuda.current_device()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass
    except Exception as exc:  # any failure here means the same: no CPU stand-ins
        raise RuntimeError(
            "megatron-core needs CUDA, and this process runs on CPU without stand-ins for "
            f"torch.cuda.current_device and the tensor-parallel RNG tracker ({exc}); run on a GPU, or "
            "install the CPU stand-ins first (tests.backends.megatron_cpu.install_cpu_shims; through the "
            "runtime: RELAX_WORKER_SETUP=tests.backends.megatron_cpu.install_cpu_shims)") from exc


def _check_moe_router() -> None:
    """megatron-core 0.16.1's MoE router reads ``moe_utils.te_general_gemm``, a name defined only when
    Transformer Engine imports; without it every MoE forward fails with a ``NameError``. Refuse early."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        raise RuntimeError("megatron-core 0.16.1 runs MoE layers only with Transformer Engine installed (its router "
                           "reads te_general_gemm, which is undefined without TE); install transformer-engine, or "
                           "define megatron.core.transformer.moe.moe_utils.te_general_gemm = None first (the "
                           "tests' harness does), or train this model with the torch trainer")


def _data_parallel_group() -> Any:
    """Megatron's data-parallel group when it has more than one rank, else None."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        return parallel_state.get_data_parallel_group()
    return None


def _data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def _is_first_rank_of_tp_group() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


def _sum_partial_grads_over_tensor_parallel(params: list[Any]) -> None:
    """Sum, over the tensor-parallel group, the gradients of replicated weights of which each rank
    holds only a part (see ``grad_summed_over_tensor_parallel``), in one flat buffer."""
    import torch
    from megatron.core import parallel_state

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def _sum_over_data_parallel(group: Any, params: list[Any], stats: dict[str, float], device: Any) -> None:
    """Sum gradients and share-weighted metrics over the data-parallel ranks, one flat buffer each."""
    import torch

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
    keys = sorted(stats)
    values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values, group=group)
    stats.update({k: float(v) for k, v in zip(keys, values)})


def _clip_grad_norm(params: list[Any], split: list[bool], max_norm: float) -> float:
    """The global gradient norm over the whole (tensor-parallel) model, before clipping; gradients are
    scaled as ``torch.nn.utils.clip_grad_norm_`` scales them when ``max_norm > 0``. ``split[i]`` says
    whether ``params[i]`` is split over tensor-parallel ranks; a weight every rank holds (norms, the
    router) is counted once."""
    import torch
    from megatron.core import parallel_state

    first = parallel_state.get_tensor_model_parallel_rank() == 0
    grads = [p.grad for p, s in zip(params, split) if p.grad is not None and (first or s)]
    device = params[0].device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        squares += g.detach().double().pow(2).sum()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
    norm = float(squares.sqrt())
    if max_norm > 0:
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm


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
