"""Routing replay on the tiny Qwen3-MoE (``builtin:tiny-lm`` with ``architecture: qwen3_moe``): the hf
rollout records each response token's experts, the bus column carries them compactly, and the
torch trainer's forward passes route with them (r3) or with its own first-pass routing (r2)."""

from __future__ import annotations

import pytest
import torch

from relax.algo.batch import TrainBatch, collate
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry
from relax.roles import Column
from relax.runtime.worker.rows import relayout, rollout_columns
from relax_plugins.moe_routing import recorded_routing, replayed_routing, routers

PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]
N = 3
MOE = {"architecture": "qwen3_moe", "warmup_steps": 60}


@pytest.fixture(scope="module")
def moe_path(tiny_cache) -> str:
    cls = get_registry().load("models", "tiny-lm")
    return cls(cls.Config(**MOE)).materialize(str(tiny_cache))


@pytest.fixture(scope="module")
def spec(make_spec, moe_path):
    return make_spec({"model.path": moe_path, "algorithm.router_replay": "r3", "algorithm.samples_per_prompt": N})


def _trainer(spec, path, **options):
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", options),
                                             trainer_context(spec, "actor", path, loss=loss))


@pytest.fixture(scope="module")
def rollout(spec, moe_path):
    registry = get_registry()
    return registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}), rollout_context(spec, moe_path))


@pytest.fixture(scope="module")
def gens(rollout, spec):
    return rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=3)


def _bus_batch(gens, pad_id, ragged=False) -> TrainBatch:
    columns = rollout_columns(gens, PROMPTS, [""] * len(PROMPTS), pad_id, ragged=ragged)
    columns[Column.advantages] = torch.linspace(-1.0, 1.0, len(gens))
    return TrainBatch.from_columns(columns, [0] * len(gens))


def _routing_of(model, batch) -> torch.Tensor:
    """The experts the model's routers pick in a forward pass over the batch, in the bus form."""
    with torch.no_grad(), recorded_routing(model, *batch.input_ids.shape) as recorded:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
              use_cache=False)
    return recorded[0]


def test_the_tiny_moe_reports_its_experts_and_loads(moe_path):
    cls = get_registry().load("models", "tiny-lm")
    arch = cls(cls.Config(**MOE)).architecture()
    assert (arch["num_experts"], arch["experts_per_token"]) == (4, 2)
    dense = cls(cls.Config()).architecture()
    assert dense["num_experts"] == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert len(routers(model)) == 2 and all(r.top_k == 2 and r.num_experts == 4 for r in routers(model))


def test_the_rollout_records_every_response_tokens_experts(gens, rollout):
    used = set()
    for g in gens:
        assert g.routed_experts is not None and len(g.routed_experts) == len(g.response_ids)
        for token in g.routed_experts:
            assert len(token) == 2  # layers
            for experts in token:
                assert len(experts) == 2 and len(set(experts)) == 2 and all(0 <= e < 4 for e in experts)
                used.update(experts)
    assert used == {0, 1, 2, 3}  # the load-balanced warm-up keeps every expert in use
    # The recording is the model's own routing of the same sequences in one forward pass.
    batch = _bus_batch(gens, rollout.pad_token_id)
    mask = batch.response_mask.bool()
    assert torch.equal(_routing_of(rollout.model, batch)[mask], batch.routed_experts[mask].long())


def test_no_recording_unless_asked(make_spec, moe_path, spec):
    registry = get_registry()
    plain = make_spec({"model.path": moe_path})
    backend = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(plain, moe_path))
    out = backend.generate(PROMPTS[:1], 2, plain.roles.rollout.sampling, seed=3)
    assert all(g.routed_experts is None for g in out)
    assert Column.routed_experts not in rollout_columns(out, PROMPTS, [""] * 4, backend.pad_token_id)


def test_the_bus_column_is_compact_and_aligned_with_the_tokens(gens, rollout):
    columns = rollout_columns(gens, PROMPTS, [""] * len(PROMPTS), rollout.pad_token_id)
    routed = columns[Column.routed_experts]
    rows, width = columns[Column.input_ids].shape
    assert routed.dtype == torch.uint8 and routed.shape == (rows, width, 2, 2)
    prompt_width = max(len(g.prompt_ids) for g in gens)
    for i, g in enumerate(gens):
        end = prompt_width + len(g.response_ids)
        assert routed[i, prompt_width:end].tolist() == g.routed_experts
        assert not routed[i, :prompt_width].any() and not routed[i, end:].any()
    # Ragged (a step in several units): one [P + R, layers, k] tensor per row, laid out again as dense.
    ragged = rollout_columns(gens, PROMPTS, [""] * len(PROMPTS), rollout.pad_token_id, ragged=True)
    assert [tuple(t.shape) for t in ragged[Column.routed_experts]] == [
        (len(g.prompt_ids) + len(g.response_ids), 2, 2) for g in gens]

    class Taken:
        fields = dict(ragged)
    dense = relayout(Taken()).fields
    lengths = dense[Column.lengths]
    assert dense[Column.routed_experts].shape == (rows, int(lengths[:, 0].max() + lengths[:, 1].max()), 2, 2)
    assert torch.equal(dense[Column.routed_experts][:, :width], routed)
    # TrainBatch keeps it aligned through row and column selections.
    batch = TrainBatch.from_columns({**columns, Column.advantages: torch.zeros(rows)}, [0] * rows)
    part = batch.select([2, 0]).select_columns(slice(1, width))
    assert torch.equal(part.routed_experts, routed[[2, 0]][:, 1:])
    assert torch.equal(next(batch.split(5)).routed_experts, routed[:5][:, batch.select(slice(0, 5)).used_columns()])


