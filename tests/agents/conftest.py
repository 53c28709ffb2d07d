"""Fixtures of the agentic-rollout tests: a warmed-up tiny omni model (its turns end with
``<|im_end|>`` like an instruct model's) with the real ``hf`` rollout and ``torch`` trainer."""

from __future__ import annotations

import pytest

from relax.spec import validate_spec  # before relax.registry (import order of the package)
from relax.contracts import PluginKind
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def omni_path(tmp_path_factory) -> str:
    """A tiny-omni folder with a short warm-up: enough for its turns to end by themselves."""
    cls = get_registry().load(PluginKind.models, "tiny-omni")
    return cls(cls.Config(warmup_steps=60, warmup_pool=12)).materialize(str(tmp_path_factory.mktemp("omni-cache")))


@pytest.fixture(scope="session")
def omni_spec(omni_path):
    return validate_spec({
        "name": "agent-omni",
        "model": {"path": omni_path, "modalities": ["text", "image"]},
        "data": {"train": {"source": "synthetic:omni"}, "media_keys": {"image": "image"}, "max_prompt_tokens": 128},
        "roles": {"rollout": {"backend": "hf", "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                            "max_new_tokens": 12}},
                  "actor": {"backend": "torch", "micro_batch_size": 8, "optimizer": {"lr": 1e-3}}},
        "tracing": {"exporter": "none"},
    })


@pytest.fixture(scope="session")
def omni_backends(omni_spec, omni_path):
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(omni_spec, omni_path))
    loss_cls = registry.load("losses", "ppo_clip")
    trainer = registry.load("trainer", "torch")(
        registry.build_config("trainer", "torch", {}),
        trainer_context(omni_spec, "actor", omni_path, loss=loss_cls(loss_cls.Config(), algorithm_context(omni_spec))))
    return rollout, trainer
