"""One test per cross-field rule: a spec that breaks it, the exact path reported and its remedy.

Every spec starts from a valid one (``cpu_spec`` or ``gpu_spec`` in conftest.py, proven valid by the
first two tests) and breaks one rule, so the set of reported paths is exactly that rule's.
"""

from __future__ import annotations

import json
import re

import pytest

from relax.spec import SpecError, validate_spec


def numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text)}


def test_cpu_base_spec_is_valid(check, cpu_spec):
    assert check(cpu_spec) == {}


def test_gpu_base_spec_is_valid(check, gpu_spec):
    assert check(gpu_spec) == {}


# --- staleness, algorithm and roles ---------------------------------------------------------------


def test_colocate_requires_max_staleness_zero(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "colocate"}
    cpu_spec["async_policy"] = {"max_staleness": 2}
    issues = check(cpu_spec)
    assert set(issues) == {"async_policy.max_staleness"}
    assert "set it to 0" in issues["async_policy.max_staleness"].remedy


def test_colocate_with_max_staleness_zero_is_valid(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "colocate"}
    cpu_spec["async_policy"] = {"max_staleness": 0}
    assert check(cpu_spec) == {}


def test_kl_coef_requires_reference(check, cpu_spec):
    cpu_spec["algorithm"]["kl_coef"] = 0.01
    issues = check(cpu_spec)
    assert set(issues) == {"algorithm.kl_coef"}
    assert "roles.reference" in issues["algorithm.kl_coef"].remedy


def test_kl_coef_with_reference_is_valid(check, cpu_spec):
    cpu_spec["algorithm"]["kl_coef"] = 0.01
    cpu_spec["roles"]["reference"] = {"backend": "test_trainer"}
    assert check(cpu_spec) == {}


def test_ppo_requires_critic(check, cpu_spec):
    cpu_spec["algorithm"]["name"] = "ppo"
    issues = check(cpu_spec)
    assert set(issues) == {"roles.critic"}
    assert "roles.critic" in issues["roles.critic"].remedy


@pytest.mark.parametrize("correction", ["seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop"])
def test_ratio_corrections_require_actor_fwd(check, cpu_spec, correction):
    cpu_spec["async_policy"] = {"correction": correction}
    issues = check(cpu_spec)
    assert set(issues) == {"async_policy.correction"}
    assert correction in issues["async_policy.correction"].message
    assert "roles.actor_fwd" in issues["async_policy.correction"].remedy
    cpu_spec["async_policy"] = {"correction": "opsm"}  # opsm reads the policy being trained: no proximal
    assert check(cpu_spec) == {}


def test_a_correction_band_must_be_ordered(check, cpu_spec):
    cpu_spec["async_policy"] = {"correction": "opsm", "icepop_low": 5.0, "icepop_high": 0.5}
    issues = check(cpu_spec)
    assert [path for path in issues if path.startswith("async_policy")] == list(issues)
    assert any("icepop_low (5.0) must be below icepop_high (0.5)" in i.message for i in issues.values())


def test_decoupled_correction_requires_actor_fwd(check, cpu_spec):
    cpu_spec["async_policy"] = {"correction": "decoupled"}
    issues = check(cpu_spec)
    assert set(issues) == {"async_policy.correction"}
    assert "roles.actor_fwd" in issues["async_policy.correction"].remedy


def test_group_advantage_requires_two_samples_per_prompt(check, cpu_spec):
    cpu_spec["algorithm"]["samples_per_prompt"] = 1
    issues = check(cpu_spec)
    assert set(issues) == {"algorithm.samples_per_prompt"}
    assert "2 or more" in issues["algorithm.samples_per_prompt"].remedy


def test_one_sample_per_prompt_is_fine_for_a_non_group_advantage(check, cpu_spec):
    cpu_spec["algorithm"].update(samples_per_prompt=1, advantage="test_scalar")
    assert check(cpu_spec) == {}


def test_otlp_exporter_requires_endpoint(check, cpu_spec):
    cpu_spec["tracing"] = {"exporter": "otlp"}
    issues = check(cpu_spec)
    # tracing.exporter is reported too when the optional OTLP exporter package is missing.
    assert "tracing.endpoint" in issues and set(issues) <= {"tracing.endpoint", "tracing.exporter"}
    assert "http://" in issues["tracing.endpoint"].remedy


# --- GPUs ------------------------------------------------------------------------------------------


