"""Partial rollouts on the real ``hf`` backend (issue 19): a weight update lands in the middle of
generation, the unfinished samples continue under the new policy, and each token's behaviour
log-prob is the one of the version that chose it; the next step's drafts start only once the
staleness bound admits them.

The version signal (``newer``/``swap``) is driven by the test at a chosen token, the way the
runtime's ``VersionWatch`` drives it when the actor publishes."""

from __future__ import annotations


from relax.algo.staleness import StalenessPolicy
from relax.plan.contexts import rollout_context
from relax.registry import get_registry
from relax.runtime.worker.partial import PartialRollouts, VersionWatch
from relax.testing import teacher_forced_logprobs
from tests.plugins.test_hf_weight_push import _perturbed_checkpoint

PROMPTS = ["12+7=", "3*4=", "9-5=", "21+30="]
N = 3


def _rollout(spec, path: str):
    registry = get_registry()
    return registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}), rollout_context(spec, path))


class SwapAt:
    """Publishes ``weights`` as version 1 once generation asked ``pause`` ``after`` times."""

    def __init__(self, backend, weights, after: int | None) -> None:
        self.backend, self.weights, self.after = backend, weights, after
        self.asked = 0

    def newer(self) -> bool:
        self.asked += 1
        return self.after is not None and self.asked > self.after and self.backend.version == 0

    def swap(self) -> None:
        self.backend.load_weights(self.weights, version=1)


def test_a_mid_generation_update_gives_two_versions_scored_by_their_own_weights(make_spec, tiny_model_path,
                                                                                tmp_path):
    spec = make_spec({"roles.rollout.sampling.max_new_tokens": 16})
    sampling = spec.roles.rollout.sampling
    pushed = _perturbed_checkpoint(tiny_model_path, tmp_path / "pushed", scale=0.05)
    backend = _rollout(spec, tiny_model_path)
    signal = SwapAt(backend, pushed, after=3)
    partial = PartialRollouts(backend, StalenessPolicy(1), newer=signal.newer, swap=signal.swap)
    prompts = [backend.encode_prompt(p) for p in PROMPTS]
    gens, stats = partial.sample(0, prompts, N, sampling, seed=5, next_prompts=None)

    assert len(gens) == len(PROMPTS) * N and [g.prompt_index for g in gens] == [i for i in range(4) for _ in range(N)]
    assert stats.partial_swaps == 1
    mixed = [g for g in gens if set(g.token_versions) == {0, 1}]
    assert mixed, "no sample held tokens of both versions"
    assert stats.partial_interrupted >= len(mixed)
    for g in gens:  # every sample went to its end: a stop token or the whole budget
        assert g.finished or len(g.response_ids) == sampling.max_new_tokens
        assert g.token_versions == sorted(g.token_versions)  # older tokens first
    for g in mixed:
        cut = g.token_versions.index(1)
        old = teacher_forced_logprobs(tiny_model_path, g.prompt_ids, g.response_ids)
        new = teacher_forced_logprobs(str(tmp_path / "pushed"), g.prompt_ids, g.response_ids)
        expected = old[:cut] + new[cut:]
        assert max(abs(a - b) for a, b in zip(g.logprobs, expected)) < 1e-4
        # ...and the other version would have scored the tokens differently
        assert max(abs(a - b) for a, b in zip(g.logprobs[cut:], old[cut:])) > 1e-3


