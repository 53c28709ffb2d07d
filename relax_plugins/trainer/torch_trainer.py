"""``torch``: a plain PyTorch train backend on a Hugging Face causal LM (CPU or one GPU).

Forward-only roles (reference, actor_fwd) build it too and only call ``compute_logprobs``; a role
with an ``optimizer`` block (actor, critic) also trains. Log-probs are those of
``softmax(logits / T)`` with ``T`` the rollout's sampling temperature (1 when sampling is greedy),
matching the distribution the ``hf`` rollout samples from.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import BackendContext

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


class TorchTrainer:
    """Micro-batched forward/backward with gradient accumulation, grad clipping and one optimizer."""

    #: Inputs the backend accepts through the model's own Hugging Face processor. Only text is
    #: fed by the runtime today; it refuses other modalities at launch (see relax.runtime.launch).
    modalities: ClassVar[frozenset[str]] = frozenset({"text", "image", "audio", "video"})
    parallelism: ClassVar[frozenset[str]] = frozenset({"dp"})
    #: The planner's memory estimate assumes FSDP (weights, gradients and optimizer state sharded
    #: over data-parallel ranks) for this backend. NOTE: the implementation below does not wrap the
    #: model in FSDP yet; each data-parallel rank holds a full replica and gradients are summed
    #: over ranks (see ``train_step``), so on GPUs the real footprint is the ``none`` estimate.
    memory_sharding: ClassVar[str] = "full"

    class Config(BaseModel):
        """Options of the torch train backend."""

        model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

        logprob_temperature: float | None = Field(None, gt=0.0)
        """Temperature of the log-probs; null uses the rollout's sampling temperature (1 if 0)."""
        num_threads: int | None = Field(None, ge=1)
        """torch intra-op threads of this process; null leaves torch's setting alone."""

    def __init__(self, config: TorchTrainer.Config, context: BackendContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.context = context
        spec = context.spec
        self.role = getattr(spec.roles, context.role)
        if self.role is None:
            raise ValueError(f"roles.{context.role} is not in the spec; the torch trainer has nothing to run")
        self.device = torch.device(context.device)
        self.micro_batch_size = int(self.role.micro_batch_size)
        self.updates_per_step = int(spec.algorithm.updates_per_step)
        sampling_t = float(spec.roles.rollout.sampling.temperature)
        self.temperature = config.logprob_temperature or (sampling_t if sampling_t > 0 else 1.0)
        torch.manual_seed(context.seed)
        self.model_path = context.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(context.model_path)
        dtype = getattr(torch, spec.model.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(context.model_path, dtype=dtype)
        self.model.to(self.device).eval()
        if getattr(self.role, "gradient_checkpointing", False):
            self.model.gradient_checkpointing_enable()
        self.loss = context.loss
        self.optimizer_spec = getattr(self.role, "optimizer", None)
        self.optimizer = self._build_optimizer() if self.optimizer_spec is not None else None
        self.version = 0
        """Optimizer steps taken (the policy version of the current weights)."""

    def _build_optimizer(self) -> Any:
        import torch

        o = self.optimizer_spec
        params = [p for p in self.model.parameters() if p.requires_grad]
        if o.name == "adamw":
            return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        if o.name == "adam":
            return torch.optim.Adam(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        if o.name == "sgd":
            return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
        raise ValueError(f"optimizer '{o.name}' is not supported by the torch trainer; use adamw, adam or sgd")

    # -- forward ----------------------------------------------------------------------------------

    def _logprobs(self, batch: Any) -> Any:
        """Token log-probs ``[b, t]`` of a (trimmed) micro-batch, with the graph when grad is on."""
        from relax.algo.batch import token_logprobs

        logits = self.model(
            input_ids=batch.input_ids.to(self.device),
            attention_mask=batch.attention_mask.to(self.device),
            position_ids=batch.position_ids.to(self.device),
            use_cache=False,
        ).logits
        return token_logprobs(logits, batch.input_ids.to(self.device), self.temperature)

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
                out[rows, cols] = self._logprobs(part.select_columns(cols)).float().cpu()
        return out

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> dict[str, float]:
        """One training step: ``updates_per_step`` optimizer updates over consecutive mini-batches
        of the batch, each accumulated over micro-batches of ``micro_batch_size`` rows.

        A token-mean loss is weighted per micro-batch by its share of the mini-batch's response
        tokens (other losses by their share of rows), so the gradient equals that of the whole
        mini-batch at once. Under ``torch.distributed`` (a default process group of more than one
        rank, set up by the runtime) each rank passes its own shard of the step's samples: the
        shares use the token count of all ranks together and gradients are summed over ranks, so
        every rank takes the update of the whole batch and the replicas stay identical.

        Returns the mean over updates of ``loss``, ``grad_norm`` (before clipping) and the loss's
        metrics, plus ``lr``, ``tokens`` (this rank's response tokens), ``updates`` and ``version``.
        """
        import torch

        if self.optimizer is None or self.loss is None:
            raise RuntimeError(f"roles.{self.context.role} is forward-only (no optimizer or loss); "
                               "it can compute log-probs but not train")
        dist = _data_parallel()
        updates = self.updates_per_step
        if dist is not None and batch.batch_size < updates:
            raise ValueError(f"this rank got {batch.batch_size} samples, fewer than "
                             f"algorithm.updates_per_step={updates}; give each rank at least that many")
        token_weighted = getattr(self.loss, "aggregation", "token_mean") == "token_mean"
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.optimizer_spec.grad_clip
        bounds = [round(i * batch.batch_size / updates) for i in range(updates + 1)]
        totals: dict[str, float] = {}
        taken = 0
        self.model.train()
        for lo, hi in zip(bounds, bounds[1:]):
            if hi == lo:
                continue
            minibatch = batch.select(slice(lo, hi))
            tokens, rows = float(minibatch.num_response_tokens), float(minibatch.batch_size)
            if dist is not None:
                counts = torch.tensor([tokens, rows], dtype=torch.float64)
                dist.all_reduce(counts)
                tokens, rows = float(counts[0]), float(counts[1])
            self.optimizer.zero_grad(set_to_none=True)
            stats: dict[str, float] = {}
            for micro in minibatch.split(self.micro_batch_size):
                micro = micro.to(self.device)
                share = (micro.num_response_tokens / tokens if token_weighted and tokens
                         else micro.batch_size / rows)
                loss, metrics = self.loss.compute(micro, self._logprobs(micro))
                (loss * share).backward()
                for key, value in {"loss": float(loss.item()), **metrics}.items():
                    stats[key] = stats.get(key, 0.0) + share * float(value)
            if dist is not None:
                _sum_over_ranks(dist, params, stats)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            self.optimizer.step()
            stats["grad_norm"] = float(grad_norm)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            taken += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.version += 1
        result = {key: value / max(taken, 1) for key, value in totals.items()}
        result["tokens"] = float(batch.num_response_tokens)
        result["lr"] = float(self.optimizer.param_groups[0]["lr"])
        result["updates"] = float(taken)
        result["version"] = float(self.version)
        return result

    # -- weights and checkpoints -------------------------------------------------------------------

    def weights(self) -> dict[str, Any]:
        """The full HF ``state_dict`` (a tied ``lm_head.weight`` included) as detached clones."""
        from relax_plugins.hf_weights import state_copy

        return state_copy(self.model)

    def save(self, path: str) -> None:
        """Write a checkpoint folder atomically: an HF model folder (safetensors + tokenizer) plus
        ``optimizer.pt`` and ``trainer_state.json``. It is written beside ``path`` and renamed into
        place, so ``path`` is either the old checkpoint or the new one, never half of one. Under data
        parallelism call it on one rank only (the replicas are identical)."""
        import torch

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.model.save_pretrained(staging, safe_serialization=True)
            self.tokenizer.save_pretrained(staging)
            if self.optimizer is not None:
                torch.save(self.optimizer.state_dict(), staging / OPTIMIZER_FILE)
            (staging / STATE_FILE).write_text(json.dumps({"version": self.version}))
            old = None
            if target.exists():
                old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(target, old)
            os.replace(staging, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def load(self, path: str) -> None:
        """Restore the weights, the optimizer state and the version from a ``save`` folder."""
        import torch
        from safetensors.torch import load_file

        from relax_plugins.hf_weights import load_state

        folder = Path(path)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no *.safetensors weights; give a folder written by save()")
        weights: dict[str, Any] = {}
        for file in files:
            weights.update(load_file(str(file), device="cpu"))
        load_state(self.model, weights)
        if self.optimizer is not None and (folder / OPTIMIZER_FILE).is_file():
            self.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, map_location=self.device))
        state_file = folder / STATE_FILE
        if state_file.is_file():
            self.version = int(json.loads(state_file.read_text()).get("version", 0))


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
    flat = torch.cat([p.grad.reshape(-1) for p in params])
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
