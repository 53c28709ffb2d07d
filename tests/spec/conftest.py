"""Spec fixtures: a valid CPU spec and a valid GPU spec built on the testkit plugins."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from relax.spec import RunSpec, SpecError, SpecIssue, validate_spec

CPU_SPEC = {
    "name": "rules",
    "model": {"path": "builtin:test-lm"},
    "data": {"train": {"source": "test_prompts"}},
    "algorithm": {"name": "grpo", "advantage": "test_group", "loss": "test_loss"},
    "rewards": [{"name": "test_reward"}],
    "roles": {"rollout": {"backend": "test_rollout"}, "actor": {"backend": "test_trainer"}},
    "cluster": {"nodes": 1, "gpus_per_node": 0},
    "tracing": {"exporter": "none"},
}

# 8 GPUs: a rollout engine with tp 2 (2 GPUs) and an actor with tp 2 on 4 GPUs.
GPU_SPEC = copy.deepcopy(CPU_SPEC)
GPU_SPEC["model"] = {"path": "Qwen/Qwen3-4B"}
GPU_SPEC["cluster"] = {"nodes": 1, "gpus_per_node": 8}
GPU_SPEC["roles"] = {
    "rollout": {"backend": "test_rollout", "replicas": 1, "gpus_per_replica": 2, "parallel": {"tp": 2}},
    "actor": {"backend": "test_trainer", "gpus": 4, "parallel": {"tp": 2}},
}


@pytest.fixture
def cpu_spec() -> dict:
    return copy.deepcopy(CPU_SPEC)


@pytest.fixture
def gpu_spec() -> dict:
    return copy.deepcopy(GPU_SPEC)


@pytest.fixture
def check(testkit_registry, tmp_path):
    """``check(raw)``: the issues of a spec by path (empty when it validates)."""

    def run(raw: dict, base_dir: Path = tmp_path) -> dict[str, SpecIssue]:
        try:
            spec = validate_spec(raw, base_dir=base_dir, registry=testkit_registry)
        except SpecError as exc:
            by_path: dict[str, SpecIssue] = {}
            for issue in exc.issues:
                by_path.setdefault(issue.path, issue)
            return by_path
        assert isinstance(spec, RunSpec)
        return {}

    return run
