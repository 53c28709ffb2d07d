"""The hf rollout and the torch trainer on the same tiny model: log-probs agree, seeds reproduce,
training moves the weights, weight sync restores agreement, checkpoints round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from relax.algo.batch import collate
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry

#: Prompts of different token lengths, so rows are left-padded.
PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]
N = 3


def _rollout(spec, path, **options):
    registry = get_registry()
    return registry.load("rollout", "hf")(registry.build_config("rollout", "hf", options),
                                          rollout_context(spec, path))


def _trainer(spec, path, role="actor", **options):
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", options),
                                             trainer_context(spec, role, path, loss=loss))


@pytest.fixture(scope="module")
def spec(make_spec):
    return make_spec()


@pytest.fixture(scope="module")
def rollout(spec, tiny_model_path):
    return _rollout(spec, tiny_model_path)


def _batch(gens, pad_id, advantages=None):
    if advantages is None:
        advantages = torch.linspace(-1.0, 1.0, len(gens))
    return collate(gens, advantages, pad_id, rewards=[0.0] * len(gens))


def _max_diff(batch, logprobs):
    mask = batch.response_mask.bool()
    return (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item()


def test_generate_shapes_and_stops(rollout, spec):
    gens = rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=0)
    assert len(gens) == len(PROMPTS) * N
    assert [g.prompt_index for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(N)]
    eos = rollout.eos_token_id
    for g in gens:
        assert g.prompt_ids == rollout.encode_prompt(PROMPTS[g.prompt_index])
        assert len(g.logprobs) == len(g.response_ids) and all(lp <= 0 for lp in g.logprobs)
        assert 1 <= len(g.response_ids) <= spec.roles.rollout.sampling.max_new_tokens
        assert eos not in g.response_ids[:-1]
        assert g.finished == (g.response_ids[-1] == eos)
        text_ids = g.response_ids[:-1] if g.finished else g.response_ids
        assert g.text == rollout.tokenizer.decode(text_ids, skip_special_tokens=True)


def test_same_seed_same_generations(rollout, spec):
    sampling = spec.roles.rollout.sampling
    first = rollout.generate(PROMPTS, N, sampling, seed=11)
    again = rollout.generate(PROMPTS, N, sampling, seed=11)
    other = rollout.generate(PROMPTS, N, sampling, seed=12)
    assert [(g.response_ids, g.logprobs) for g in first] == [(g.response_ids, g.logprobs) for g in again]
    assert [g.response_ids for g in first] != [g.response_ids for g in other]


def test_batched_and_split_generation_agree_on_logprobs(spec, tiny_model_path):
    small = _rollout(spec, tiny_model_path, max_batch_size=2)
    gens = small.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=5)
    trainer = _trainer(spec, tiny_model_path)
    batch = _batch(gens, small.pad_token_id)
    assert _max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5


def test_rollout_and_trainer_logprobs_agree_then_sync(rollout, spec, tiny_model_path):
    trainer = _trainer(spec, tiny_model_path)
    sampling = spec.roles.rollout.sampling
    gens = rollout.generate(PROMPTS, N, sampling, seed=1)
    batch = _batch(gens, rollout.pad_token_id)
    assert _max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5

    before = {k: v.clone() for k, v in trainer.weights().items()}
    metrics = trainer.train_step(batch)
    for key in ("loss", "grad_norm", "lr", "clip_fraction", "approx_kl", "ratio_mean", "tis_weight_mean"):
        assert key in metrics
    assert metrics["lr"] == pytest.approx(spec.roles.actor.optimizer.lr)
    after = trainer.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert _max_diff(batch, trainer.compute_logprobs(batch)) > 1e-4  # the policy moved

    rollout.load_weights(after, version=1)
    assert rollout.version == 1
    fresh = rollout.generate(PROMPTS, N, sampling, seed=2)
    fresh_batch = _batch(fresh, rollout.pad_token_id)
    assert _max_diff(fresh_batch, trainer.compute_logprobs(fresh_batch)) < 1e-5


def test_temperature_scaled_logprobs_agree(make_spec, tiny_model_path):
    spec = make_spec({"roles.rollout.sampling.temperature": 0.7})
    rollout = _rollout(spec, tiny_model_path)
    trainer = _trainer(spec, tiny_model_path)
    assert trainer.temperature == 0.7
    gens = rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=3)
    batch = _batch(gens, rollout.pad_token_id)
    assert _max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5


def test_weights_are_full_and_detached(spec, tiny_model_path):
    trainer = _trainer(spec, tiny_model_path)
    weights = trainer.weights()
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights
    weights["lm_head.weight"].zero_()
    assert trainer.model.lm_head.weight.abs().sum() > 0


def test_load_weights_rejects_a_mismatch(rollout):
    with pytest.raises(ValueError, match="do not match"):
        rollout.load_weights({"not.a.weight": torch.zeros(1)}, version=5)


def test_micro_batching_gives_the_same_update(make_spec, rollout, tiny_model_path):
    gens = rollout.generate(PROMPTS, N, rollout_sampling(make_spec), seed=4)
    batch = _batch(gens, rollout.pad_token_id)
    results = []
    for size in (2, 64):  # SGD: the update is the gradient itself (Adam's first step is its sign)
        trainer = _trainer(make_spec({"roles.actor.micro_batch_size": size,
                                      "roles.actor.optimizer": {"name": "sgd", "lr": 1.0}}), tiny_model_path)
        metrics = trainer.train_step(batch)
        results.append((metrics, trainer.weights()))
    (m_small, w_small), (m_big, w_big) = results
    initial = _trainer(make_spec(), tiny_model_path).weights()
    assert max((w_small[k] - initial[k]).abs().max().item() for k in initial) > 1e-3
    assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4)
    for key in w_small:
        assert torch.allclose(w_small[key], w_big[key], atol=1e-6), key


def rollout_sampling(make_spec):
    return make_spec().roles.rollout.sampling


def test_updates_per_step_takes_several_optimizer_steps(make_spec, rollout, tiny_model_path):
    gens = rollout.generate(PROMPTS, N, rollout_sampling(make_spec), seed=6)
    batch = _batch(gens, rollout.pad_token_id)
    trainer = _trainer(make_spec({"algorithm.updates_per_step": 3}), tiny_model_path)
    metrics = trainer.train_step(batch)
    assert metrics["updates"] == 3
    assert trainer.optimizer.state[trainer.model.lm_head.weight]["step"].item() == 3


def test_adam_runs_fused_on_cpu_and_updates_as_the_loop_does(spec, rollout, tiny_model_path):
    """The trainer's Adam takes torch's fused kernel on CPU float parameters (one kernel instead of
    a loop over parameters), and its update equals the loop's up to float rounding."""
    from relax_plugins.trainer.steps import build_optimizer

    batch = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=9), rollout.pad_token_id)
    fused, looped = _trainer(spec, tiny_model_path), _trainer(spec, tiny_model_path)
    assert fused.optimizer.defaults["fused"] is True
    looped.optimizer = torch.optim.AdamW(looped.optimizer.param_groups[0]["params"],
                                         **{k: v for k, v in fused.optimizer.defaults.items()
                                            if k in ("lr", "betas", "eps", "weight_decay")})
    fused.train_step(batch)
    looped.train_step(batch)
    before = _trainer(spec, tiny_model_path).weights()
    moved = 0
    for key, value in fused.weights().items():
        assert torch.allclose(value, looped.weights()[key], atol=1e-6, rtol=1e-5), key
        moved += not torch.equal(value, before[key])
    assert moved > 0
    # elsewhere (here the meta device) torch's default
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert build_optimizer([meta], fused.optimizer_info, "torch").defaults["fused"] is None


