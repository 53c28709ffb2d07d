"""``relax run`` of the tiny preset on its Qwen3-MoE with rollout routing replay (r3), on a real
local Ray and the real bus: the rollout's routed experts reach the actor, which trains with them."""

from __future__ import annotations

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_r3_trains_the_tiny_moe_through_the_bus(tmp_path):
    with testing.local_ray():
        code, rows, _ = testing.tiny_run(tmp_path, "r3", "model.options.architecture=qwen3_moe",
                                         "algorithm.router_replay=r3", "trainer.steps=3",
                                         "placement.mode=separate", "async_policy.max_staleness=1")
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/tokens"] > 0 and row["train/grad_norm"] > 0
        # Every step replayed the rollout's routing: the share the actor's router would have
        # changed is measured (the columns reached it), and small (the same or a near version).
        assert 0.0 <= row["train/router_replay/changed"] < 0.5