def test_gpus_asked_by_all_roles_fit_the_cluster(check, gpu_spec):
    gpu_spec["roles"]["actor"]["gpus"] = 8  # 2 (rollout) + 8 (actor) > 1 x 8
    issues = check(gpu_spec)
    assert set(issues) == {"cluster"}
    assert "10 GPUs (roles.actor.gpus=8, roles.rollout.replicas x gpus_per_replica=" in issues["cluster"].message
    assert "cluster.nodes x cluster.gpus_per_node = 1 x 8 = 8" in issues["cluster"].message
    assert "raise cluster.nodes or cluster.gpus_per_node" in issues["cluster"].remedy


def test_gpu_role_on_a_cluster_without_gpus(check, cpu_spec):
    cpu_spec["roles"]["actor"]["gpus"] = 2
    issues = check(cpu_spec)
    assert set(issues) == {"roles.actor.gpus"}
    assert "gpus_per_node is 0" in issues["roles.actor.gpus"].message
    assert "cluster.gpus_per_node" in issues["roles.actor.gpus"].remedy


def test_colocate_rollout_gpus_must_equal_actor_gpus(check, gpu_spec):
    gpu_spec["placement"] = {"mode": "colocate"}
    gpu_spec["async_policy"] = {"max_staleness": 0}
    issues = check(gpu_spec)  # rollout 1 x 2 GPUs, actor 4
    assert set(issues) == {"roles.rollout.replicas"}
    assert "roles.actor.gpus" in issues["roles.rollout.replicas"].remedy


def test_pooled_role_must_share_the_actor_gpu_count(check, gpu_spec):
    gpu_spec["placement"] = {"mode": "hybrid"}
    gpu_spec["algorithm"]["kl_coef"] = 0.01
    gpu_spec["roles"]["reference"] = {"backend": "test_trainer", "gpus": 2, "parallel": {"tp": 2}}
    issues = check(gpu_spec)
    assert set(issues) == {"roles.reference.gpus"}
    assert issues["roles.reference.gpus"].remedy == "set it to 4"


def test_tp_pp_cp_product_must_divide_role_gpus(check, gpu_spec):
    gpu_spec["roles"]["actor"]["parallel"] = {"tp": 1, "cp": 3}  # 3 does not divide 4 GPUs
    issues = check(gpu_spec)
    assert set(issues) == {"roles.actor.parallel"}
    assert "= 3" in issues["roles.actor.parallel"].message
    assert "divides the GPU count" in issues["roles.actor.parallel"].remedy


def test_parallelism_on_a_cpu_role(check, cpu_spec):
    cpu_spec["roles"]["actor"]["parallel"] = {"tp": 2}
    issues = check(cpu_spec)
    assert set(issues) == {"roles.actor.parallel.tp"}
    assert "runs on CPU" in issues["roles.actor.parallel.tp"].message
    assert "set it to 1" in issues["roles.actor.parallel.tp"].remedy


def test_backend_with_only_data_parallel_rejects_tp(check, gpu_spec):
    gpu_spec["roles"]["actor"]["backend"] = "dp_trainer"
    issues = check(gpu_spec)
    assert set(issues) == {"roles.actor.parallel.tp"}
    assert "does not support tp" in issues["roles.actor.parallel.tp"].message
    assert "set it to 1" in issues["roles.actor.parallel.tp"].remedy


# --- model architecture ----------------------------------------------------------------------------


def test_tp_must_divide_attention_heads_and_lists_valid_choices(check, gpu_spec):
    gpu_spec["roles"]["actor"].update(gpus=3, parallel={"tp": 3})  # Qwen3-4B: 32 heads, 8 kv heads
    issues = check(gpu_spec)
    assert set(issues) == {"roles.actor.parallel.tp"}
    assert "num_attention_heads=32" in issues["roles.actor.parallel.tp"].message
    choices = numbers(issues["roles.actor.parallel.tp"].remedy)
    assert {1, 2, 4, 8} <= choices and 3 not in choices
    assert all(32 % c == 0 for c in choices)


def test_pp_must_divide_layers(check, gpu_spec):
    gpu_spec["roles"]["actor"].update(gpus=5, parallel={"pp": 5})  # Qwen3-4B: 36 layers
    issues = check(gpu_spec)
    assert set(issues) == {"roles.actor.parallel.pp"}
    assert "num_layers=36" in issues["roles.actor.parallel.pp"].message
    assert numbers(issues["roles.actor.parallel.pp"].remedy) == {1, 2, 3, 4, 6, 9, 12, 18, 36}


