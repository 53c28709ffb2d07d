"""CPU stand-ins that let megatron-core 0.16.1 run a tiny GPTModel on a machine without CUDA.

megatron-core assumes CUDA in two places a CPU run reaches (measured in FACTS-runtime.md §6):

- ``torch.cuda.current_device()`` picks the device of the rotary embedding's frequencies and of the
  attention's scratch buffer; on a CPU torch it raises "Torch not compiled with CUDA enabled". Here
  it answers the CPU device.
- The tensor-parallel RNG tracker (``get_cuda_rng_tracker().fork()``, entered around weight init
  and dropout) saves and restores CUDA RNG states. An inference tracker forks nothing, which is
  exact here because the trainer turns dropout off.

A third stand-in is not about CUDA: megatron-core 0.16.1's MoE router (``moe_utils``) tests a name,
``te_general_gemm``, that it only defines when Transformer Engine imports, so without TE every MoE
forward raises ``NameError``. Defining it as ``None`` selects the plain ``torch.mm`` path the
module already has. The trainer refuses MoE models in a process where the name is missing.

These live in the tests' harness, never in the plugin: on GPUs megatron-core needs neither. A run
through the runtime installs them in every Ray worker with
``RELAX_WORKER_SETUP=tests.backends.megatron_cpu.install_cpu_shims``.
"""

from __future__ import annotations

from relax.testing import sample_train_batch as sample_batch  # the harness's fixed batch (re-exported)

WORKER_SETUP = "tests.backends.megatron_cpu.install_cpu_shims"
"""The ``RELAX_WORKER_SETUP`` value that installs these shims in every Ray worker of a run."""


