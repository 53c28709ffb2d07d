"""``relax config SPEC [overrides]``: the resolved spec, every default filled, as a file that
validates on its own."""

from __future__ import annotations

import yaml

from relax.spec.models import RunSpec


def test_config_prints_the_resolved_spec_with_every_default(relax, tmp_path):
    (tmp_path / "my.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "run.yaml").write_text("extends: tiny-cpu\nname: mine\ndata: {train: {source: my.jsonl}}\n")
    result = relax("config", "run.yaml", "trainer.steps=2", "+data.train.options.limit=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert "extends" not in resolved  # merged already: the output stands alone
    assert resolved["data"]["train"] == {"source": "my.jsonl", "options": {"limit": 1}}
    assert resolved["trainer"]["steps"] == 2
    assert resolved["trainer"]["output_dir"] == "runs/mine"
    assert resolved["roles"]["rollout"]["sampling"]["max_new_tokens"] == 8  # from the preset
    assert set(resolved) == set(RunSpec.model_fields) - {"extends"}  # every section, defaults filled
    assert resolved["fault_tolerance"] == RunSpec(name="x").fault_tolerance.model_dump(mode="json")
    (tmp_path / "resolved.yaml").write_text(result.stdout)
    assert relax("validate", "resolved.yaml", cwd=tmp_path).returncode == 0


def test_config_of_a_bad_override_exits_2_naming_it(relax):
    result = relax("config", "tiny-cpu", "data.prompt_kye=q")
    assert result.returncode == 2
    assert "data.prompt_kye: unknown key" in result.stderr and "prompt_key" in result.stderr
