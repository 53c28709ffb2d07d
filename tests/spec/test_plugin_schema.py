"""The run spec's JSON Schema completes and checks each shipped plugin's options (an editor reads
``schemas/run-spec.schema.json`` through the presets' ``yaml-language-server`` line)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from relax.config.loader import PRESETS_DIR

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "schemas" / "run-spec.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
TINY = yaml.safe_load((PRESETS_DIR / "tiny-cpu.yaml").read_text())
PRESETS = sorted(PRESETS_DIR.glob("*.yaml"))


def errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(doc)]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_points_editors_at_the_schema_and_satisfies_it(preset):
    first = preset.read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=../../schemas/run-spec.schema.json"
    assert errors(yaml.safe_load(preset.read_text())) == []


@pytest.mark.parametrize(("where", "bad"), [
    (("data", "train", "options"), {"sise": 3}),            # synthetic:arithmetic
    (("rewards", 0, "options"), {"nope": 1}),                 # exact_match
    (("roles", "rollout", "options"), {"max_batch": 4}),      # hf
    (("roles", "actor", "options"), {"threads": 2}),          # torch
    (("model", "options"), {"hiden_size": 8}),                # builtin:tiny-lm
])
def test_a_misspelled_plugin_option_is_flagged(where, bad):
    doc = copy.deepcopy(TINY)
    node = doc
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = bad
    found = errors(doc)
    assert len(found) == 1 and "was unexpected" in found[0], found


def test_a_data_file_takes_the_file_plugins_options_without_its_implied_path():
    doc = copy.deepcopy(TINY)
    doc["data"]["train"] = {"source": "mine.jsonl", "options": {"limit": 2}}
    assert errors(doc) == []
    doc["data"]["train"] = {"source": "mine.csv", "options": {"size": 4096}}  # arithmetic's option
    assert len(errors(doc)) == 1
    doc["data"]["train"] = {"source": "./saved", "options": {"split": "test"}}
    assert errors(doc) == []