def install_cpu_shims() -> None:
    """Install the stand-ins in this process (idempotent; the CUDA ones only where CUDA is missing).
    It also quiets megatron-core's import-time notes that Apex and Transformer Engine are absent,
    which every Ray worker of a run would otherwise print."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed", category=UserWarning)

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = _cpu_device
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _cpu_device():
    import torch

    return torch.device("cpu")


# -- shared by the tests and by the ranks of a multi-process check -----------------------------------


def trainer_spec(model_path: str, *, tp: int = 1, pp: int = 1, ep: int = 1, micro_batch_size: int = 3,
                 temperature: float = 0.7, backend: str = "megatron", extra: dict | None = None):
    """A validated spec whose actor trains ``model_path``; ``tp``, ``pp`` and ``ep`` are set after
    validation, because the spec rules rightly refuse them > 1 for a role without GPUs, while gloo
    ranks run them on CPU."""
    from relax.spec import validate_spec

    raw = {"name": "megatron-test", "model": {"path": model_path},
           "roles": {"rollout": {"backend": "hf", "sampling": {"temperature": temperature, "max_new_tokens": 6}},
                     "actor": {"backend": backend, "micro_batch_size": micro_batch_size,
                               "optimizer": {"lr": 1e-3, "grad_clip": 1.0}}},
           "tracing": {"exporter": "none"}}
    for dotted, value in (extra or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    spec = validate_spec(raw)
    spec.roles.actor.parallel.tp = tp
    spec.roles.actor.parallel.pp = pp
    spec.roles.actor.parallel.ep = ep
    return spec


def build_trainer(cls, spec, model_path: str, loss=None):
    """A trainer plugin of class ``cls`` for the spec's actor, with the spec's loss unless given."""
    from relax.plan.contexts import trainer_context
    from relax.runtime.worker.components import build_loss

    context = trainer_context(spec, "actor", model_path, loss=loss if loss is not None else build_loss(spec))
    return cls(cls.Config(), context)


def data_parallel_share(batch, trainer):
    """The rows of ``batch`` that ``trainer``'s data-parallel index is given (consecutive, as equal
    as possible), as the runtime hands them out."""
    size, rank = trainer.data_parallel_size, trainer.data_parallel_rank
    bounds = [round(i * batch.batch_size / size) for i in range(size + 1)]
    return batch.select(slice(bounds[rank], bounds[rank + 1]))


def routed_batch(layers: int = 2, experts: int = 4, k: int = 2, seed: int = 1):
    """``sample_batch()`` with a ``routed_experts`` column (``[B, T, layers, k]``) of random
    distinct expert ids on its response tokens (0 elsewhere), as an r3 rollout would record: a
    routing the router would often not choose itself, so replaying it shows."""
    import torch

    batch = sample_batch()
    g = torch.Generator().manual_seed(seed)
    rows, width = batch.input_ids.shape
    ids = torch.rand(rows, width, layers, experts, generator=g).argsort(dim=-1)[..., :k]
    ids = ids * (batch.response_mask > 0)[..., None, None]
    return batch.with_fields(routed_experts=ids.to(torch.uint8))


def probe(trainer, batch=None) -> dict:
    """What the parallel checks compare: log-probs (of every data-parallel share, joined), one
    step's metrics, the weights after it (of ``batch``, by default ``sample_batch()``). A
    collective when the trainer runs on several ranks."""
    import torch

    batch = sample_batch() if batch is None else batch
    mine = data_parallel_share(batch, trainer)
    logprobs = trainer.compute_logprobs(mine)
    metrics = trainer.train_step(mine)
    weights = trainer.weights()
    if trainer.data_parallel_size > 1:
        shares = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shares, (trainer.data_parallel_rank, logprobs))
        logprobs = torch.cat([dict(shares)[rank] for rank in range(trainer.data_parallel_size)])
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights}


def checkpoint_round_trip(trainer, resumed, folder: str) -> dict:
    """Train ``trainer`` a step, save it to ``folder``, load that into ``resumed`` (built alike),
    and report both sides: the weights saved, the versions, and the next log-probs, step losses
    and weights of each. A collective when the trainers run on several ranks."""
    batch = sample_batch()
    trainer.train_step(batch)
    saved = trainer.weights()
    trainer.save(folder)
    resumed.load(folder)
    result = {"saved": saved, "version": resumed.version,
              "logprobs": (trainer.compute_logprobs(batch), resumed.compute_logprobs(batch))}
    result["loss"] = (trainer.train_step(batch)["loss"], resumed.train_step(batch)["loss"])
    result["weights"] = (trainer.weights(), resumed.weights())
    return result


def _run_rank(model_path: str, out: str, tp: int = 1, pp: int = 1, ep: int = 1, check: str = "probe") -> None:
    """One gloo rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment) of a
    parallel run of ``probe`` (with ``check="r3"``, of ``probe`` on ``routed_batch()`` with
    ``algorithm.router_replay: r3``; with ``check="checkpoint"``, of ``checkpoint_round_trip`` into
    ``out`` + ".ckpt"); rank 0 writes the result to ``out``."""
    import os

    import torch

    from relax_plugins.trainer.megatron import MegatronTrainer

    torch.set_num_threads(1)
    install_cpu_shims()
    extra = {"algorithm.router_replay": "r3"} if check == "r3" else None
    spec = trainer_spec(model_path, tp=tp, pp=pp, ep=ep, extra=extra)
    trainer = build_trainer(MegatronTrainer, spec, model_path)
    from megatron.core import parallel_state

    if check == "checkpoint":
        result = checkpoint_round_trip(trainer, build_trainer(MegatronTrainer, spec, model_path), out + ".ckpt")
    elif check == "r3":
        result = probe(trainer, routed_batch())
    else:
        result = probe(trainer)
    result["sizes"] = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                       "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                       "ep": parallel_state.get_expert_model_parallel_world_size(),
                       "dp": trainer.data_parallel_size}
    if os.environ["RANK"] == "0":
        torch.save(result, out)
    # The ranks leave together and tear the group down: a rank that exits with its gloo group and
    # the TCP store still live can abort in their threads' destructors ("terminate called without
    # an active exception", exit -6), after its work is done.
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    model, output, *sizes = sys.argv[1:]
    named = dict(arg.split("=", 1) for arg in sizes)
    _run_rank(model, output, **{k: v if k == "check" else int(v) for k, v in named.items()})