def test_ep_on_a_dense_model(check, gpu_spec):
    gpu_spec["roles"]["actor"]["parallel"]["ep"] = 2
    issues = check(gpu_spec)
    assert set(issues) == {"roles.actor.parallel.ep"}
    assert "no experts" in issues["roles.actor.parallel.ep"].message
    assert issues["roles.actor.parallel.ep"].remedy == "set it to 1"


def test_ep_must_divide_experts(check, gpu_spec):
    gpu_spec["model"]["path"] = "Qwen/Qwen3-30B-A3B"
    gpu_spec["roles"]["actor"]["parallel"]["ep"] = 3
    issues = check(gpu_spec)
    assert set(issues) == {"roles.actor.parallel.ep"}
    assert "num_experts=128" in issues["roles.actor.parallel.ep"].message
    choices = numbers(issues["roles.actor.parallel.ep"].remedy)
    assert choices and all(128 % c == 0 for c in choices)


def test_ep_dividing_experts_is_valid(check, gpu_spec):
    gpu_spec["model"]["path"] = "Qwen/Qwen3-30B-A3B"
    gpu_spec["roles"]["actor"]["parallel"]["ep"] = 4
    assert check(gpu_spec) == {}


def test_local_model_folder_config_json_is_read(check, gpu_spec, tmp_path):
    # 12 heads, 10 layers: tp 8 and pp 4 are wrong for this model although right for Qwen3-4B.
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 12,
        "num_hidden_layers": 10, "intermediate_size": 3072, "vocab_size": 32000}))
    gpu_spec["model"]["path"] = "my-model"  # relative to the spec's folder
    gpu_spec["cluster"]["gpus_per_node"] = 64
    gpu_spec["roles"]["actor"].update(gpus=32, parallel={"tp": 8, "pp": 4})
    issues = check(gpu_spec, base_dir=tmp_path)
    assert set(issues) == {"roles.actor.parallel.tp", "roles.actor.parallel.pp"}
    assert "num_attention_heads=12" in issues["roles.actor.parallel.tp"].message
    assert numbers(issues["roles.actor.parallel.tp"].remedy) == {1, 2, 3, 4, 6, 12}
    assert "num_layers=10" in issues["roles.actor.parallel.pp"].message


def test_local_model_folder_without_config_json(check, cpu_spec, tmp_path):
    (tmp_path / "empty-model").mkdir()
    cpu_spec["model"]["path"] = "empty-model"
    issues = check(cpu_spec, base_dir=tmp_path)
    assert set(issues) == {"model.path"}
    assert "config.json" in issues["model.path"].message


def test_local_model_config_with_zero_heads_is_a_spec_error(check, cpu_spec, tmp_path):
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_attention_heads": 0, "num_hidden_layers": 2, "vocab_size": 10}))
    cpu_spec["model"]["path"] = "broken-model"
    assert set(check(cpu_spec, base_dir=tmp_path)) == {"model.path"}


def test_home_relative_model_path_of_an_unknown_user_is_a_spec_error(check, cpu_spec):
    cpu_spec["model"]["path"] = "~no-such-user-relax/model"
    assert set(check(cpu_spec)) == {"model.path"}


# --- modalities -------------------------------------------------------------------------------------


def test_modality_needs_a_media_key(check, cpu_spec):
    cpu_spec["model"] = {"path": "Qwen/Qwen3-VL-4B-Instruct", "modalities": ["text", "image"]}
    issues = check(cpu_spec)
    assert set(issues) == {"data.media_keys"}
    assert "data.media_keys.image" in issues["data.media_keys"].remedy


def test_media_key_needs_its_modality(check, cpu_spec):
    cpu_spec["data"]["media_keys"] = {"image": "images"}
    issues = check(cpu_spec)
    assert set(issues) == {"data.media_keys.image"}
    assert "model.modalities" in issues["data.media_keys.image"].remedy


def test_model_card_must_read_the_modality(check, cpu_spec):
    cpu_spec["model"] = {"path": "Qwen/Qwen3-4B", "modalities": ["text", "audio"]}
    cpu_spec["data"]["media_keys"] = {"audio": "audios"}
    issues = check(cpu_spec)
    assert set(issues) == {"model.modalities"}
    assert "audio" in issues["model.modalities"].message
    assert "choose a model" in issues["model.modalities"].remedy


def test_backend_must_support_the_modality(check, cpu_spec):
    cpu_spec["model"] = {"path": "Qwen/Qwen3-VL-4B-Instruct", "modalities": ["text", "image"]}
    cpu_spec["data"]["media_keys"] = {"image": "images"}
    cpu_spec["roles"]["rollout"]["backend"] = "text_rollout"
    issues = check(cpu_spec)
    assert set(issues) == {"roles.rollout.backend"}
    assert "does not support image" in issues["roles.rollout.backend"].message


