"""How the ``vllm`` rollout turns vLLM's routed-experts capture into ``Generation.routed_experts``
(no vLLM needed): which decoder layers are MoE layers (checked against the Hugging Face model's own
routers), and which positions of a capture are a response's (``P - 1 .. P + R - 2``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_plugins.moe_routing import routers
from relax_plugins.rollout.vllm import VLLMRollout, moe_layer_indices, response_routing


def _qwen3_moe(**changes):
    from transformers import Qwen3MoeConfig

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2)
    return Qwen3MoeConfig(**{**base, **changes})


@pytest.mark.parametrize(("changes", "expected"), [
    ({}, [0, 1, 2, 3]),
    ({"mlp_only_layers": [1]}, [0, 2, 3]),
    ({"decoder_sparse_step": 2}, [1, 3]),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1]),
])
def test_moe_layers_are_those_with_a_router_in_the_hf_model(changes, expected):
    from transformers import Qwen3MoeForCausalLM

    config = _qwen3_moe(**changes)
    assert moe_layer_indices(config) == expected
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    found = routers(model)
    layer_of = {id(m): int(name.split(".")[2]) for name, m in model.named_modules() if name.startswith("model.layers.")
                and name.count(".") == 4}
    assert [layer_of[id(r)] for r in found] == expected


def test_a_dense_model_has_no_moe_layers():
    from transformers import LlamaConfig

    assert moe_layer_indices(LlamaConfig(num_hidden_layers=3)) == []
    assert moe_layer_indices(_qwen3_moe(num_experts=0)) == []


def _capture(positions: int, layers: int, k: int) -> np.ndarray:
    """A capture whose entry at (position, layer, j) is 10 * position + layer + j (distinct, readable)."""
    p, layer, j = np.meshgrid(np.arange(positions), np.arange(layers), np.arange(k), indexing="ij")
    return (10 * p + layer + j).astype(np.uint8)


def test_a_response_keeps_positions_p_minus_1_to_p_plus_r_minus_2_of_its_moe_layers():
    prompt, response, layers, k = 3, 4, 3, 2
    moe = [0, 2]  # layer 1 dense: vLLM's capture has a (zero) entry for it, the recording none
    want = [[[10 * pos + layer + j for j in range(k)] for layer in moe] for pos in range(prompt - 1, prompt + response - 1)]
    full = _capture(prompt + response - 1, layers, k)  # every position the engine routed
    assert response_routing(full, response, moe) == want
    trimmed = full[prompt - 1:]  # routed_experts_prompt_start = P - 1, as the backend asks
    assert response_routing(trimmed, response, moe) == want
    out = response_routing(trimmed, response, moe)
    assert all(type(e) is int for token in out for layer in token for e in layer)


def test_a_capture_that_does_not_cover_the_response_is_an_error():
    with pytest.raises(RuntimeError, match="no routed experts"):
        response_routing(None, 2, [0])
    with pytest.raises(RuntimeError, match="at least 5 positions"):
        response_routing(_capture(4, 2, 2), 5, [0, 1])
    with pytest.raises(RuntimeError, match="and 3 layers"):
        response_routing(_capture(5, 2, 2), 5, [0, 2])


def test_vllm_declares_r3():
    assert VLLMRollout.router_replay == frozenset({"r3"})
    assert "enable_return_routed_experts" in VLLMRollout.OWNED_ARGS
