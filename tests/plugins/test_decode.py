"""The ``hf`` rollout's lean sampling loop (``relax_plugins.rollout.decode``): it samples exactly
the distribution whose log-probs it reports, truncates as ``transformers`` does, decodes greedily
as ``generate`` does, and honours shared prompts, per-row budgets and pauses."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from relax.contracts import TokenPrompt
from relax_plugins.rollout.decode import _draw, sample, supports
from tests.plugins.test_hf_torch import PROMPTS, _rollout


def test_draws_follow_the_reported_distribution():
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, float("-inf")]]).repeat(40_000, 1)
    torch.manual_seed(0)
    chosen, logp = _draw(logits, temperature=0.8, top_p=1.0, top_k=0)
    expected = torch.softmax(logits[0] / 0.8, dim=-1)
    assert torch.allclose(logp[0].exp(), expected, atol=1e-6)
    seen = torch.bincount(chosen, minlength=5).float() / len(chosen)
    assert (seen - expected).abs().max() < 0.01  # 40k draws: standard error under 0.0025
    assert seen[4] == 0  # a token without probability is never drawn


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 0.7), (3, 0.5), (0, 0.01)])
def test_truncation_is_transformers(top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    chosen, logp = _draw(logits.clone(), temperature=1.0, top_p=top_p, top_k=top_k)
    scores = logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    assert torch.equal(torch.isinf(logp), torch.isinf(scores))
    assert torch.allclose(logp[~torch.isinf(logp)], torch.log_softmax(scores, -1)[~torch.isinf(scores)], atol=1e-6)
    assert torch.isfinite(logp.gather(-1, chosen[:, None])).all()


def test_greedy_matches_generate_and_budgets_cut_rows(make_spec, tiny_model_path):
    """Temperature 0: the lean loop and ``transformers``' ``generate`` pick the same tokens with the
    same log-probs, per-row budgets included."""
    spec = make_spec({"roles.rollout.sampling.temperature": 0.0, "roles.rollout.sampling.max_new_tokens": 6})
    lean = _rollout(spec, tiny_model_path)
    assert lean.lean and supports(lean.model)
    stock = _rollout(spec, tiny_model_path)
    stock.lean = False
    prompts = [TokenPrompt(ids=lean.encode_prompt(p), max_new_tokens=b) for p, b in zip(PROMPTS, [1, 6, 3, 6])]
    sampling = spec.roles.rollout.sampling
    ours, theirs = lean.generate_tokens(prompts, sampling, seed=0), stock.generate_tokens(prompts, sampling, seed=0)
    for a, b, p in zip(ours, theirs, prompts):
        assert a.response_ids == b.response_ids and a.finished == b.finished
        assert len(a.response_ids) <= p.max_new_tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert ours[0].response_ids and len(ours[0].response_ids) == 1


def test_shared_prompts_are_prefilled_once_with_the_same_samples(rollout_model):
    model, stops, pad = rollout_model
    rows = [[5, 6, 7], [5, 6, 7], [9, 4], [9, 4], [5, 6, 7]]
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    try:
        results = []
        for share in (True, False):
            calls.clear()
            torch.manual_seed(3)
            results.append((sample(model, rows, [5] * 5, temperature=1.0, top_p=1.0, top_k=0, stop_ids=stops,
                                   pad_id=pad, share_prompts=share), list(calls)))
    finally:
        handle.remove()
    (shared, shared_calls), (plain, plain_calls) = results
    assert shared_calls[0][0] == 2 and plain_calls[0][0] == 5  # the prefill's rows
    assert shared.tokens == plain.tokens and shared.finished == plain.finished
    for a, b in zip(shared.logprobs, plain.logprobs):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_pause_stops_every_row_unfinished(rollout_model):
    model, stops, pad = rollout_model
    asked = []

    def pause(done):
        asked.append(list(done))
        return len(asked) == 2

    out = sample(model, [[5, 6], [7], [8, 9, 3]], [6, 6, 1], temperature=1.0, top_p=1.0, top_k=0,
                 stop_ids=stops, pad_id=pad, pause=pause)
    assert len(asked) == 2 and asked[0][2] and asked[1][2]  # row 2's budget of 1 is used at once
    assert [len(t) for t in out.tokens][2] == 1 and not out.finished[2]
    for tokens, finished in zip(out.tokens[:2], out.finished[:2]):
        assert len(tokens) <= 2 and finished == (tokens[-1] in stops)


def test_an_empty_prompt_is_refused(rollout_model):
    model, stops, pad = rollout_model
    with pytest.raises(ValueError, match="no tokens"):
        sample(model, [[5], []], [3, 3], temperature=1.0, top_p=1.0, top_k=0, stop_ids=stops, pad_id=pad)


@pytest.fixture(scope="module")
def rollout_model(make_spec, tiny_model_path):
    rollout = _rollout(make_spec(), tiny_model_path)
    return rollout.model, rollout.stop_token_ids, rollout.pad_token_id


def test_a_grammar_constrains_the_lean_loop_and_generate_alike(make_spec, tiny_model_path):
    """A token prompt's grammar (``relax.agents.constraints``): greedy decoding under it picks the
    same tokens with the same (masked) log-probs on the lean loop and in ``generate``'s logits
    processor, and sampled rows all follow it; a free row in the same batch is left alone."""
    import json

    import jsonschema

    from relax.agents.constraints import Choice, grammar

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    outputs = {}
    for temperature in (0.0, 1.0):
        spec = make_spec({"roles.rollout.sampling.temperature": temperature,
                          "roles.rollout.sampling.max_new_tokens": 40})
        lean = _rollout(spec, tiny_model_path)
        stock = _rollout(spec, tiny_model_path)
        stock.lean = False
        text = grammar(Choice(), schema, [], "hermes", "hf", lean.tokenizer)
        prompts = [TokenPrompt(ids=lean.encode_prompt(p), grammar=text) for p in PROMPTS] + \
            [TokenPrompt(ids=lean.encode_prompt(PROMPTS[0]))]
        sampling = spec.roles.rollout.sampling
        outputs[temperature] = [r.generate_tokens(prompts, sampling, seed=1) for r in (lean, stock)]
    (ours, theirs), sampled = outputs[0.0], outputs[1.0]
    for a, b in zip(ours, theirs):
        assert a.response_ids == b.response_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    for generations in (ours, theirs, *sampled):
        for g in generations[:-1]:
            assert g.finished
            jsonschema.validate(json.loads(g.text), schema)
    free = [generations[-1].text for generations in sampled]
    assert not all(t.startswith("{") for t in free)  # the unconstrained row was not held to JSON