def test_the_next_steps_drafts_start_only_within_the_bound_and_are_carried_over(make_spec, tiny_model_path,
                                                                                 tmp_path):
    spec = make_spec({"roles.rollout.sampling.max_new_tokens": 16})
    sampling = spec.roles.rollout.sampling
    pushed = _perturbed_checkpoint(tiny_model_path, tmp_path / "pushed", scale=0.05)
    backend = _rollout(spec, tiny_model_path)
    prompts = [backend.encode_prompt(p) for p in PROMPTS[:2]]
    following = [backend.encode_prompt(p) for p in PROMPTS[2:]]

    # max_staleness 0 and no new weights: step 1 may not start under version 0.
    still = PartialRollouts(backend, StalenessPolicy(0), newer=lambda: False, swap=lambda: None)
    still.sample(0, prompts, N, sampling, seed=1, next_prompts=lambda: following)
    assert still.ahead is None

    # Version 1 lands during step 0: step 1's drafts start then, all under version 1.
    signal = SwapAt(backend, pushed, after=2)
    partial = PartialRollouts(backend, StalenessPolicy(0), newer=signal.newer, swap=signal.swap)
    first, _ = partial.sample(0, prompts, N, sampling, seed=1, next_prompts=lambda: following)
    assert partial.ahead is not None and partial.ahead[0] == 1
    started = [d for d in partial.ahead[1] if d.response_ids]
    assert started and all(set(d.versions) == {1} for d in started)
    paused = sum(1 for d in partial.ahead[1] if d.response_ids and not d.done)
    assert any(d.done for d in partial.ahead[1]) or paused  # some of step 1 was generated during step 0
    second, stats = partial.sample(1, following, N, sampling, seed=2, next_prompts=None)
    assert all(set(g.token_versions) == {1} for g in second)  # staleness 0 at step 1
    assert stats.partial_interrupted == paused  # continued: the ones that were cut short
    assert all(g.finished or len(g.response_ids) == sampling.max_new_tokens for g in second)
    assert partial.ahead is None


def test_drafts_for_other_prompts_are_not_taken(make_spec, tiny_model_path):
    """A re-leased step, or one after a restart, starts afresh rather than take drafts of other prompts."""
    spec = make_spec({"roles.rollout.sampling.max_new_tokens": 8})
    backend = _rollout(spec, tiny_model_path)
    partial = PartialRollouts(backend, StalenessPolicy(1), newer=lambda: False, swap=lambda: None)
    prompts = [backend.encode_prompt(p) for p in PROMPTS[:2]]
    partial.sample(0, prompts, 2, spec.roles.rollout.sampling, seed=1,
                   next_prompts=lambda: [backend.encode_prompt("99+1=")])
    assert partial.ahead is not None
    gens, stats = partial.sample(1, prompts, 2, spec.roles.rollout.sampling, seed=2, next_prompts=None)
    assert len(gens) == 4 and stats.partial_interrupted == 0


def test_the_version_watch_sees_a_newer_version_without_waiting():
    published = {"version": 0}

    def poll(min_version: int, timeout_s: float):
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if published["version"] >= min_version:
                return published["version"]
            time.sleep(0.005)
        return None

    held = {"version": 0}
    watch = VersionWatch(poll, lambda: held["version"], slice_s=0.05)
    try:
        assert not watch.newer()
        published["version"] = 2
        import time

        deadline = time.monotonic() + 5
        while not watch.newer() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.newer()
        held["version"] = 2
        assert not watch.newer()
    finally:
        watch.close()


def test_drafts_beyond_a_narrowed_bound_are_generated_again(make_spec, tiny_model_path):
    """max_staleness: auto may narrow the bound after the next step's drafts started: they are
    generated afresh under the weights held now (none of them was emitted, so nothing is lost)."""
    spec = make_spec({"roles.rollout.sampling.max_new_tokens": 8})
    backend = _rollout(spec, tiny_model_path)
    partial = PartialRollouts(backend, StalenessPolicy(1), newer=lambda: False, swap=lambda: None)
    prompts = [backend.encode_prompt(p) for p in PROMPTS[:2]]
    following = [backend.encode_prompt(p) for p in PROMPTS[2:]]
    partial.sample(0, prompts, 2, spec.roles.rollout.sampling, seed=1, next_prompts=lambda: following)
    assert partial.ahead is not None and any(d.response_ids for d in partial.ahead[1])
    partial.policy = StalenessPolicy(0)  # step 1 now needs version 1; the drafts are of version 0
    backend.version = 1
    gens, stats = partial.sample(1, following, 2, spec.roles.rollout.sampling, seed=2, next_prompts=None)
    assert stats.partial_interrupted == 0 and all(set(g.token_versions) == {1} for g in gens)
