"""The plan of a LoRA run (``relax.plan.memory.lora_state``, ``weight_sync_bytes``): the frozen base
in bf16 plus a float32 adapter with its gradients and Adam state, the bytes a sync moves, and the
7B LoRA preset fitting two 80 GiB GPUs; each against a hand computation on Qwen2.5-7B."""

from __future__ import annotations

from relax.config import load_spec_dict
from relax.plan import make_plan, render
from relax.plan.memory import GIB, trained_role_memory, weight_sync_bytes
from relax.spec import RunSpec
from relax.spec.architecture import load_card
from relax.spec.lora import adapter_params

ARCH = load_card("Qwen/Qwen2.5-7B-Instruct")
PRESET = "qwen2_5-7b-lora-grpo"
# rank 64 on q, k, v, o, gate, up, down: r x (in + out) per layer, 28 layers.
ADAPTER = 64 * ((3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584) + 3 * (3584 + 18944)) * 28


def _spec(*overrides: str) -> RunSpec:
    raw, _ = load_spec_dict(PRESET, list(overrides))
    return RunSpec.model_validate(raw)


def test_the_adapter_is_counted_by_hand():
    spec = _spec()
    assert ADAPTER == 161_480_704
    assert adapter_params(spec.roles.actor.lora, ARCH) == ADAPTER
    only_attention = _spec("roles.actor.lora.target_modules=[q_proj,v_proj]")
    assert adapter_params(only_attention.roles.actor.lora, ARCH) == 64 * ((3584 + 3584) + (3584 + 512)) * 28


def test_a_lora_actor_holds_the_frozen_base_and_the_adapters_training_state():
    spec = _spec()
    items = {i.what: i.gib for i in trained_role_memory("actor", spec.roles.actor, spec, ARCH, "none", 1)}
    base = ARCH.params_total() * 2  # bf16, no gradients, no optimizer state
    assert abs(items["weights"] - (base + ADAPTER * 4) / GIB) < 1e-3
    assert abs(items["gradients"] - ADAPTER * 4 / GIB) < 1e-3
    assert abs(items["optimizer"] - ADAPTER * 8 / GIB) < 1e-3
    full = {i.what: i.gib for i in trained_role_memory("actor", _spec("~roles.actor.lora").roles.actor,
                                                         _spec("~roles.actor.lora"), ARCH, "none", 1)}
    assert items["weights"] + items["optimizer"] < (full["weights"] + full["optimizer"]) / 5


def test_a_sync_moves_the_adapter_alone_and_the_plan_prints_it():
    spec = _spec()
    assert weight_sync_bytes(spec, ARCH) == ADAPTER * 4
    assert weight_sync_bytes(_spec("~roles.actor.lora"), ARCH) == ARCH.params_total() * 2
    assert ADAPTER * 4 < 0.05 * ARCH.params_total() * 2
    plan = make_plan(spec)
    assert [(e.bytes_per_sync, e.adapter_only) for e in plan.weight_sync] == [(ADAPTER * 4, True)]
    assert "actor -> rollout (object-store, 616.0 MiB per sync, LoRA adapter only)" in render(plan)
    assert all(d.peak_gib <= d.capacity_gib for d in plan.memory if d.capacity_gib is not None)


def test_the_reference_of_a_lora_run_is_the_actors_base_model():
    plan = make_plan(_spec("algorithm.kl_coef=0.01", "roles.reference.backend=torch", "roles.reference.gpus=0"))
    assert not [i for d in plan.memory for i in d.items if i.role == "reference"]
    worker = next(w for w in plan.workers if any(loop.role == "reference" for loop in w.roles))
    loops = {loop.role: loop for loop in worker.roles}
    assert "actor" in loops and loops["reference"].weights_in == "shared" and loops["reference"].plugins == []
