"""The weight extractor (relax_plugins.trainer.weight_extraction): buckets of bounded bytes that
together are the full state dict in Hugging Face naming (a tied head included), an adapter-only
selection renamed to the rollout's naming, and the torch trainer's weights going through it."""

from __future__ import annotations

import pytest
import torch

from relax_plugins.trainer.weight_extraction import BucketExtractor


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4, bias=False))
    return model


def test_buckets_are_bounded_and_together_are_the_state_dict():
    model = _model()
    extractor = BucketExtractor(lambda: model.state_dict().items(), bucket_bytes=600)
    buckets = list(extractor.buckets())
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    # 0.weight is 512 bytes, 1.weight 256: each bucket holds at most 600 unless one tensor is larger
    assert all(size <= 600 or len(b) == 1 for size, b in zip(sizes, buckets))
    assert len(buckets) > 1
    got = {name: t for b in buckets for name, t in b}
    want = model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert extractor.total_bytes() == sum(sizes)
    assert extractor.shapes()["1.weight"] == ("float32", (4, 16))


def test_a_tensor_larger_than_a_bucket_travels_alone():
    model = _model()
    buckets = list(BucketExtractor(lambda: model.state_dict().items(), bucket_bytes=10).buckets())
    assert [len(b) for b in buckets] == [1] * len(model.state_dict())


def test_state_dict_is_a_snapshot_later_steps_do_not_change():
    model = _model()
    snapshot = BucketExtractor(lambda: model.state_dict().items()).state_dict()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(snapshot["0.weight"], model[0].weight)


def test_adapter_only_selects_and_renames():
    model = _model()
    extractor = BucketExtractor(lambda: model.state_dict().items(), adapter_only=True,
                                include=lambda n: n.startswith("2."), rename=lambda n: "adapter." + n)
    assert extractor.adapter_only
    assert list(extractor.state_dict()) == ["adapter.2.weight"]
    clash = BucketExtractor(lambda: model.state_dict().items(), rename=lambda n: "same")
    with pytest.raises(ValueError, match="both named 'same'"):
        clash.shapes()


def test_the_torch_trainer_hands_out_its_weights_through_the_extractor(make_spec, tiny_model_path):
    from relax.contracts import WeightExtractor
    from relax.plan.contexts import trainer_context
    from relax.registry import get_registry

    registry = get_registry()
    spec = make_spec()
    trainer = registry.load("trainer", "torch")(registry.build_config("trainer", "torch", {}),
                                                trainer_context(spec, "actor", tiny_model_path))
    extractor = trainer.extractor(bucket_bytes=64 * 1024)
    assert isinstance(extractor, WeightExtractor)
    weights = trainer.weights()
    state = trainer.model.state_dict()
    assert list(weights) == list(state) and "lm_head.weight" in weights  # the tied head too
    assert all(torch.equal(weights[k], state[k]) for k in state)
    assert len(list(extractor.buckets())) > 1
    with pytest.raises(ValueError, match="trains no adapter"):
        trainer.extractor(adapter_only=True)


def test_the_torch_trainer_is_an_engine_under_the_shared_policy_step(make_spec, tiny_model_path):
    """The policy step is written once (relax_plugins.trainer.steps.policy_step); the trainer is
    an engine under it (relax.contracts.TrainerEngine) and its train_step is that step."""
    from relax.contracts import TrainerEngine
    from relax.plan.contexts import algorithm_context, trainer_context
    from relax.registry import get_registry
    from relax_plugins.trainer import steps

    registry = get_registry()
    spec = make_spec()
    loss_cls = registry.load("losses", "ppo_clip")
    trainer = registry.load("trainer", "torch")(
        registry.build_config("trainer", "torch", {}),
        trainer_context(spec, "actor", tiny_model_path, loss=loss_cls(loss_cls.Config(), algorithm_context(spec))))
    assert isinstance(trainer, TrainerEngine)
    called = []
    original = steps.policy_step

    def spy(engine, batch):
        called.append(engine)
        return original(engine, batch)

    steps.policy_step = spy
    try:
        from relax.algo.batch import collate
        from relax.contracts import Generation

        gens = [Generation(0, [1, 2, 3], [4, 5], [-1.0, -1.2], "x"), Generation(0, [1, 2, 3], [6], [-0.5], "y")]
        result = trainer.train_step(collate(gens, [1.0, -1.0], 0, rewards=[1.0, 0.0]))
    finally:
        steps.policy_step = original
    assert called == [trainer]
    assert result["version"] == 1.0 and result["updates"] == 1.0 and "mismatch/frac_over" in result
