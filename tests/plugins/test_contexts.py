"""The typed plugin contexts: built from a spec by relax.plan.contexts, plain data that survives a
JSON round trip (the runtime-only loss is left out), and all a plugin is given."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relax.contracts import AlgorithmContext, ModelInfo, RolloutContext, TrainerContext
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry
from relax.spec import validate_spec

SPEC = {
    "name": "contexts",
    "seed": 7,
    "model": {"path": "builtin:tiny-lm", "dtype": "bfloat16"},
    "data": {"max_prompt_tokens": 99},
    "algorithm": {"name": "ppo", "clip": {"low": 0.1, "high": 0.3, "c": 3.0}, "kl_coef": 0.05, "kl_in": "loss",
                  "updates_per_step": 2, "value_clip": 0.4},
    "async_policy": {"correction": "tis", "tis_cap": 1.5},
    "roles": {"rollout": {"sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 11}},
              "actor": {"micro_batch_size": 3, "gradient_checkpointing": True, "optimizer": {"lr": 2e-5}},
              "critic": {"micro_batch_size": 4}, "reference": {}},
    "tracing": {"exporter": "none"},
}


@pytest.fixture(scope="module")
def spec():
    return validate_spec(SPEC)


def test_rollout_context_copies_what_a_rollout_reads(spec):
    context = rollout_context(spec, "/models/tiny", device="cpu")
    assert context.model == ModelInfo(path="/models/tiny", dtype="bfloat16", modalities=("text",))
    assert (context.sampling.temperature, context.sampling.top_p, context.sampling.top_k,
            context.sampling.max_new_tokens) == (0.7, 0.9, 5, 11)
    assert (context.max_prompt_tokens, context.seed, context.media) == (99, 7, None)
    assert RolloutContext.model_validate_json(context.model_dump_json()) == context


def test_trainer_contexts_per_role(spec):
    loss = object()
    actor = trainer_context(spec, "actor", "/m", loss=loss)
    assert actor.loss is loss and actor.training.optimizer.lr == 2e-5 and actor.training.gradient_checkpointing
    assert (actor.micro_batch_size, actor.updates_per_step, actor.sampling_temperature) == (3, 2, 0.7)
    dumped = actor.model_dump(mode="json")
    assert "loss" not in dumped  # runtime-only: never serialized
    assert TrainerContext.model_validate_json(actor.model_dump_json()) == actor.model_copy(update={"loss": None})
    assert trainer_context(spec, "critic", "/m").value_clip == 0.4
    assert trainer_context(spec, "reference", "/m").training is None  # forward-only
    with pytest.raises(ValueError, match="roles.actor_fwd is not in the spec"):
        trainer_context(spec, "actor_fwd", "/m")
    with pytest.raises(ValueError, match="'rollout' is not a model role"):
        trainer_context(spec, "rollout", "/m")


def test_algorithm_context_is_the_algorithm_slice(spec):
    context = algorithm_context(spec)
    assert context == AlgorithmContext(clip_low=0.1, clip_high=0.3, clip_c=3.0, kl_coef=0.05, kl_in="loss",
                                       kl_estimator=context.kl_estimator, entropy_coef=0.0,
                                       loss_aggregation=context.loss_aggregation, correction="tis", tis_cap=1.5,
                                       max_new_tokens=11)
    loss = get_registry().load("losses", "ppo_clip")
    built = loss(loss.Config(), context)
    assert (built.clip_low, built.clip_high, built.clip_c, built.kl_coef, built.tis_cap, built.norm_tokens) == \
        (0.1, 0.3, 3.0, 0.05, 1.5, 11)


def test_contexts_refuse_unknown_fields():
    with pytest.raises(ValidationError, match="spec"):
        RolloutContext(model=ModelInfo(path="/m"), spec={"roles": {}})


def test_schedule_stop_strings_and_run_length_reach_the_contexts():
    raw = {**SPEC, "trainer": {"steps": 40},
           "roles": {**SPEC["roles"],
                     "rollout": {"sampling": {"stop": ["</answer>"], "repetition_penalty": 1.2}},
                     "actor": {"optimizer": {"lr_schedule": "cosine", "warmup_ratio": 0.1, "min_lr_ratio": 0.2}}}}
    spec = validate_spec(raw)
    sampling = rollout_context(spec, "/m").sampling
    assert (sampling.stop, sampling.repetition_penalty) == (("</answer>",), 1.2)
    actor = trainer_context(spec, "actor", "/m")
    optimizer = actor.training.optimizer
    assert (optimizer.lr_schedule, optimizer.warmup_ratio, optimizer.min_lr_ratio, actor.total_steps) == \
        ("cosine", 0.1, 0.2, 40)
    epochs = validate_spec({**raw, "trainer": {"epochs": 0.25}})  # 4096 prompts, 16 a step
    assert trainer_context(epochs, "actor", "/m").total_steps == 64
