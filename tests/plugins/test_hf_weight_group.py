"""The hf rollout as a receiver of a weight group (gloo on the CPU): the trainer's weights arrive
in place, round after round, and the rollout's log-probs agree with the trainer's again."""

from __future__ import annotations

import threading

import pytest
import torch

from relax.weight_group import WeightSender
from tests.plugins.test_hf_torch import N, PROMPTS, _batch, _max_diff, _rollout, _trainer


def _send(sender: WeightSender, weights: dict, version: int) -> threading.Thread:
    """Broadcast a round on a thread (the receiver runs on this one)."""
    thread = threading.Thread(target=sender.send, args=(weights, version), daemon=True)
    thread.start()
    return thread


def test_collective_rounds_land_in_the_model_and_restore_agreement(make_spec, tiny_model_path):
    spec = make_spec()
    rollout, trainer = _rollout(spec, tiny_model_path), _trainer(spec, tiny_model_path)
    sampling = spec.roles.rollout.sampling
    sender = WeightSender(rollout.weight_group_ranks, timeout_s=60, bucket_bytes=64 << 10, host="127.0.0.1")
    rollout.join_weight_group(sender.address.as_dict())
    try:
        for version in (1, 2):
            batch = _batch(rollout.generate(PROMPTS, N, sampling, seed=version), rollout.pad_token_id)
            trainer.train_step(batch)
            assert _max_diff(batch, trainer.compute_logprobs(batch)) > 1e-4  # the policy moved
            thread = _send(sender, trainer.weights(), version)
            assert rollout.receive_weights() == version
            thread.join(timeout=60)
            assert rollout.version == version
            fresh = _batch(rollout.generate(PROMPTS, N, sampling, seed=10 + version), rollout.pad_token_id)
            assert _max_diff(fresh, trainer.compute_logprobs(fresh)) < 1e-5
        assert sender.round == 2
    finally:
        rollout.close_weight_group()
        sender.close()


def test_a_round_that_does_not_fit_the_model_is_refused_after_it_completes(make_spec, tiny_model_path):
    rollout = _rollout(make_spec(), tiny_model_path)
    sender = WeightSender(1, timeout_s=60, host="127.0.0.1")
    rollout.join_weight_group(sender.address.as_dict())
    try:
        before = {k: v.clone() for k, v in rollout.model.state_dict().items()}
        thread = _send(sender, {"not.a.weight": torch.zeros(3)}, 7)
        with pytest.raises(ValueError, match=r"do not match the model: missing .*unexpected \['not.a.weight'\]"):
            rollout.receive_weights()
        thread.join(timeout=60)
        # Right names, one wrong shape: nothing of the round is loaded.
        good = {k: torch.full_like(v, 0.5) for k, v in rollout.model.state_dict().items()}
        good["model.norm.weight"] = torch.zeros(3)
        thread = _send(sender, good, 8)
        with pytest.raises(ValueError, match=r"wrong shape \['model.norm.weight'\]"):
            rollout.receive_weights()
        thread.join(timeout=60)
        assert not thread.is_alive()  # the sender's round completed: the group stays usable
        assert rollout.version == 0
        assert all(torch.equal(before[k], v) for k, v in rollout.model.state_dict().items())
    finally:
        rollout.close_weight_group()
        sender.close()
