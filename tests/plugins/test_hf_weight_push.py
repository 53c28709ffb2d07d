"""Prefix-cache safety of the ``hf`` rollout (issue 18, item 5): after a weight push its log-probs
equal a fresh backend's on the new weights. ``hf`` keeps no KV cache across ``generate`` calls, so
nothing of the old weights may survive a push; this holds it on prompts sharing a long prefix (what
an engine with a prefix cache would reuse), as the vllm lane's test does for vLLM."""

from __future__ import annotations

from pathlib import Path

import torch

from relax.plan.contexts import rollout_context
from relax.registry import get_registry

SHARED_PREFIX = "1+2+3+4+5+6+7+8+9+" * 2
PREFIXED = [SHARED_PREFIX + tail for tail in ("1=", "22=", "3+4=")]
N = 3


def _perturbed_checkpoint(model_path: str, folder: Path, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise, saved as a checkpoint folder (with the tokenizer);
    returns its state dict, as a trainer would push it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * scale)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _rollout(spec, path: str):
    registry = get_registry()
    return registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}), rollout_context(spec, path))


def test_a_weight_push_scores_like_a_fresh_backend_on_the_new_weights(make_spec, tiny_model_path, tmp_path):
    spec = make_spec({"data.max_prompt_tokens": 48})
    sampled = spec.roles.rollout.sampling
    pushed = _perturbed_checkpoint(tiny_model_path, tmp_path / "pushed")
    rollout = _rollout(spec, tiny_model_path)
    before = rollout.generate(PREFIXED, N, sampled, seed=7)
    assert all(g.prompt_ids[:len(SHARED_PREFIX)] == before[0].prompt_ids[:len(SHARED_PREFIX)] for g in before)
    rollout.load_weights(pushed, version=1)
    after = rollout.generate(PREFIXED, N, sampled, seed=7)
    expected = _rollout(spec, str(tmp_path / "pushed")).generate(PREFIXED, N, sampled, seed=7)
    moved = max(abs(a - b) for x, y in zip(before, expected) for a, b in zip(x.logprobs, y.logprobs))
    assert moved > 1e-2  # the new weights score these prompts differently
    assert [g.response_ids for g in after] == [g.response_ids for g in expected]
    diff = max(abs(a - b) for x, y in zip(after, expected) for a, b in zip(x.logprobs, y.logprobs))
    assert diff < 1e-6, diff
