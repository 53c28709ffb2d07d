"""Every built-in plugin loads through the registry (so its hooks match the contract) and stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel, ValidationError

from relax.registry import get_registry
from relax.spec.attribute_docs import document

BUILTINS = [
    ("rollout", "hf"),
    ("trainer", "torch"),
    ("rewards", "exact_match"),
    ("datasets", "synthetic:arithmetic"),
    ("datasets", "jsonl"),
    ("datasets", "parquet"),
    ("advantages", "grpo"),
    ("advantages", "dr_grpo"),
    ("advantages", "rloo"),
    ("losses", "ppo_clip"),
    ("models", "tiny-lm"),
]

MODULES = [
    "relax_plugins.rollout.hf",
    "relax_plugins.trainer.torch_trainer",
    "relax_plugins.rewards.exact_match",
    "relax_plugins.datasets.arithmetic",
    "relax_plugins.datasets.files",
    "relax_plugins.advantages.group",
    "relax_plugins.losses.ppo_clip",
    "relax_plugins.models.tiny_lm",
]


@pytest.mark.parametrize("kind, name", BUILTINS)
def test_loads_through_registry_with_a_strict_config(kind, name):
    cls = get_registry().load(kind, name)
    assert issubclass(cls.Config, BaseModel)
    assert cls.Config.model_config.get("extra") == "forbid"
    with pytest.raises(ValidationError):
        cls.Config.model_validate({"surely_not_an_option": 1})


def test_backends_declare_what_they_support():
    registry = get_registry()
    for kind, name in (("rollout", "hf"), ("trainer", "torch")):
        cls = registry.load(kind, name)
        assert "text" in cls.modalities
        assert cls.parallelism == frozenset({"dp"})
    for name in ("grpo", "dr_grpo", "rloo"):
        assert registry.load("advantages", name).group_based is True


def test_plugin_modules_import_without_torch():
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in MODULES)
            + "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'ray') if m in sys.modules]\n"
            + "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_documented_fields():
    # descriptions are read from the docstrings on demand (relax.spec.attribute_docs), as for help
    registry = get_registry()
    for kind, name in BUILTINS:
        for field_name, info in document(registry.load(kind, name).Config).model_fields.items():
            assert info.description, f"{kind} plugin {name}: option {field_name} has no docstring"
