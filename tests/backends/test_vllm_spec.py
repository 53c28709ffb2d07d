"""Specs naming the ``vllm`` rollout validate where vLLM is not installed (the default lane): the
plugin module imports nothing heavy, its options are checked against its ``Config``, and the
parallel sizes it does not have are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax.config import load_spec_dict
from relax.spec import SpecError, validate_spec


def tiny_vllm(*overrides: str):
    raw, base = load_spec_dict("tiny-cpu", ["roles.rollout.backend=vllm", "tracing.exporter=none", *overrides])
    return validate_spec(raw, base_dir=base)


def test_the_plugin_module_imports_no_engine_or_torch() -> None:
    code = ("import sys, relax_plugins.rollout.vllm as m; "
            "heavy = sorted({'vllm', 'torch', 'transformers', 'ray'} & set(sys.modules)); "
            "assert not heavy, heavy; print(sorted(m.VLLMRollout.Config.model_fields))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "kv_cache_gib" in out and "num_threads" in out


def test_tiny_preset_with_vllm_validates() -> None:
    spec = tiny_vllm("roles.rollout.options={kv_cache_gib: 0.5, max_num_seqs: 64}")
    assert spec.roles.rollout.backend == "vllm"
    assert spec.roles.rollout.options == {"kv_cache_gib": 0.5, "max_num_seqs": 64}


def test_unknown_and_bad_options_are_reported_at_their_path() -> None:
    with pytest.raises(SpecError) as info:
        tiny_vllm("roles.rollout.options={kv_cache_gb: 1, max_num_seqs: 0}")
    paths = {issue.path for issue in info.value.issues}
    assert {"roles.rollout.options.kv_cache_gb", "roles.rollout.options.max_num_seqs"} <= paths


def test_media_modalities_are_refused_by_validate() -> None:
    with pytest.raises(SpecError, match="does not support image"):
        tiny_vllm("model.modalities=[text, image]", "data.media_keys={image: image}")
