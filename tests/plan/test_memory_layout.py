"""The memory model of sharded trainers (``relax.plan.memory``): FSDP2's shards (in the model's dtype) over the
data-parallel ranks, the gathered units, CPU offload, and activations at the token budget, each
checked against a hand computation on Qwen3-4B."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax.config import load_spec_dict
from relax.plan.memory import GIB, TrainerLayout, trained_role_memory, trainer_layout
from relax.spec import RunSpec
from relax.spec.architecture import load_card

ARCH = load_card("Qwen/Qwen3-4B")
P = 4_022_458_880  # tests/spec/test_architecture.py
LAYER = 100_930_560
ROOT = P - 36 * LAYER  # embeddings (tied) and the final norm


def _fsdp(**options):
    """A backend ``Config`` with an ``fsdp`` block, as the torch trainer's (pure data here)."""
    block = {"enabled": True, "shard_unit": "decoder_layer", "mixed_precision": "bf16", "cpu_offload": False,
             "activation_checkpointing": False, **options}
    return SimpleNamespace(fsdp=SimpleNamespace(**block))


def _items(layout, *overrides, dp=8):
    raw, _ = load_spec_dict("qwen3-4b-grpo-colocate", list(overrides))
    spec = RunSpec.model_validate(raw)
    return {i.what: i.gib for i in trained_role_memory("actor", spec.roles.actor, spec, ARCH, layout, dp)}


def test_a_config_without_fsdp_keeps_the_backends_trait():
    assert trainer_layout("none", SimpleNamespace()) == TrainerLayout(sharding="none")
    assert trainer_layout("optimizer", None).sharding == "optimizer"
    assert trainer_layout("none", _fsdp(enabled=False)).sharding == "none"
    layout = trainer_layout("none", _fsdp(cpu_offload=True, shard_unit="model"))
    assert (layout.sharding, layout.fsdp, layout.offload, layout.gather_unit) == ("full", True, True, "model")


def test_fsdp_shards_the_models_dtype_over_the_ranks_and_gathers_two_layers():
    items = _items(trainer_layout("none", _fsdp()))
    # a bfloat16 model, sharded as loaded: bf16 shards (2), gradients (2) and Adam moments (4), all / 8 ranks
    assert items["weights"] == pytest.approx(P * 2 / 8 / GIB, abs=1e-3)
    assert items["gradients"] == pytest.approx(P * 2 / 8 / GIB, abs=1e-3)
    assert items["optimizer"] == pytest.approx(P * 4 / 8 / GIB, abs=1e-3)
    # gathered in bf16: the root and two decoder layers, plus one layer's float32 gradient
    assert items["gathered units"] == pytest.approx(((ROOT + 2 * LAYER) * 2 + LAYER * 4) / GIB, abs=1e-3)
    replica = _items("none")  # a mixed-precision replica keeps a float32 master copy: 2 + 12 bytes
    assert replica["weights"] + replica["optimizer"] == pytest.approx(P * 14 / GIB, abs=1e-2)
    # half the 16 bytes per parameter of that replica, an eighth of them per rank
    assert items["weights"] + items["gradients"] + items["optimizer"] == pytest.approx(
        (replica["weights"] + replica["gradients"] + replica["optimizer"]) / 16, abs=1e-2)


def test_a_float32_model_shards_float32_state():
    items = _items(trainer_layout("none", _fsdp()), "model.dtype=float32")
    assert items["weights"] == pytest.approx(P * 4 / 8 / GIB, abs=1e-3)
    assert items["optimizer"] == pytest.approx(P * 8 / 8 / GIB, abs=1e-3)


def test_mixed_precision_off_gathers_in_the_models_dtype():
    on = _items(trainer_layout("none", _fsdp()), "model.dtype=float32")
    off = _items(trainer_layout("none", _fsdp(mixed_precision="off")), "model.dtype=float32")
    assert off["weights"] == on["weights"] and off["optimizer"] == on["optimizer"]
    assert off["gathered units"] == pytest.approx(((ROOT + 2 * LAYER) * 4 + LAYER * 4) / GIB, abs=1e-3)


def test_cpu_offload_leaves_only_the_gathered_units_and_activations_on_the_gpu():
    items = _items(trainer_layout("none", _fsdp(cpu_offload=True)))
    assert "weights" not in items and "optimizer" not in items and "gradients" not in items
    assert items["gathered units"] > 0 and items["activations"] > 0


def test_the_token_budget_sets_the_activation_and_logit_tokens():
    h, V = 2560, 151_936
    budget = 8192
    items = _items("none", f"roles.actor.max_tokens_per_micro_batch={budget}")
    # gradient checkpointing (the preset's): 2 x tokens x h per layer for 36 layers, plus one full layer
    assert items["activations"] == pytest.approx((36 * 2 * budget * h + budget * h * 34) / GIB, abs=1e-3)
    assert items["logits"] == pytest.approx(budget * V * 4 * 2 / GIB, abs=1e-3)
    rows = _items("none")  # micro_batch_size 2 x (512 + 2048) tokens
    assert rows["logits"] == pytest.approx(2 * 2560 * V * 4 * 2 / GIB, abs=1e-3)


def test_backend_checkpointing_counts_like_the_roles():
    without = _items(trainer_layout("none", _fsdp()), "roles.actor.gradient_checkpointing=false")
    backend = _items(trainer_layout("none", _fsdp(activation_checkpointing=True)),
                     "roles.actor.gradient_checkpointing=false")
    assert backend["activations"] < without["activations"] / 5


def test_the_torch_trainers_own_fsdp_options_give_the_layout():
    """The planner reads the torch trainer's real ``Config`` (its ``fsdp`` block), as ``relax plan`` builds it."""
    from relax.contracts import PluginKind
    from relax.registry import get_registry

    registry = get_registry()
    config = registry.build_config(PluginKind.trainer, "torch", {"fsdp": {"enabled": True, "cpu_offload": True}})
    layout = trainer_layout("none", config)
    assert (layout.sharding, layout.fsdp, layout.offload, layout.mixed_precision) == ("full", True, True, True)
    assert trainer_layout("none", registry.build_config(PluginKind.trainer, "torch", {})).sharding == "none"
