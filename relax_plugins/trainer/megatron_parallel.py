"""The parallel plumbing of the ``megatron`` train backend: process groups and their checks,
log-probs over a vocabulary split across tensor-parallel ranks, and gradient reductions.

Kept apart from ``relax_plugins.trainer.megatron`` (the trainer's steps, weights and checkpoints)
because it is what a new parallel layout changes. Imports torch and megatron-core only inside its
functions, like the trainer.
"""

from __future__ import annotations

import os
from typing import Any

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


def init_distributed(device: Any) -> None:
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


def check_model_parallel_sizes(layout: Any, tp: int, pp: int, ep: int, cp: int, role: str) -> None:
    """Refuse, with what to do, the parallel sizes this trainer cannot run for ``layout`` (those
    that need the world size are checked by ``init_model_parallel``)."""
    where = f"roles.{role}.parallel"
    if cp != 1:
        raise ValueError(f"{where}.cp={cp}: megatron-core 0.16.1 runs context parallelism only in Transformer "
                         "Engine's attention (its local DotProductAttention asserts context_parallel_size == 1), "
                         "and Transformer Engine needs CUDA; set cp to 1 (tp and pp also split a long sequence's "
                         "activations), or use a backend with context parallelism")
    if layout.num_layers % pp:
        ok = [d for d in range(1, layout.num_layers + 1) if layout.num_layers % d == 0]
        raise ValueError(f"{where}.pp={pp} does not divide num_hidden_layers={layout.num_layers} (every stage holds "
                         f"as many layers); use {', '.join(map(str, ok))}")
    if ep > 1 and not layout.is_moe:
        raise ValueError(f"{where}.ep={ep}: the {layout.model_type} model has no experts; set ep to 1")
    if ep > 1 and layout.num_experts % ep:
        ok = [d for d in range(1, layout.num_experts + 1) if layout.num_experts % d == 0]
        raise ValueError(f"{where}.ep={ep} does not divide num_experts={layout.num_experts}; use "
                         f"{', '.join(map(str, ok))}")


def init_model_parallel(tp: int, pp: int, ep: int, role: str) -> None:
    """Megatron's process groups for ``tp``, ``pp`` and ``ep`` (data parallel over the rest), or a
    check that the ones already set up in this process agree."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % (tp * pp):
        sizes = f"tp={tp}" if pp == 1 else f"tp x pp={tp * pp}"
        raise ValueError(f"roles.{role}.parallel: {sizes} does not divide the world size {world} (ranks of this "
                         f"role); give the role a multiple of {tp * pp} ranks, or sizes whose product divides {world}")
    data_parallel = world // (tp * pp)
    if data_parallel % ep:
        raise ValueError(f"roles.{role}.parallel.ep={ep} does not divide the data-parallel size {data_parallel} "
                         f"(world size {world} / (tp x pp)); megatron-core carves the expert-parallel groups out of "
                         f"the data-parallel ranks, so use an ep that divides {data_parallel}, or more ranks")
    if parallel_state.model_parallel_is_initialized():
        have = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                "ep": parallel_state.get_expert_model_parallel_world_size()}
        want = {"tp": tp, "pp": pp, "ep": ep}
        if have != want:
            show = lambda sizes: ", ".join(f"{k}={v}" for k, v in sizes.items())  # noqa: E731
            raise ValueError(f"Megatron's process groups in this process already use {show(have)}, but "
                             f"roles.{role}.parallel asks for {show(want)}; one process runs one parallel layout")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)


def sequence_parallel_block(layer_spec: Any, config: Any, qk_norm: bool) -> Any:
    """The transformer block spec of ``layer_spec`` (Megatron's local GPT layer) with the norms
    swapped for ``megatron_norm``'s, which work under sequence parallelism (Megatron's local norm
    asserts against it); the final norm too, which a layer spec does not name."""
    import dataclasses

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from relax_plugins.trainer.megatron_norm import RMSNorm, SequenceRMSNorm

    layer = layer_spec.submodules
    attention = layer.self_attention
    if qk_norm:
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm))
    layer = dataclasses.replace(layer, input_layernorm=SequenceRMSNorm, pre_mlp_layernorm=SequenceRMSNorm,
                                self_attention=attention)
    layer_spec = dataclasses.replace(layer_spec, submodules=layer)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceRMSNorm)


def check_cuda_stand_ins(device: Any, seed: int) -> None:
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


def check_moe_router() -> None:
    """megatron-core 0.16.1's MoE router reads ``moe_utils.te_general_gemm``, a name defined only when
    Transformer Engine imports; without it every MoE forward fails with a ``NameError``. Refuse early."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        raise RuntimeError("megatron-core 0.16.1 runs MoE layers only with Transformer Engine installed (its router "
                           "reads te_general_gemm, which is undefined without TE); install transformer-engine, or "
                           "define megatron.core.transformer.moe.moe_utils.te_general_gemm = None first (the "
                           "tests' harness does), or train this model with the torch trainer")


def data_parallel_group() -> Any:
    """Megatron's data-parallel group when it has more than one rank, else None."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        return parallel_state.get_data_parallel_group()
    return None


def all_reduce_grads(params: list[Any], group: Any) -> None:
    """Sum the gradients of ``params`` over ``group``, in one flat buffer."""
    import torch

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def wait_sends(sends: list[tuple[Any, Any]]) -> None:
    """Wait for point-to-point sends (each with the tensor it sends, kept alive until then)."""
    for request, _ in sends:
        request.wait()
    sends.clear()
