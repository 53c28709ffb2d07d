"""``data.chat_template``: the rollout renders each text prompt through the chat template (the
tokenizer's own with ``auto``, a Jinja file, or none), and the ids it generated from are the ids
the trainer reads on the bus."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.plan.contexts import rollout_context
from relax.registry import get_registry
from relax.runtime.model_files import materialize_path
from relax.runtime.worker.rows import rollout_columns
from relax.testing import tiny_spec

PROMPT = "347*58="
#: The tiny agent's model: the built-in tiny-lm with its calculator task, whose tokenizer has a chat
#: template (presets/tiny-agent-cpu.yaml).
AGENT_OPTIONS = {"task": "calculator", "num_attention_heads": 4, "num_kv_heads": 4, "warmup_steps": 300}


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory) -> str:
    return materialize_path("builtin:tiny-lm", AGENT_OPTIONS, tmp_path_factory.getbasetemp())


def rollout(tmp_path: Path, model: str, *overrides: str):
    spec, _, base = tiny_spec(tmp_path, "chat", "model.options.task=calculator", *overrides)
    registry = get_registry()
    backend = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, model, base_dir=base))
    return backend


def template_ids(tokenizer, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_auto_renders_through_the_tokenizers_template_and_the_trainer_reads_those_ids(tmp_path, agent_model):
    backend = rollout(tmp_path, agent_model)
    expected = template_ids(backend.tokenizer)
    assert backend.tokenizer.chat_template  # the tiny agent's tokenizer has one
    assert backend.encode_prompt(PROMPT) == expected
    assert expected != backend.tokenizer(PROMPT, add_special_tokens=True)["input_ids"]  # not the raw prompt
    [gen] = backend.generate([PROMPT], 1, backend.context.sampling, seed=3)
    assert gen.prompt_ids == expected
    for ragged in (False, True):  # the bus columns the actor, reference and actor_fwd read
        columns = rollout_columns([gen], [PROMPT], ["20126"], backend.pad_token_id, ragged=ragged)
        prompt_len, _ = columns["lengths"][0].tolist()
        # one row: no left pad in the dense layout ([left pad][prompt][response][right pad])
        assert prompt_len == len(expected)
        assert columns["input_ids"][0].tolist()[:prompt_len] == expected


def test_none_tokenizes_raw(tmp_path, agent_model):
    backend = rollout(tmp_path, agent_model, "data.chat_template=none")
    assert backend.encode_prompt(PROMPT) == backend.tokenizer(PROMPT, add_special_tokens=True)["input_ids"]


def test_a_template_file_relative_to_the_spec_folder_is_used_instead(tmp_path, agent_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}"
                                          "{% if add_generation_prompt %}A:{% endif %}")
    backend = rollout(tmp_path, agent_model, f"data.chat_template={tmp_path / 'plain.jinja'}")
    assert backend.prompts.render(PROMPT) == f"Q: {PROMPT}\nA:"
    assert backend.encode_prompt(PROMPT) == template_ids(backend.tokenizer,
                                                         chat_template=(tmp_path / "plain.jinja").read_text())
