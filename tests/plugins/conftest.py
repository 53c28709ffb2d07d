"""Fixtures of the plugin tests: one small tiny-lm build per session, and run specs around it."""

from __future__ import annotations

import pytest

from relax.spec import validate_spec  # before relax.registry: importing that first is an import cycle
from relax.contracts import PluginKind
from relax.registry import get_registry

#: A quick build: enough warm-up for the model to answer sometimes and stop at times.
TINY_OPTIONS = {"warmup_steps": 60}


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is fastest on one thread, and steady on a busy machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("relax-cache")


@pytest.fixture(scope="session")
def tiny_model_path(tiny_cache) -> str:
    cls = get_registry().load(PluginKind.models, "tiny-lm")
    return cls(cls.Config(**TINY_OPTIONS)).materialize(str(tiny_cache))


@pytest.fixture(scope="session")
def make_spec(tiny_model_path):
    """Builds a validated spec on the built model, with ``{"dotted.path": value}`` overrides."""

    def build(overrides: dict | None = None):
        raw = {
            "name": "plugin-test",
            "model": {"path": tiny_model_path},
            "roles": {
                "rollout": {"backend": "hf",
                            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6}},
                "actor": {"backend": "torch", "micro_batch_size": 5, "optimizer": {"lr": 1e-3}},
            },
            "tracing": {"exporter": "none"},
        }
        for dotted, value in (overrides or {}).items():
            node = raw
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return validate_spec(raw)

    return build