def test_save_and_load_round_trip_exactly(spec, rollout, tiny_model_path, tmp_path):
    sampling = spec.roles.rollout.sampling
    first = _batch(rollout.generate(PROMPTS, N, sampling, seed=7), rollout.pad_token_id)
    second = _batch(rollout.generate(PROMPTS, N, sampling, seed=8), rollout.pad_token_id)
    trainer = _trainer(spec, tiny_model_path)
    trainer.train_step(first)
    saved = trainer.weights()
    trainer.save(str(tmp_path / "ckpt"))
    trainer.save(str(tmp_path / "ckpt"))  # overwriting an existing checkpoint works
    trainer.train_step(second)
    continued = trainer.weights()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging leftovers

    restored = _trainer(spec, tiny_model_path)
    restored.load(str(tmp_path / "ckpt"))
    assert restored.version == 1
    for key, value in restored.weights().items():
        assert torch.equal(value, saved[key]), key
    restored.train_step(second)
    for key, value in restored.weights().items():
        assert torch.equal(value, continued[key]), key


def test_forward_only_role_cannot_train(make_spec, rollout, tiny_model_path):
    spec = make_spec({"roles.reference": {"backend": "torch"}, "algorithm.kl_coef": 0.1})
    reference = _trainer(spec, tiny_model_path, role="reference")
    batch = _batch(rollout.generate(PROMPTS[:1], 2, spec.roles.rollout.sampling, seed=9), rollout.pad_token_id)
    assert reference.compute_logprobs(batch).shape == batch.input_ids.shape
    with pytest.raises(RuntimeError, match="forward-only"):
        reference.train_step(batch)


