"""The torch trainer follows ``optimizer.lr_schedule``: its optimizer's learning rate at each real
``train_step`` is the schedule's (hand-computed here), reported as ``lr``, and a trainer resumed
from a checkpoint goes on with the same rates and the same weights as one that never stopped."""

from __future__ import annotations

import pytest
import torch

from relax.algo.batch import collate
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry

PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]
LR = 1e-3
#: cosine over 6 steps, 2 warmup steps, floor 0.1: 1/3, 2/3, 1, then p = (s - 2) / 3 and
#: 0.1 + 0.9 * (1 + cos(pi p)) / 2 = 0.775, 0.325, 0.1 (times lr).
EXPECTED = [LR / 3, 2 * LR / 3, LR, 0.775 * LR, 0.325 * LR, 0.1 * LR]


@pytest.fixture(scope="module")
def spec(make_spec):
    return make_spec({"trainer.steps": 6, "roles.actor.optimizer": {
        "lr": LR, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}})


def _trainer(spec, path):
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", {}),
                                             trainer_context(spec, "actor", path, loss=loss))


@pytest.fixture(scope="module")
def batches(spec, tiny_model_path):
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, tiny_model_path))
    out = []
    for seed in range(6):
        gens = rollout.generate(PROMPTS, 3, spec.roles.rollout.sampling, seed=seed)
        out.append(collate(gens, torch.linspace(-1.0, 1.0, len(gens)), rollout.pad_token_id,
                           rewards=[0.0] * len(gens)))
    return out


def test_the_context_carries_the_runs_steps(spec, tiny_model_path):
    context = trainer_context(spec, "actor", tiny_model_path)
    assert context.total_steps == 6
    assert context.training.optimizer.lr_schedule == "cosine"
    assert context.training.optimizer.warmup_steps == 2


def test_each_step_trains_at_the_schedules_rate_and_resumes_exactly(spec, batches, tiny_model_path, tmp_path):
    trainer = _trainer(spec, tiny_model_path)
    seen = []
    for step, batch in enumerate(batches):
        result = trainer.train_step(batch)
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        assert result["lr"] == seen[-1]
        if step == 2:
            trainer.save(str(tmp_path / "ckpt"))
    assert seen == pytest.approx(EXPECTED, rel=1e-12)
    continued = trainer.weights()

    resumed = _trainer(spec, tiny_model_path)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 3
    again = [resumed.train_step(batch)["lr"] for batch in batches[3:]]
    assert again == seen[3:]
    for key, value in resumed.weights().items():
        assert torch.equal(value, continued[key]), key


def test_the_update_moves_with_the_rate(make_spec, batches, tiny_model_path):
    # SGD's update is lr * grad: the first warmup step (lr / 3) moves the weights a third as far
    # as a constant schedule's first step on the same batch.
    moved = {}
    for schedule, warmup in (("constant", 0), ("constant", 2)):
        spec = make_spec({"trainer.steps": 6, "roles.actor.optimizer": {
            "name": "sgd", "lr": 1.0, "lr_schedule": schedule, "warmup_steps": warmup, "grad_clip": 0.0}})
        trainer = _trainer(spec, tiny_model_path)
        before = trainer.weights()
        trainer.train_step(batches[0])
        moved[warmup] = torch.cat([(value - before[key]).flatten() for key, value in trainer.weights().items()])
    assert torch.allclose(moved[2] * 3, moved[0], atol=1e-6)