def test_replay_forces_the_recorded_experts_and_keeps_the_router_in_the_graph(spec, moe_path, gens, rollout):
    model = rollout.model
    batch = _bus_batch(gens, rollout.pad_token_id)
    mask = batch.response_mask.bool()
    # Experts the router would not pick: the two it ranks lowest, for every response token.
    own = _routing_of(model, batch)
    forced = batch.routed_experts.clone()
    for i, j in mask.nonzero().tolist():
        for layer in range(2):
            forced[i, j, layer] = torch.tensor([e for e in range(4) if e not in own[i, j, layer].tolist()])
    with replayed_routing(model, forced, batch.response_mask):
        assert torch.equal(_routing_of(model, batch)[mask], forced[mask].long())
    gate = routers(model)[0]
    with replayed_routing(model, forced, batch.response_mask):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
    logits.sum().backward()
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    assert "forward" not in vars(gate)  # the patch is gone after the block


def test_r3_trainer_routes_the_update_with_the_recorded_experts(spec, moe_path, gens, rollout):
    trainer = _trainer(spec, moe_path)  # micro-batches of 5 rows
    batch = _bus_batch(gens, rollout.pad_token_id)
    # Replayed log-probs equal the rollout's.
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item() < 1e-4
    # Perturb the recorded routing (a stale or mismatched rollout): the update must use it, not
    # the router's own choice, at every response token's predecessor.
    routed = batch.routed_experts.clone()
    routed[mask] = ((routed[mask][..., :1].long() + torch.tensor([1, 2])) % 4).to(routed.dtype)
    batch = batch.with_fields(routed_experts=routed)
    seen: list[torch.Tensor] = []

    def hook(module, inputs, output):
        seen.append(output[2].detach().clone())

    handles = [r.register_forward_hook(hook) for r in routers(trainer.model)]
    try:
        metrics = trainer.train_step(batch)
    finally:
        for h in handles:
            h.remove()
    assert metrics["router_replay/changed"] > 0  # some recorded sets differ from the router's own
    # One micro-batch of 5 rows then one of 5 then 2, each trimmed: compare row by row.
    calls = iter(seen)
    for part in batch.split(5):
        per_layer = [next(calls).reshape(*part.input_ids.shape, 2) for _ in range(2)]
        predecessor = torch.zeros_like(part.response_mask, dtype=torch.bool)
        predecessor[:, :-1] = part.response_mask[:, 1:] > 0
        for layer in range(2):
            got = per_layer[layer][predecessor].sort(dim=-1).values
            want = part.routed_experts[:, 1:][predecessor[:, :-1]][:, layer].long().sort(dim=-1).values
            assert torch.equal(got, want)


def test_r3_refuses_a_batch_without_routing(spec, moe_path, gens, rollout):
    trainer = _trainer(spec, moe_path)
    plain = collate(gens, torch.zeros(len(gens)), rollout.pad_token_id)
    with pytest.raises(ValueError, match="no routed experts"):
        trainer.train_step(plain)


def test_r2_replays_the_steps_first_routing_in_later_updates(make_spec, moe_path, gens, rollout):
    r2 = make_spec({"model.path": moe_path, "algorithm.router_replay": "r2", "algorithm.updates_per_step": 2,
                    "roles.actor.optimizer.lr": 0.05, "roles.actor.micro_batch_size": 12})
    trainer = _trainer(r2, moe_path)
    batch = collate(gens, torch.linspace(-1.0, 1.0, len(gens)), rollout.pad_token_id)
    before = trainer.own_routing(batch)
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, i, o: seen.append(o[2].detach().clone()))
               for r in routers(trainer.model)]
    try:
        metrics = trainer.train_step(batch)
    finally:
        for h in handles:
            h.remove()
    assert metrics["updates"] == 2
    after = trainer.own_routing(batch)
    mask = batch.response_mask.bool()
    # The second mini-batch (rows 6..11) is routed as at the step's start, although the first
    # update moved the routers (a large lr: some of its tokens now route differently).
    second = batch.select(slice(6, 12))
    cols = second.used_columns()
    got = torch.stack([c.reshape(6, -1, 2) for c in seen[-2:]], dim=2)  # the last forward: [rows, T', layers, k]
    part_mask = second.select_columns(cols).response_mask.bool()
    want = before[6:12][:, cols]
    assert torch.equal(got[:, :-1][part_mask[:, 1:]].sort(-1).values, want[:, 1:][part_mask[:, 1:]].long().sort(-1).values)
    assert not torch.equal(after[mask], before[mask])