#: SGD, so the update is proportional to the gradient (Adam's first step is sign(gradient), which
#: float round-off can flip for gradients near zero).
DP_SPEC = {"name": "dp", "tracing": {"exporter": "none"}, "algorithm": {"updates_per_step": 2},
           "roles": {"actor": {"micro_batch_size": 2, "optimizer": {"name": "sgd", "lr": 1.0}}}}


def _dp_rank(rank: int, world: int, port: int, model_path: str, batch, out_file: str) -> None:
    """One data-parallel rank (run in a forked child, so torch and transformers are already loaded)."""
    import os

    import torch.distributed as dist

    from relax.spec import validate_spec as validate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = _trainer(validate({**DP_SPEC, "model": {"path": model_path}}), model_path)
        # rank r takes rows r, r + world, ... and splits them in two, one half per update
        metrics = trainer.train_step(batch.select([i for i in range(batch.batch_size) if i % world == rank]))
        if rank == 0:
            torch.save({"weights": trainer.weights(), "metrics": metrics}, out_file)
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_take_the_whole_batch_update(rollout, tiny_model_path, tmp_path):
    import multiprocessing
    import socket

    from relax.spec import validate_spec as validate

    spec = validate({**DP_SPEC, "model": {"path": tiny_model_path}})
    gens = rollout.generate(PROMPTS, 4, spec.roles.rollout.sampling, seed=10)
    batch = _batch(gens, rollout.pad_token_id)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fork = multiprocessing.get_context("fork")
    out = str(tmp_path / "out.pt")
    ranks = [fork.Process(target=_dp_rank, args=(r, 2, port, tiny_model_path, batch, out)) for r in range(2)]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in ranks] == [0, 0]
    parallel = torch.load(out, weights_only=False)

    # per update, the single process sees the rows the two ranks saw together
    single = _trainer(spec, tiny_model_path)
    metrics = single.train_step(batch)
    assert parallel["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert parallel["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    initial = _trainer(spec, tiny_model_path).weights()
    for key, value in single.weights().items():
        assert torch.allclose(parallel["weights"][key], value, atol=1e-6), key
    assert max((single.weights()[k] - initial[k]).abs().max().item() for k in initial) > 1e-3


def test_packed_rows_give_the_padded_logprobs_and_update(make_spec, rollout, tiny_model_path):
    """The trainer's forward on packed rows (``relax.algo.packing``: no padding, each prompt once
    for its samples) gives the log-probs, loss, gradient norm and update of the padded rows."""
    from relax.algo.packing import pack_rows

    spec = make_spec({"roles.actor.micro_batch_size": 64, "roles.actor.optimizer": {"name": "sgd", "lr": 1.0}})
    batch = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=12), rollout.pad_token_id)
    packed_rows = pack_rows(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask)
    assert packed_rows.slots < batch.input_ids.numel()
    packed, padded = _trainer(spec, tiny_model_path), _trainer(spec, tiny_model_path, pack_sequences=False)
    mask = batch.response_mask.bool()
    assert (packed.compute_logprobs(batch) - padded.compute_logprobs(batch))[mask].abs().max() < 1e-5
    assert packed._pack is True and padded._pack is False
    m_packed, m_padded = packed.train_step(batch), padded.train_step(batch)
    assert m_packed["loss"] == pytest.approx(m_padded["loss"], abs=1e-6)
    assert m_packed["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=1e-4)
    for key, value in packed.weights().items():
        assert torch.allclose(value, padded.weights()[key], atol=1e-6), key


def test_a_model_whose_attention_ignores_packing_keeps_padded_rows(spec, rollout, tiny_model_path):
    """A model whose attention ignores an explicit mask (here: one that drops 4D masks, so it
    would attend across the packed samples) fails the one-time check, and the trainer keeps padded
    rows with the right log-probs."""
    trainer = _trainer(spec, tiny_model_path)
    padded = _trainer(spec, tiny_model_path, pack_sequences=False)
    forward = trainer.model.forward

    def blind(input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    trainer.model.forward = blind
    batch = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=13), rollout.pad_token_id)
    mask = batch.response_mask.bool()
    assert (trainer.compute_logprobs(batch) - padded.compute_logprobs(batch))[mask].abs().max() < 1e-5
    assert trainer._pack is False


