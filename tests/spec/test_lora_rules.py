"""``roles.<role>.lora``: the tiny LoRA preset validates; a target that is no linear layer of the
decoder is named with a "did you mean"; rank 0, a trainer or rollout without adapters, partial
rollouts and routing replay are refused naming the field; the contexts
carry the adapter to the actor, actor_fwd and the rollout but never to the reference."""

from __future__ import annotations

import yaml

from relax.config.loader import PRESETS_DIR, load_spec_dict
from relax.plan.contexts import rollout_context, trainer_context
from relax.spec import SpecError, validate_spec


def _raw(**lora) -> dict:
    raw = yaml.safe_load((PRESETS_DIR / "tiny-cpu.yaml").read_text())
    raw.update(name="lora-test")
    raw["roles"]["actor"]["lora"] = {"rank": 2, **lora}
    return raw


def _issues(raw: dict) -> dict[str, str]:
    try:
        validate_spec(raw)
    except SpecError as exc:
        return {i.path: f"{i.message} | {i.remedy} | {' '.join(i.fix)}" for i in exc.issues}
    return {}


def test_the_lora_preset_and_named_targets_validate():
    raw, _ = load_spec_dict("tiny-lora-cpu")
    assert raw["roles"]["actor"]["lora"]["target_modules"] == "all-linear"
    assert _issues(raw) == {}
    assert _issues(_raw(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])) == {}


def test_a_misspelt_target_is_named_with_the_module_meant():
    issues = _issues(_raw(target_modules=["q_proj", "vproj"]))
    assert set(issues) == {"roles.actor.lora.target_modules"}
    text = issues["roles.actor.lora.target_modules"]
    assert "'vproj'" in text and "did you mean 'v_proj'" in text
    assert "roles.actor.lora.target_modules=[q_proj,v_proj]" in text  # the fix mends the typo


def test_a_module_that_is_no_linear_layer_of_an_moe_decoder_is_refused():
    raw = _raw(target_modules=["gate_proj"])
    raw["model"]["options"] = {"architecture": "qwen3_moe"}
    issues = _issues(raw)
    assert "roles.actor.lora.target_modules" in issues and "q_proj" in issues["roles.actor.lora.target_modules"]


def test_rank_zero_is_a_shape_error():
    issues = _issues(_raw(rank=0))
    assert "roles.actor.lora.rank" in issues and "greater than 0" in issues["roles.actor.lora.rank"]


def test_megatron_is_refused_naming_the_torch_trainer():
    raw = _raw()
    raw["roles"]["actor"]["backend"] = "megatron"
    issues = _issues(raw)
    assert "roles.actor.backend" in issues
    assert "cannot train LoRA" in issues["roles.actor.backend"] and "backend: torch" in issues["roles.actor.backend"]


def test_what_does_not_take_adapter_syncs_yet_is_refused_naming_the_field():
    raw = _raw()
    raw["roles"]["rollout"]["partial"] = True
    raw["algorithm"]["router_replay"] = "r2"
    raw["model"]["options"] = {"architecture": "qwen3_moe"}
    issues = _issues(raw)
    assert {"roles.rollout.partial", "algorithm.router_replay"} <= set(issues)


def test_an_initial_adapter_must_be_a_peft_folder(tmp_path):
    issues = _issues(_raw(init_adapter=str(tmp_path)))
    assert "adapter_config.json" in issues["roles.actor.lora.init_adapter"]


def test_the_contexts_carry_the_adapter_but_not_to_the_reference(tmp_path):
    raw = _raw()
    raw["algorithm"]["kl_coef"] = 0.1
    raw["roles"]["reference"] = {"backend": "torch"}
    raw["async_policy"]["correction"] = "decoupled"
    raw["roles"]["actor_fwd"] = {"backend": "torch"}
    spec = validate_spec(raw)
    assert trainer_context(spec, "actor", "m").lora.rank == 2
    assert trainer_context(spec, "actor_fwd", "m").lora.rank == 2
    assert trainer_context(spec, "reference", "m").lora is None
    assert rollout_context(spec, "m").lora.rank == 2


def test_a_weight_group_to_vllm_is_refused_naming_the_object_store():
    raw = _raw()
    raw["roles"]["rollout"].update(backend="vllm", weight_sync="collective")
    raw["placement"] = {**raw.get("placement", {}), "mode": "separate"}
    issues = _issues(raw)
    assert set(issues) == {"roles.rollout.weight_sync"}, issues
    text = issues["roles.rollout.weight_sync"]
    assert "'vllm'" in text and "LoRA" in text and "weight_sync: object_store" in text
    assert "roles.rollout.weight_sync=object_store" in text  # the fix
    raw["roles"]["rollout"]["backend"] = "hf"  # hf takes an adapter over a weight group
    assert _issues(raw) == {}
