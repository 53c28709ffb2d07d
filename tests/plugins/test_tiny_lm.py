"""The built-in tiny model: architecture without building, a cached and race-safe build."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from relax.spec.architecture import ModelArchitecture, architecture_from_hf_config
from relax.registry import get_registry

from .conftest import TINY_OPTIONS


def _tiny(**options):
    cls = get_registry().load("models", "tiny-lm")
    return cls(cls.Config(**options))


def test_architecture_is_known_without_building():
    numbers = ModelArchitecture.model_validate(_tiny().architecture())
    assert numbers.name == "builtin:tiny-lm"
    assert numbers.head_dim >= 32 and numbers.modalities == ("text",)


def test_built_model_matches_its_architecture(tiny_model_path):
    folder = Path(tiny_model_path)
    config = json.loads((folder / "config.json").read_text())
    built = architecture_from_hf_config(config, "builtin:tiny-lm")
    declared = ModelArchitecture.model_validate(_tiny(**TINY_OPTIONS).architecture())
    assert built.model_dump() == declared.model_dump()
    assert any(folder.glob("*.safetensors"))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["padding_side"] == "left"
    assert (folder / "relax-build.json").is_file()


def test_tokenizer_round_trips_the_task(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == "12+7="
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>" and tok.padding_side == "left"


def test_materialize_is_cached(tiny_cache, tiny_model_path):
    start = time.perf_counter()
    again = _tiny(**TINY_OPTIONS).materialize(str(tiny_cache))
    assert again == tiny_model_path
    assert time.perf_counter() - start < 0.5
    other = _tiny(**{**TINY_OPTIONS, "seed": 1})
    assert other.fingerprint() != _tiny(**TINY_OPTIONS).fingerprint()


def test_two_processes_racing_build_once(tmp_path):
    code = ("from relax.spec import validate_spec\n"
            "from relax.registry import get_registry\n"
            "cls = get_registry().load('models', 'tiny-lm')\n"
            f"print(cls(cls.Config(warmup_steps=0, num_layers=1)).materialize({str(tmp_path)!r}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    built = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert [p.name for p in built] == [Path(paths.pop()).name]  # no leftover staging folders
