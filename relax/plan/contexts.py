"""The typed contexts a run's plugins get, built from its validated spec (pure: no torch, no ray).

Each function reads exactly the parts of the spec its kind of plugin may use and copies them into
the kind's context of ``relax.contracts``; nothing else of the spec reaches a plugin. The runtime
builds its plugins through these (``relax.runtime.worker.components``); the same data can be shown or
stored with a plan, since the contexts are plain data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax.contracts import (
    AlgorithmContext,
    MediaInfo,
    ModelInfo,
    OptimizerInfo,
    ParallelInfo,
    RolloutContext,
    SamplingInfo,
    TrainerContext,
    TrainingInfo,
)
from relax.spec.models import RunSpec
from relax.spec.run_length import run_steps

#: Model roles a trainer backend is built for.
TRAINER_ROLES = ("actor", "critic", "reference", "actor_fwd")


def model_info(spec: RunSpec, model_path: str) -> ModelInfo:
    """The run's model at ``model_path`` (the local folder ``model.path`` materialized to)."""
    return ModelInfo(path=str(model_path), dtype=spec.model.dtype, modalities=tuple(spec.model.modalities))


def media_info(spec: RunSpec) -> MediaInfo | None:
    """The data's media columns and modality options; None for a text run."""
    if not spec.data.media_keys:
        return None
    return MediaInfo(keys=dict(spec.data.media_keys),
                     options={m: dict(o) for m, o in spec.data.media_options.items()},
                     on_bad_sample=spec.data.on_bad_sample)


def _parallel(role: Any) -> ParallelInfo:
    par = role.parallel
    return ParallelInfo(tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep)


def sampling_info(spec: RunSpec) -> SamplingInfo:
    """``roles.rollout.sampling`` as a context's typed copy."""
    return SamplingInfo.model_validate(spec.roles.rollout.sampling.model_dump())


def chat_template_of(spec: RunSpec, base_dir: Path | None = None) -> str:
    """``data.chat_template`` for a context: ``auto``, ``none``, or the template file's absolute
    path (``~`` expanded, taken from the spec's folder, ``base_dir``, else the working folder)."""
    template = spec.data.chat_template
    if template in ("auto", "none"):
        return template
    from relax.spec.data_files import data_path

    return str(data_path(template, base_dir or Path.cwd()).resolve())


def lora_info(spec: RunSpec, role: str, base_dir: Path | None = None) -> Any:
    """The ``relax.contracts.LoraInfo`` of the adapter ``role`` trains (actor, critic: its own
    ``lora`` block) or follows (actor_fwd and the rollout: the actor's), with ``init_adapter`` made
    absolute against the spec's folder; None without one, and always for the reference, which is the
    frozen base model."""
    from relax.contracts import LoraInfo

    block = getattr(spec.roles, role if role in ("actor", "critic") else "actor", None)
    lora = None if block is None or role == "reference" else getattr(block, "lora", None)
    if lora is None:
        return None
    data = lora.model_dump()
    if lora.init_adapter is not None:
        folder = Path(lora.init_adapter).expanduser()
        data["init_adapter"] = str(folder if folder.is_absolute() else (base_dir or Path.cwd()) / folder)
    return LoraInfo.model_validate(data)


def rollout_context(spec: RunSpec, model_path: str, device: str = "cpu",
                    base_dir: Path | None = None) -> RolloutContext:
    """What the rollout backend of ``spec`` is built with (``base_dir``: the spec's folder, which
    a relative ``data.chat_template`` is taken from)."""
    role = spec.roles.rollout
    return RolloutContext(role="rollout", model=model_info(spec, model_path), sampling=sampling_info(spec),
                          parallel=_parallel(role), gpu_memory_utilization=role.gpu_memory_utilization,
                          max_prompt_tokens=spec.data.max_prompt_tokens, media=media_info(spec),
                          on_long_prompt=spec.data.on_long_prompt, chat_template=chat_template_of(spec, base_dir),
                          max_trajectory_tokens=None if role.agent is None else role.agent.max_tokens,
                          device=device, seed=spec.seed, record_routing=spec.algorithm.router_replay == "r3",
                          lora=lora_info(spec, "rollout", base_dir))


def trainer_context(spec: RunSpec, role: str, model_path: str, device: str = "cpu",
                    loss: Any = None, base_dir: Path | None = None) -> TrainerContext:
    """What the trainer backend of model role ``role`` is built with; ``loss`` is the built loss
    plugin the actor optimises (None for the other roles); ``base_dir``: the spec's folder (a data
    file counted for ``trainer.epochs`` is taken from it)."""
    if role not in TRAINER_ROLES:
        raise ValueError(f"'{role}' is not a model role; a trainer is built for {', '.join(TRAINER_ROLES)}")
    block = getattr(spec.roles, role)
    if block is None:
        raise ValueError(f"roles.{role} is not in the spec; add a roles.{role} block to build its trainer")
    optimizer = getattr(block, "optimizer", None)
    training = None if optimizer is None else TrainingInfo(
        optimizer=OptimizerInfo.model_validate(optimizer.model_dump()),
        gradient_checkpointing=bool(getattr(block, "gradient_checkpointing", False)))
    return TrainerContext(role=role, model=model_info(spec, model_path), parallel=_parallel(block),
                          micro_batch_size=block.micro_batch_size, training=training,
                          max_tokens_per_micro_batch=block.max_tokens_per_micro_batch,
                          updates_per_step=spec.algorithm.updates_per_step,
                          total_steps=run_steps(spec, base_dir),
                          sampling_temperature=spec.roles.rollout.sampling.temperature,
                          max_prompt_tokens=spec.data.max_prompt_tokens, media=media_info(spec),
                          value_clip=spec.algorithm.value_clip,
                          mismatch_ratio_bound=spec.async_policy.mismatch.ratio_bound, device=device,
                          seed=spec.seed, loss=loss, lora=lora_info(spec, role, base_dir),
                          router_replay=spec.algorithm.router_replay if role in ("actor", "actor_fwd") else "off")


def algorithm_context(spec: RunSpec) -> AlgorithmContext:
    """What the run's advantage estimator and loss are built with."""
    algo, policy = spec.algorithm, spec.async_policy
    return AlgorithmContext(clip_low=algo.clip.low, clip_high=algo.clip.high, clip_c=algo.clip.c,
                            kl_coef=algo.kl_coef, kl_in=algo.kl_in, kl_estimator=algo.kl_estimator,
                            entropy_coef=algo.entropy_coef, loss_aggregation=algo.loss_aggregation,
                            correction=policy.correction, tis_cap=policy.tis_cap, mis_low=policy.mis_low,
                            mis_high=policy.mis_high, geo_low=policy.geo_low, geo_high=policy.geo_high,
                            icepop_low=policy.icepop_low, icepop_high=policy.icepop_high,
                            opsm_delta=policy.opsm_delta, max_new_tokens=spec.roles.rollout.sampling.max_new_tokens)
