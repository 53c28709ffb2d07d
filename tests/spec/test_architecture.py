"""Parameter counts of the shipped cards, checked against a hand computation.

For a decoder of L layers, width h, H query heads, K kv heads of width d, vocabulary V:
    attention per layer = h*H*d (q) + 2*h*K*d (k, v) + H*d*h (o)
    dense MLP per layer = 3*h*I (SwiGLU gate, up, down)
    MoE MLP per layer   = E*3*h*I_e (experts) + h*E (router)
    norms per layer     = 2*h
    total               = L*(attention + mlp + norms) + V*h*(1 if tied else 2) + h (final norm)
    active (MoE)        = total - L*(E - k)*3*h*I_e   (only k routed experts per token)
"""

from __future__ import annotations

import pytest

from relax.spec.architecture import load_card


def test_qwen3_4b_total_params():
    L, h, H, K, d, I, V = 36, 2560, 32, 8, 128, 9728, 151936
    attention = h * H * d + 2 * h * K * d + H * d * h  # 26,214,400
    per_layer = attention + 3 * h * I + 2 * h  # 100,930,560
    expected = L * per_layer + V * h + h  # tied embeddings: 4,022,458,880
    card = load_card("Qwen/Qwen3-4B")
    assert card.params_total() == expected
    assert card.params_total() == pytest.approx(4.02e9, rel=0.005)
    assert card.params_active() == expected  # dense: every parameter is active


def test_qwen3_30b_a3b_total_and_active_params():
    L, h, H, K, d, V, E, k, Ie = 48, 2048, 32, 4, 128, 151936, 128, 8, 768
    attention = h * H * d + 2 * h * K * d + H * d * h  # 18,874,368
    mlp = E * 3 * h * Ie + h * E  # 604,241,920
    total = L * (attention + mlp + 2 * h) + 2 * V * h + h  # untied: 30,532,110,336
    active = total - L * (E - k) * 3 * h * Ie  # 3,353,020,416
    card = load_card("Qwen/Qwen3-30B-A3B")
    assert card.params_total() == total
    assert card.params_active() == active
    assert card.params_total() == pytest.approx(30.5e9, rel=0.005)
    assert card.params_active() == pytest.approx(3.3e9, rel=0.02)


def test_card_lookup_is_case_insensitive_and_unknown_ids_give_none():
    assert load_card("qwen/qwen3-4b").num_attention_heads == 32
    assert load_card("Nobody/NoModel") is None


def test_qwen2_5_7b_total_params():
    L, h, H, K, d, I, V = 28, 3584, 28, 4, 128, 18944, 152064
    attention = h * H * d + 2 * h * K * d + H * d * h  # 29,360,128
    per_layer = attention + 3 * h * I + 2 * h  # 233,053,184 (q/k/v biases left out: 0.4M)
    expected = L * per_layer + 2 * V * h + h  # untied: 7,615,487,488
    card = load_card("Qwen/Qwen2.5-7B-Instruct")
    assert card.params_total() == expected
    assert card.params_total() == pytest.approx(7.61e9, rel=0.005)  # the model card's 7.61B