def test_omni_model_with_all_media_keys_is_valid(check, cpu_spec):
    cpu_spec["model"] = {"path": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
                         "modalities": ["text", "image", "audio", "video"]}
    cpu_spec["data"]["media_keys"] = {"image": "images", "audio": "audios", "video": "videos"}
    assert check(cpu_spec) == {}


# --- shape errors and plugins -----------------------------------------------------------------------


def test_unknown_key_suggests_the_right_one(check, cpu_spec):
    cpu_spec["roles"]["actor"]["paralel"] = {"tp": 1}
    issues = check(cpu_spec)
    assert set(issues) == {"roles.actor.paralel"}
    assert issues["roles.actor.paralel"].message == "unknown key"
    assert issues["roles.actor.paralel"].remedy == "did you mean 'parallel'?"


@pytest.mark.parametrize("key", ["tuple[", "list[int]", "function-after"])
def test_unknown_key_that_looks_like_a_pydantic_location_tag(check, cpu_spec, key):
    # pydantic adds segments such as "function-after[...]" or "list[...]" to error locations; a
    # user's own key spelt like one must still be reported, at its own path.
    cpu_spec[key] = 1
    cpu_spec["model"][key] = 1
    issues = check(cpu_spec)
    assert set(issues) == {key, f"model.{key}"}
    assert {i.message for i in issues.values()} == {"unknown key"}


def test_wrong_literal_suggests_the_right_one(check, cpu_spec):
    cpu_spec["placement"] = {"mode": "colocat"}
    issues = check(cpu_spec)
    assert set(issues) == {"placement.mode"}
    assert "did you mean 'colocate'?" in issues["placement.mode"].remedy
    assert "separate" in issues["placement.mode"].remedy  # the choices are listed too


def test_plugin_not_installed_lists_installed_ones(check, cpu_spec):
    cpu_spec["rewards"][0]["name"] = "no_such_reward"
    issues = check(cpu_spec)
    assert set(issues) == {"rewards[0].name"}
    assert "test_reward" in issues["rewards[0].name"].message
    assert "relax.rewards" in issues["rewards[0].name"].message


def test_misspelt_plugin_gets_a_suggestion(check, cpu_spec):
    cpu_spec["roles"]["actor"]["backend"] = "test_trainr"
    issues = check(cpu_spec)
    assert "roles.actor.backend" in issues
    assert issues["roles.actor.backend"].remedy == "did you mean 'test_trainer'?"


def test_plugin_option_out_of_range_has_the_plugin_path(check, cpu_spec):
    cpu_spec["rewards"][0]["options"] = {"bonus": -1.0}
    issues = check(cpu_spec)
    assert set(issues) == {"rewards[0].options.bonus"}
    assert "test_reward" in issues["rewards[0].options.bonus"].message  # names the plugin
    assert issues["rewards[0].options.bonus"].remedy == "raise it"


def test_unknown_plugin_option_suggests_the_right_one(check, cpu_spec):
    cpu_spec["data"]["train"]["options"] = {"sise": 4}
    issues = check(cpu_spec)
    assert set(issues) == {"data.train.options.sise"}
    assert issues["data.train.options.sise"].remedy == "did you mean 'size'?"


def test_all_errors_of_a_spec_are_reported_together(testkit_registry, cpu_spec, tmp_path):
    cpu_spec["placement"] = {"mode": "colocate"}  # with max_staleness 1 from the defaults
    cpu_spec["algorithm"]["kl_coef"] = 0.1  # no reference
    cpu_spec["async_policy"] = {"correction": "decoupled"}  # no actor_fwd
    with pytest.raises(SpecError) as caught:
        validate_spec(cpu_spec, base_dir=tmp_path, registry=testkit_registry)
    assert [i.path for i in caught.value.issues] == [
        "algorithm.kl_coef", "async_policy.correction", "async_policy.max_staleness"]
    assert caught.value.render().startswith("3 problems in the run spec:")


def test_all_shape_errors_are_reported_together(testkit_registry, cpu_spec, tmp_path):
    cpu_spec["seed"] = -1
    cpu_spec["model"]["dtype"] = "float8"
    cpu_spec["trainer"] = {"stepz": 3}
    with pytest.raises(SpecError) as caught:
        validate_spec(cpu_spec, base_dir=tmp_path, registry=testkit_registry)
    assert [i.path for i in caught.value.issues] == ["model.dtype", "seed", "trainer.stepz"]