def test_the_critic_trains_on_padded_rows(make_spec, rollout, tiny_model_path):
    """The critic (a value head) never packs: its values are read per padded column."""
    spec = make_spec({"algorithm.name": "ppo", "roles.critic": {"backend": "torch"}})
    critic = _trainer(spec, tiny_model_path, role="critic")
    assert critic._pack is False
    batch = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=14), rollout.pad_token_id)
    assert critic.compute_values(batch).shape == batch.input_ids.shape


def test_a_colocated_rollout_generates_with_the_trainers_own_model(make_spec, spec, tiny_model_path):
    """Colocate (``share_policy_model``): the rollout takes the trainer's model instead of its own
    copy. After a train step, publishing moves only the version, and the rollout's samples are
    those of a rollout loaded with the trained weights (same tokens, same log-probs)."""
    from relax.runtime.worker.weight_channels import InProcessWeights, share_policy_model

    trainer, sharing, copy = _trainer(spec, tiny_model_path), _rollout(spec, tiny_model_path), _rollout(spec, tiny_model_path)
    channel = InProcessWeights()
    channel.publish(0, trainer.weights())
    assert share_policy_model(channel, trainer, sharing)
    assert sharing.model is trainer.model and channel.weights == {}
    sampling = spec.roles.rollout.sampling
    trainer.train_step(_batch(sharing.generate(PROMPTS, N, sampling, seed=1), sharing.pad_token_id))
    channel.publish(1, trainer.weights())
    version, weights = channel.wait(1, held=sharing.version)
    assert (version, weights) == (1, {})  # no snapshot travels
    sharing.load_weights(weights, version)
    copy.load_weights(trainer.weights(), 1)
    trainer.model.train()  # left in training mode: the rollout samples in eval mode all the same
    shared_gens, copied_gens = (r.generate(PROMPTS, N, sampling, seed=2) for r in (sharing, copy))
    assert sharing.version == 1
    assert [(g.response_ids, g.logprobs) for g in shared_gens] == [(g.response_ids, g.logprobs) for g in copied_gens]
    # a full state dict still loads (a resume's weights), into the one shared model
    sharing.load_weights(copy.model.state_dict(), 2)
    assert sharing.version == 2


def test_a_model_of_another_kind_or_dtype_is_not_shared(make_spec, spec, tiny_model_path):
    from relax.runtime.worker.weight_channels import InProcessWeights, share_policy_model

    critic_spec = make_spec({"algorithm.name": "ppo", "roles.critic": {"backend": "torch"}})
    critic = _trainer(critic_spec, tiny_model_path, role="critic")
    assert critic.shareable_model() is None
    rollout = _rollout(spec, tiny_model_path)
    channel = InProcessWeights()
    assert not share_policy_model(channel, critic, rollout) and not channel.shares_model
    trainer = _trainer(spec, tiny_model_path)
    trainer.model.to(torch.float64)
    own = rollout.model
    assert not share_policy_model(channel, trainer, rollout)
    assert rollout.model is own and not rollout.shares_model


def test_same_device_matches_indexed_devices_and_tells_kinds_apart():
    from relax_plugins.rollout.hf import same_device

    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert same_device(cpu, torch.device("cpu")) and same_device(cuda1, torch.device("cuda:1"))
    assert not same_device(cpu, torch.device("cuda")) and not same_device(cuda0, cuda1)
    assert not same_device(cuda0, cpu)
