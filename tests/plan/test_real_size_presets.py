"""The presets people book GPUs for plan to fit (issue 40): the per-GPU memory of each phase on
every GPU, from ``relax plan``, within a stated band, and the sharding is what makes them fit."""

from __future__ import annotations

import pytest

from relax.config import load_spec_dict
from relax.errors import SpecError
from relax.plan import make_plan
from relax.spec import validate_spec

#: preset -> {(roles on the GPU, phase): (low, high) GiB}; every GPU of the preset matches one entry.
FIGURES = {
    # 2 x 8 GPUs of 141 GiB: node 0 generates (the whole model in bf16 plus its KV cache), node 1
    # trains under FSDP2 (bf16 shards over 8 ranks, the gathered units, activations and logits).
    "qwen3-omni-30b-a3b": {(("rollout",), "run"): (60.0, 70.0), (("actor",), "run"): (35.0, 45.0)},
    # 8 x 80 GiB, colocated across ranks: every GPU holds an actor rank under FSDP2 and its own hf
    # engine. Qwen3-4B: bf16 shards 0.9 + Adam 1.9 (+ gradients 0.9, gathered 1.5, logits 5.8
    # when training); the engine's bf16 weights 7.5 and KV cache 5.6 when generating (asleep when
    # training).
    "qwen3-4b-grpo-fsdp-colocate": {(("actor", "rollout"), "generate"): (13.0, 19.0),
                                    (("actor", "rollout"), "train"): (10.0, 15.0)},
    # Qwen2.5-7B: 8192-token micro-batches, 64 prompts x 8 samples of up to 4096 tokens.
    "qwen2_5-7b-grpo-fsdp-colocate": {(("actor", "rollout"), "generate"): (29.0, 38.0),
                                      (("actor", "rollout"), "train"): (19.0, 26.0)},
}


def plan_of(preset: str, *overrides: str):
    raw, base = load_spec_dict(preset, list(overrides))
    spec = validate_spec(raw, base_dir=base)
    return spec, make_plan(spec, base_dir=base)


@pytest.mark.parametrize("preset", sorted(FIGURES))
def test_the_preset_fits_with_its_per_gpu_figures_in_band(preset: str) -> None:
    spec, plan = plan_of(preset)
    bands = FIGURES[preset]
    gpus = [d for d in plan.memory if d.gpu is not None]
    assert len(gpus) == spec.cluster.gpus
    for device in gpus:
        assert device.peak_gib <= device.capacity_gib
        roles = tuple(sorted(r for r in device.roles if r not in ("reward", "advantage")))
        for phase, gib in device.phases.items():
            low, high = bands[(roles, phase)]
            assert low <= gib <= high, f"{preset} node {device.node} GPU {device.gpu} {phase}: {gib} GiB"


def test_the_omni_trainer_fits_only_sharded() -> None:
    """Without FSDP2 the torch actor holds a full replica: about 475 GiB per GPU, refused."""
    with pytest.raises(SpecError) as caught:
        plan_of("qwen3-omni-30b-a3b", "roles.actor.options.fsdp.enabled=false")
    issue = next(i for i in caught.value.issues if i.path == "roles.actor")
    assert "exceeds cluster.gpu_memory_gb=141" in issue.message
    estimated = float(issue.message.split("estimated ")[1].split(" GiB")[0])
    assert 400 < estimated < 550


def test_the_colocated_presets_host_an_engine_in_every_actor_rank() -> None:
    for preset in ("qwen3-4b-grpo-fsdp-colocate", "qwen2_5-7b-grpo-fsdp-colocate"):
        spec, plan = plan_of(preset)
        assert spec.engine_per_rank
        (worker,) = plan.workers
        assert worker.engine_per_rank and worker.ranks == {"actor": list(range(8))}
        gpus = [d for d in plan.memory if d.gpu is not None]
        assert all(set(d.roles) >= {"actor", "rollout"} and set(d.phases) == {"generate", "train"} for d in gpus)


def test_the_7b_colocated_layout_fits_only_sharded() -> None:
    """A full replica of the 7B model, its gradients and Adam state on each GPU: over 80 GiB."""
    with pytest.raises(SpecError) as caught:
        plan_of("qwen2_5-7b-grpo-fsdp-colocate", "roles.actor.options.fsdp.enabled=false")
    assert any(i.path == "roles.actor" and "exceeds cluster.gpu_memory_gb=80" in i.message
               for i in caught.value.issues)
