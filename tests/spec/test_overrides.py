"""Command-line overrides in Hydra's grammar (``relax.config.overrides``): the forms, how values
are read, and the messages for overrides that cannot apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import load_spec_dict
from relax.spec import SpecError, validate_spec


def spec_file(tmp_path: Path, text: str = "name: a\nalgorithm: {kl_coef: 0.0}\n") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def load_error(ref, overrides) -> SpecError:
    with pytest.raises(SpecError) as caught:
        load_spec_dict(ref, overrides)
    return caught.value


def test_values_are_read_as_hydra_reads_them(tmp_path):
    raw, _ = load_spec_dict(spec_file(tmp_path), [
        "algorithm.kl_coef=1e-3", "seed=7", "data.shuffle=false", "model.modalities=[text,image]",
        "roles.rollout.options={a: 1, b: [x, y]}", "cluster.address=null"])
    assert raw["algorithm"]["kl_coef"] == 0.001  # YAML 1.1 would have kept "1e-3" as text
    assert raw["seed"] == 7
    assert raw["data"]["shuffle"] is False
    assert raw["model"]["modalities"] == ["text", "image"]
    assert raw["roles"]["rollout"]["options"] == {"a": 1, "b": ["x", "y"]}
    assert raw["cluster"]["address"] is None


def test_a_number_for_a_text_field_is_the_text_typed(tmp_path):
    raw, _ = load_spec_dict(spec_file(tmp_path), ["name=2024", "data.prompt_key=8", "model.path=007",
                                                  "trainer.steps=8", "roles.rollout.sampling.top_p=1"])
    assert raw["name"] == "2024"
    assert raw["data"]["prompt_key"] == "8"
    assert raw["model"]["path"] == "007"  # as typed, not the int 7
    assert raw["trainer"]["steps"] == 8  # an int field keeps the int
    assert raw["roles"]["rollout"]["sampling"]["top_p"] == 1
    assert validate_spec(load_spec_dict("tiny-cpu", ["name=2024"])[0]).name == "2024"


def test_add_delete_and_force_add(tmp_path):
    path = spec_file(tmp_path, "name: a\ntrainer: {steps: 5, checkpoint_every: 2}\n"
                               "data: {train: {source: 'synthetic:arithmetic', options: {size: 64}}}\n")
    raw, _ = load_spec_dict(path, ["+data.train.options.limit=3", "~trainer.checkpoint_every",
                                   "~data.train.options.size=64", "++trainer.steps=9", "++seed=4"])
    assert raw["data"]["train"]["options"] == {"limit": 3}
    assert raw["trainer"] == {"steps": 9}
    assert raw["seed"] == 4


def test_null_options_mean_none(tmp_path):
    raw, base = load_spec_dict("tiny-cpu", ["data.train.options=null", "model.options=null"])
    assert raw["data"]["train"]["options"] is None
    spec = validate_spec(raw, base_dir=base)
    assert spec.data.train.options == {} and spec.model.options == {}


def test_an_unknown_key_is_named_by_validation_with_the_other_problems(tmp_path):
    raw, base = load_spec_dict("tiny-cpu", ["trainer.stpes=5", "seed=-1"])
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, base_dir=base)
    issues = {i.path: i for i in caught.value.issues}
    assert set(issues) == {"trainer.stpes", "seed"}
    assert "steps" in issues["trainer.stpes"].remedy


def test_keys_inside_plugin_options_need_no_plus(tmp_path):
    raw, _ = load_spec_dict(spec_file(tmp_path), ["model.options.num_kv_heads=2"])
    assert raw["model"]["options"] == {"num_kv_heads": 2}


def test_adding_a_key_that_is_set_is_refused(tmp_path):
    [issue] = load_error(spec_file(tmp_path), ["+algorithm.kl_coef=0.1"]).issues
    assert issue.path == "algorithm.kl_coef"
    assert "already sets" in issue.message and "algorithm.kl_coef=..." in issue.remedy


def test_deleting_what_is_not_set_or_holds_another_value_is_refused(tmp_path):
    [missing] = load_error(spec_file(tmp_path), ["~trainer.steps"]).issues
    assert missing.path == "trainer.steps" and "nothing to delete" in missing.message
    [other] = load_error(spec_file(tmp_path), ["~algorithm.kl_coef=0.5"]).issues
    assert other.path == "algorithm.kl_coef" and "not 0.5" in other.message


@pytest.mark.parametrize(("bad", "path", "words"), [
    ("seed=1,2", "seed", "sweep"),
    ("seed@pkg=1", "", "@package"),
    ("hydra.run.dir=x", "hydra.run.dir", "no hydra section"),
    ("seed=[", "", "a.b.c=value"),
    ("+extends=tiny-cpu", "extends", "cannot be set on the command line"),
])
def test_forms_without_a_meaning_here_are_named(tmp_path, bad, path, words):
    [issue] = load_error(spec_file(tmp_path), [bad]).issues
    assert issue.path == path
    assert words in issue.message
    assert bad in issue.message


def test_hydra_is_imported_only_for_overrides():
    import subprocess
    import sys

    code = ("import sys; from relax.config import load_spec_dict; load_spec_dict('tiny-cpu'); "
            "print('hydra' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_value_the_grammar_has_no_token_for_is_the_text_typed(tmp_path):
    raw, _ = load_spec_dict(spec_file(tmp_path), ["model.path=~/models/x", "name=a#b"])
    assert raw["model"]["path"] == "~/models/x"
    assert raw["name"] == "a#b"
    [issue] = load_error(spec_file(tmp_path), ["model.path=~/x,y"]).issues  # structure: still an error
    assert "token recognition error" in issue.message


def test_an_override_naming_another_plugin_drops_the_old_plugins_options(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    raw, _ = load_spec_dict("tiny-cpu", [f"data.train.source={tmp_path / 'd.jsonl'}", "+data.train.options.limit=1"])
    assert raw["data"]["train"]["options"] == {"limit": 1}  # arithmetic's {size: 4096} is gone
    raw, _ = load_spec_dict("tiny-cpu", ["data.train.source=synthetic:arithmetic"])
    assert raw["data"]["train"]["options"] == {"size": 4096}  # the same plugin keeps them


def test_an_override_replacing_an_unresolvable_interpolation_never_resolves_it(tmp_path):
    """``name=${nope} name=1``: the second override replaces the first; looking at the value it
    replaces must not resolve it (it raised OmegaConf's InterpolationKeyError, a traceback and
    exit 1, found by the fuzz test)."""
    raw, _ = load_spec_dict("tiny-cpu", ["name=${nope}", "name=1"])
    assert raw["name"] == "1"
    raw, _ = load_spec_dict(spec_file(tmp_path, "name: a\nseed: ${nope}\n"), ["~seed=${nope}"])
    assert "seed" not in raw
    assert load_error(spec_file(tmp_path, "name: a\nseed: ${nope}\n"), ["~seed=3"]).issues[0].path == "seed"
    # left in place, the interpolation is a spec error naming its key
    assert load_error("tiny-cpu", ["name=${nope}"]).issues[0].path == "name"


def test_the_cli_answers_an_unresolvable_interpolation_with_a_spec_error(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "relax", "validate", "tiny-cpu", "name=${nope}", "seed=${nope}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert "nope" in run.stdout + run.stderr
