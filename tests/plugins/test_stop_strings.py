"""Stop strings and the repetition penalty in the ``hf`` rollout (both of its sampling paths), and
how a stop string's response reaches the loss: cut after the token that completes it, that token
kept like a stop token."""

from __future__ import annotations

import pytest
import torch

from relax.algo.batch import collate
from relax.algo.stop_strings import StopStrings
from relax.contracts import Generation
from relax.plan.contexts import rollout_context
from relax.registry import get_registry
from relax.runtime.worker.partial import Draft

PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1=", "1+1=", "2+2="]


@pytest.fixture(scope="module")
def spec(make_spec):
    return make_spec({"roles.rollout.sampling": {"temperature": 0.0, "max_new_tokens": 8}})


@pytest.fixture(scope="module")
def rollout(spec, tiny_model_path):
    registry = get_registry()
    return registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                          rollout_context(spec, tiny_model_path))


def _sampling(spec, **changes):
    return spec.roles.rollout.sampling.model_copy(update=changes)


def _generate(rollout, sampling, lean=True):
    was, rollout.lean = rollout.lean, lean
    try:
        return rollout.generate(PROMPTS, 1, sampling, seed=0)
    finally:
        rollout.lean = was


@pytest.mark.parametrize("lean", [True, False], ids=["lean-loop", "generate"])
def test_a_response_ends_with_the_token_that_completes_a_stop_string(rollout, spec, lean):
    plain = _generate(rollout, _sampling(spec), lean)
    stopped = _generate(rollout, _sampling(spec, stop=[" "]), lean)
    # The greedy answers hold a space after their first number ("8 1"): a likely stop string.
    cut = 0
    for before, after in zip(plain, stopped):
        assert after.prompt_ids == before.prompt_ids
        if " " not in before.text:
            assert after.response_ids == before.response_ids and after.text == before.text
            continue
        cut += 1
        space = rollout.tokenizer.convert_tokens_to_ids(" ") if " " in rollout.tokenizer.get_vocab() else None
        at = next(i for i in range(1, len(before.response_ids) + 1)
                  if " " in rollout.tokenizer.decode(before.response_ids[:i], skip_special_tokens=True))
        assert after.response_ids == before.response_ids[:at]  # the tokens after it are cut
        assert after.logprobs == pytest.approx(before.logprobs[:at], abs=1e-5)
        assert after.finished
        assert after.text == before.text.split(" ")[0]  # the text ends before the stop string
        if space is not None:
            assert after.response_ids[-1] == space
    assert cut >= 2


def test_the_stop_string_is_trained_on_like_the_stop_token(rollout, spec):
    stopped = _generate(rollout, _sampling(spec, stop=[" "]), True)
    eos = rollout.eos_token_id
    batch = collate(stopped, torch.zeros(len(stopped)), rollout.pad_token_id, rewards=[0.0] * len(stopped))
    lengths = batch.response_mask.sum(dim=1).long().tolist()
    for row, gen in enumerate(stopped):
        # Every response token is in the loss: the eos a response ended on, and the token that
        # completed the stop string alike; nothing after either is in the batch.
        assert lengths[row] == len(gen.response_ids)
        ids = batch.input_ids[row][batch.response_mask[row].bool()].tolist()
        assert ids == gen.response_ids
        ended_on = "eos" if gen.response_ids[-1] == eos else "stop string"
        assert gen.finished, ended_on
    assert any(g.response_ids[-1] != eos for g in stopped) and any(g.response_ids[-1] == eos for g in stopped)


def test_the_repetition_penalty_is_transformers_ctrl_penalty(rollout, spec):
    from transformers import RepetitionPenaltyLogitsProcessor

    plain = _generate(rollout, _sampling(spec), True)
    penalized = _generate(rollout, _sampling(spec, repetition_penalty=3.0), True)
    assert [g.response_ids for g in plain] != [g.response_ids for g in penalized]  # greedy answers change
    # The first token's reported log-prob is that of the penalized distribution (temperature 1).
    sampled = rollout.generate(PROMPTS, 1, _sampling(spec, temperature=1.0, repetition_penalty=3.0), seed=3)
    for gen in sampled:
        ids = torch.tensor([gen.prompt_ids])
        with torch.no_grad():
            logits = rollout.model(input_ids=ids).logits[:, -1].float()
        scores = RepetitionPenaltyLogitsProcessor(3.0)(ids, logits)
        expected = torch.log_softmax(scores, dim=-1)[0, gen.response_ids[0]].item()
        unpenalized = torch.log_softmax(logits, dim=-1)[0, gen.response_ids[0]].item()
        assert gen.logprobs[0] == pytest.approx(expected, abs=1e-4)
        if abs(expected - unpenalized) > 1e-3:
            assert gen.logprobs[0] != pytest.approx(unpenalized, abs=1e-4)


def test_both_sampling_paths_agree_on_the_penalty_and_stop_strings(rollout, spec):
    sampling = _sampling(spec, repetition_penalty=2.0, stop=["0", " "])
    lean, generate = _generate(rollout, sampling, True), _generate(rollout, sampling, False)
    assert [g.response_ids for g in lean] == [g.response_ids for g in generate]
    assert [g.text for g in lean] == [g.text for g in generate]


def test_a_stop_string_across_partial_pieces_ends_the_sample_there(rollout):
    tok = rollout.tokenizer
    stops = StopStrings(tok, ["12"])
    ids = tok("12+3", add_special_tokens=False)["input_ids"]
    first, rest = ids[:1], ids[1:]  # "1" | "2+3": the string completes on the second piece's first token
    draft = Draft(prompt_index=0, prompt_ids=[5], budget=8)
    draft.extend(Generation(0, [5], first, [-0.1], "1", finished=False), version=0, stops=stops)
    assert not draft.finished
    draft.extend(Generation(0, [5] + first, rest, [-0.2] * len(rest), "2+3", finished=False), version=1, stops=stops)
    assert draft.finished and draft.response_ids == ids[:2] and draft.versions == [0, 1]
    assert draft.logprobs == [-0.1, -0.2]
    from relax.algo.stop_strings import response_text

    assert response_text(tok, draft.response_ids, draft.finished, [rollout.eos_token_id], stops) == ""


def test_stop_strings_find_the_first_completion_only_in_the_response(rollout):
    tok = rollout.tokenizer
    stops = StopStrings(tok, ["+", "=="])
    ids = tok("1=2==3+4", add_special_tokens=False)["input_ids"]
    assert stops.end(ids) == len(tok("1=2==", add_special_tokens=False)["input_ids"])
    assert stops.text(ids) == "1=2"
    assert stops.end(tok("123", add_special_tokens=False)["input_ids"]) is None
    with pytest.raises(ValueError, match="empty stop string"):
        StopStrings(tok, [""])


def test_the_generate_path_penalizes_a_rows_own_tokens_not_its_padding():
    from relax_plugins.rollout.hf import _row_repetition_penalty

    pad = 0
    input_ids = torch.tensor([[pad, pad, 5, 6], [1, 2, 5, 6]])
    scores = torch.tensor([[2.0, 2.0, 2.0, 2.0, 2.0, 2.0, -2.0, 2.0]] * 2)
    out = _row_repetition_penalty(2.0, [2, 0])(input_ids, scores.clone())
    # Row 0: its tokens 5 (2 -> 1) and 6 (-2 -> -4); the padding's token 0 is left alone.
    assert out[0].tolist() == [2.0, 2.0, 2.0, 2.0, 2.0, 1.0, -4.0, 2.0]
    assert out[1].tolist() == [2.0, 1.0, 1.0, 2.0, 2.0, 1.0, -4.0, 2.0]
