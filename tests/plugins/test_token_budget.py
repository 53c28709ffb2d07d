"""The torch trainer's token-budget micro-batches (``roles.actor.max_tokens_per_micro_batch``):
the loss, gradient and update of a step cut by tokens (on packed rows) equal those of the whole
batch in one padded micro-batch, and ``pad_frac`` reports the padding each way computed."""

from __future__ import annotations

import pytest
import torch

from relax.algo.batch import collate
from relax.algo.micro_batches import row_lengths, token_budget_groups
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry

PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1=", "8+1="]
BUDGET = 24


def _trainer(spec, path, **options):
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", options),
                                             trainer_context(spec, "actor", path, loss=loss))


@pytest.fixture(scope="module")
def batch(make_spec, tiny_model_path):
    spec = make_spec({"roles.rollout.sampling.max_new_tokens": 12})
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, tiny_model_path))
    gens = rollout.generate(PROMPTS, 3, spec.roles.rollout.sampling, seed=3)
    return collate(gens, torch.linspace(-1.0, 1.0, len(gens)), rollout.pad_token_id, rewards=[0.0] * len(gens))


def test_token_budget_micro_batches_give_the_padded_loss_gradient_and_update(make_spec, tiny_model_path, batch):
    lengths = row_lengths(batch)
    assert len(set(lengths)) > 1  # rows of different lengths
    groups = token_budget_groups(lengths, BUDGET)
    assert len(groups) >= 3
    sgd = {"roles.actor.optimizer": {"name": "sgd", "lr": 1.0}}  # the update is the gradient itself
    padded = _trainer(make_spec({**sgd, "roles.actor.micro_batch_size": 64}), tiny_model_path, pack_sequences=False)
    budget = _trainer(make_spec({**sgd, "roles.actor.max_tokens_per_micro_batch": BUDGET}), tiny_model_path)
    assert budget.max_tokens == BUDGET

    mask = batch.response_mask.bool()
    assert (budget.compute_logprobs(batch) - padded.compute_logprobs(batch))[mask].abs().max() < 1e-5
    m_padded, m_budget = padded.train_step(batch), budget.train_step(batch)
    assert budget._pack is True  # the budget's micro-batches ran on packed rows
    assert m_budget["loss"] == pytest.approx(m_padded["loss"], abs=1e-5)
    assert m_budget["grad_norm"] == pytest.approx(m_padded["grad_norm"], abs=1e-5)
    after_padded, after_budget = padded.weights(), budget.weights()
    for key, value in after_budget.items():
        assert (value - after_padded[key]).abs().max() < 1e-5, key
    # padding: the padded batch computes the longest row's width for every row; packed rows nearly none
    real = sum(lengths)
    assert m_padded["pad_frac"] == pytest.approx(1 - real / batch.input_ids.numel(), abs=1e-6)
    assert 0 <= m_budget["pad_frac"] < m_padded["pad_frac"]


def test_another_backend_is_told_the_budget_is_torch_only(make_spec):
    from relax.spec import SpecError

    with pytest.raises(SpecError, match="max_tokens_per_micro_batch"):
        make_spec({"roles.actor.max_tokens_per_micro_batch": 64, "roles.actor.backend": "megatron"})
