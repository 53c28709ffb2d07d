"""The Plan: GPU accounting per preset, placement modes, feasibility errors, memory by hand."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from relax.config import load_spec_dict
from relax.plan import make_plan, render
from relax.plan.memory import GIB, params_per_gpu, rollout_memory, trained_role_memory
from relax.plan.placement import plan_placement
from relax.spec import RunSpec, SpecError, validate_spec
from relax.spec.architecture import load_card
from relax.spec.rules import gpus_requested
from relax.config.loader import PRESETS_DIR

PRESETS = sorted(PRESETS_DIR.glob("*.yaml"))


def plan_of(ref: str | Path, *overrides: str):
    raw, base = load_spec_dict(str(ref), list(overrides))
    spec = validate_spec(raw, base_dir=base)
    return spec, make_plan(spec, base_dir=base)


def issue_paths(exc: pytest.ExceptionInfo[SpecError]) -> list[str]:
    return [i.path for i in exc.value.issues]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_bundles_account_for_exactly_the_gpus_asked(preset: Path) -> None:
    spec, plan = plan_of(preset)
    data = json.loads(render(plan, "json"))
    bundle_gpus = [(b["node"], g) for pool in data["pools"] for b in pool["bundles"] for g in b["gpus"]]
    assert len(bundle_gpus) == len(set(bundle_gpus)), "a GPU is reserved by two bundles"
    assert len(bundle_gpus) == gpus_requested(spec) == data["gpus_used"]
    for node, gpu in bundle_gpus:
        assert 0 <= node < spec.cluster.nodes and 0 <= gpu < spec.cluster.gpus_per_node


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_no_gpu_holds_two_roles_unless_the_mode_shares_it(preset: Path) -> None:
    spec, plan = plan_of(preset)
    roles_on: dict[tuple[int, int], set[str]] = {}
    for inst in plan.instances:
        for gpu in inst.gpus:
            roles_on.setdefault((inst.node, gpu), set()).add(inst.role)
    shared = {"colocate": {"actor", "rollout", "reference", "critic", "actor_fwd"},
              "hybrid": {"actor", "reference", "actor_fwd"}, "separate": set()}[spec.placement.mode]
    for device, roles in roles_on.items():
        assert len(roles) == 1 or roles <= shared, f"{device} holds {roles} in {spec.placement.mode} mode"


def test_colocate_shares_every_gpu_between_actor_and_rollout() -> None:
    _, plan = plan_of("qwen3-4b-grpo-colocate")
    assert [p.name for p in plan.pools if p.gpu_count] == ["colocate"]
    for inst in plan.instances:
        if inst.role in ("actor", "rollout"):
            assert inst.gpu_fraction == 0.5
    assert set(plan.memory[0].phases) == {"generate", "train"}


def test_hybrid_puts_reference_and_advantage_in_the_actor_pool() -> None:
    _, plan = plan_of("qwen3-4b-grpo-hybrid")
    assert plan.pool("actor").roles == ["actor", "reference", "advantage"]
    assert plan.pool("rollout").roles == ["rollout", "reward"]  # scoring rides on the rollout
    assert {i.role for i in plan.instances if i.pool == "actor"} == {"actor", "reference", "advantage"}


def test_two_node_preset_keeps_each_role_group_inside_nodes() -> None:
    _, plan = plan_of("qwen3-omni-30b-a3b")
    assert {i.node for i in plan.instances_of("rollout")} == {0}
    assert {i.node for i in plan.instances_of("actor")} == {1}
    assert plan.pool("rollout").strategy == "PACK"  # multi-node cluster
    assert len(plan.memory) == 16 + 1  # 16 GPUs and the host of the CPU workers


def shaped_spec(ref: str, *overrides: str) -> RunSpec:
    """A spec checked for shape only: placement is pure logic, whatever backend supports tp."""
    raw, _ = load_spec_dict(ref, list(overrides))
    return RunSpec.model_validate(raw)


def test_tensor_parallel_groups_stay_inside_a_node() -> None:
    # 3 nodes x 6 GPUs, tp 4: a group may not straddle GPUs 4-5 of one node and 0-1 of the next.
    spec = shaped_spec("qwen3-4b-grpo-async", "cluster.nodes=3", "cluster.gpus_per_node=6",
                       "roles.actor.gpus=8", "roles.actor.parallel.tp=4", "roles.rollout.replicas=2")
    _, instances = plan_placement(spec)
    groups: dict[tuple[int, int, int], set[int]] = {}
    for inst in (i for i in instances if i.role == "actor"):
        key = (inst.coords["dp"], inst.coords["pp"], inst.coords["cp"])
        groups.setdefault(key, set()).add(inst.node)
    assert groups and all(len(nodes) == 1 for nodes in groups.values())


def test_more_gpus_than_the_cluster_is_an_error() -> None:
    with pytest.raises(SpecError) as exc:
        plan_of("qwen3-4b-grpo-async", "roles.actor.gpus=16")
    assert "cluster" in issue_paths(exc)


def test_a_tp_group_wider_than_a_node_is_an_error() -> None:
    with pytest.raises(SpecError) as exc:
        plan_placement(shaped_spec("qwen3-4b-grpo-async", "cluster.nodes=3", "cluster.gpus_per_node=4",
                                   "roles.actor.gpus=8", "roles.actor.parallel.tp=8"))
    assert "roles.actor.parallel.tp" in issue_paths(exc)


def test_groups_that_no_longer_fit_any_node_are_an_error() -> None:
    # 2 nodes x 8 = 16 GPUs for 6 + 4 + 3 + 3: the rollout takes 6 of node 0, the actor's tp-4 group
    # and the critic's tp-3 group go to node 1, and the reference's tp-3 group finds 2 and 1 free.
    with pytest.raises(SpecError) as exc:
        plan_placement(shaped_spec("qwen3-4b-grpo-async", "cluster.nodes=2", "roles.rollout.replicas=6",
                                   "roles.actor.gpus=4", "roles.actor.parallel.tp=4",
                                   "roles.critic={gpus: 3, parallel: {tp: 3}}",
                                   "roles.reference={gpus: 3, parallel: {tp: 3}}"))
    assert "cluster" in issue_paths(exc)


def test_memory_over_the_gpu_is_an_error_naming_the_role() -> None:
    with pytest.raises(SpecError) as exc:
        plan_of("qwen3-4b-grpo-async", "cluster.gpu_memory_gb=16", "roles.actor.gradient_checkpointing=false",
                "roles.actor.micro_batch_size=16")
    assert "roles.actor" in issue_paths(exc)
    assert "exceeds cluster.gpu_memory_gb=16" in str(exc.value)


def test_dense_memory_matches_a_hand_computation() -> None:
    # Qwen3-4B: per layer q 2560x4096 + k,v 2x2560x1024 + o 4096x2560 = 26,214,400,
    # SwiGLU 3x2560x9728 = 74,711,040, two norms 5,120 -> 100,930,560; x36 = 3,633,500,160;
    # tied embedding 151,936 x 2560 = 388,956,160; final norm 2,560 -> P = 4,022,458,880.
    arch = load_card("Qwen/Qwen3-4B")
    assert arch.params_total() == 4_022_458_880
    spec, plan = plan_of("qwen3-4b-grpo-async")  # actor: 4 GPUs, full replicas (torch), bf16, adamw
    actor = {i.what: i.gib for i in plan.memory[-2].items if i.role == "actor"}
    p = 4_022_458_880
    assert actor["weights"] == pytest.approx(p * 2 / GIB, abs=1e-3)
    assert actor["gradients"] == pytest.approx(p * 2 / GIB, abs=1e-3)
    assert actor["optimizer"] == pytest.approx(p * 12 / GIB, abs=1e-3)
    # Checkpointed activations: 36 layers x 2 x s x b x h plus one layer s x b x h x 34 bytes,
    # s = 512 + 2048, b = 2, h = 2560; logits b x s x V x 4 x 2.
    s, b, h = 2560, 2, 2560
    assert actor["activations"] == pytest.approx((36 * 2 * s * b * h + s * b * h * 34) / GIB, abs=1e-3)
    assert actor["logits"] == pytest.approx(b * s * 151_936 * 8 / GIB, abs=1e-3)
    # Rollout: bf16 weights P x 2; KV 2 x 36 x 8 x 128 x 2 = 147,456 B per token, for
    # 64 x 8 / 4 replicas = 128 sequences of 2560 tokens.
    kv = {i.what: i.gib for i in rollout_memory(spec, arch)}
    assert kv["weights"] == pytest.approx(p * 2 / GIB, abs=1e-3)
    assert kv["kv_cache"] == pytest.approx(128 * 2560 * 147_456 / GIB, abs=1e-3)


def test_a_fill_drain_pipeline_holds_every_micro_batch_of_an_update() -> None:
    """megatron's pp runs a fill-drain schedule (``pipeline_schedule``): the first stage keeps the
    activations of all m micro-batches of an update, m x L/pp layers, where 1F1B keeps about L."""
    common = ("roles.actor.gpus=4", "roles.actor.parallel.pp=2", "algorithm.updates_per_step=4")
    spec, plan = plan_of("qwen3-4b-grpo-async", *common, "roles.actor.backend=megatron")
    megatron = next(i.gib for d in plan.memory for i in d.items if i.role == "actor" and i.what == "activations")
    arch = load_card("Qwen/Qwen3-4B")
    one_f_one_b = next(i.gib for i in trained_role_memory("actor", spec.roles.actor, spec, arch, "none", 2, "1f1b")
                       if i.what == "activations")

    # 64 prompts x 8 samples over dp = 4 GPUs / pp 2 = 2 ranks, 4 updates: 64 rows, m = 32 micro-batches
    # of 2 per update; checkpointed, 2 x s x b x h per layer and micro-batch (plus one full layer,
    # s x b x h x 34), s = 2560, b = 2, h = 2560; 36 layers / 2 stages.
    s, b, h = 2560, 2, 2560
    full_layer = s * b * h * 34
    assert megatron == pytest.approx((32 * 18 * 2 * s * b * h + full_layer) / GIB, abs=1e-3)
    assert one_f_one_b == pytest.approx((36 * 2 * s * b * h + full_layer) / GIB, abs=1e-3)


def test_moe_memory_matches_a_hand_computation() -> None:
    # Qwen3-30B-A3B: attention 2048x4096 + 2x2048x512 + 4096x2048 = 18,874,368; experts
    # 128 x 3 x 2048 x 768 = 603,979,776; router 2048 x 128 = 262,144; norms 4,096 ->
    # 623,120,384 per layer, x48 = 29,909,778,432; untied embeddings 2 x 151,936 x 2048 =
    # 622,329,856; final norm 2,048 -> 30,532,110,336. Experts in total: 48 x 603,979,776.
    arch = load_card("Qwen/Qwen3-30B-A3B")
    assert arch.params_total() == 30_532_110_336
    experts = 48 * 603_979_776
    dense = 30_532_110_336 - experts
    assert params_per_gpu(arch, tp=2, pp=1, ep=8) == pytest.approx(dense / 2 + experts / 8)
    # Active parameters: 8 of 128 experts per token.
    assert arch.params_active() == 30_532_110_336 - 48 * 120 * 3 * 2048 * 768


def test_staleness_windows_follow_the_bound() -> None:
    _, plan = plan_of("qwen3-4b-grpo-async")
    assert plan.staleness.max_staleness == 2
    assert [(w.min_version, w.max_version) for w in plan.staleness.first_steps[:4]] == [(0, 0), (0, 1), (0, 2), (1, 3)]


def test_bus_and_weight_sync_follow_the_roles() -> None:
    _, plan = plan_of("qwen3-4b-grpo-hybrid")
    fields = {f.name: f for f in plan.bus}
    assert fields["ref_logprobs"].writer == "reference" and fields["ref_logprobs"].readers == ["actor"]
    assert fields["advantages"].writer == "advantage"
    assert "reference" in fields["input_ids"].readers and "reference" in fields["lengths"].readers
    assert [(e.source, e.target, e.mechanism) for e in plan.weight_sync] == [("actor", "rollout", "nccl-broadcast")]
    _, tiny = plan_of("tiny-cpu")
    assert tiny.weight_sync[0].mechanism == "object-store"


def test_unknown_architecture_plans_without_memory() -> None:
    _, plan = plan_of("qwen3-4b-grpo-async", "model.path=SomeOrg/Unknown-7B")
    assert plan.memory == [] and any("unknown" in n for n in plan.notes)


@pytest.mark.parametrize("fmt", ["table", "dot", "mermaid"])
def test_renderings_name_every_role(fmt: str) -> None:
    _, plan = plan_of("qwen3-4b-grpo-hybrid")
    text = render(plan, fmt)
    for role in ("rollout", "actor", "reference", "reward", "advantage"):
        assert role in text
    if fmt == "dot":
        assert text.startswith('digraph "qwen3-4b-grpo-hybrid"') and "style=dashed" in text
    if fmt == "mermaid":
        assert text.startswith("flowchart LR") and "-.->" in text


def test_instances_count_per_role() -> None:
    _, plan = plan_of("qwen3-omni-30b-a3b")
    # roles.reward.host: rollout (the default): a scorer rides on every rollout engine's bundle.
    assert Counter(i.role for i in plan.instances) == {"rollout": 8, "actor": 8, "reward": 8, "advantage": 1}
    for engine, scorer in zip(plan.instances_of("rollout"), plan.instances_of("reward")):
        assert (scorer.pool, scorer.bundles, scorer.gpus) == (engine.pool, engine.bundles[:1], [])
    assert plan.instances_of("advantage")[0].bundles == plan.instances_of("rollout")[0].bundles[:1]


def test_reward_workers_of_their_own_share_a_scoring_pool_with_the_advantage() -> None:
    _, plan = plan_of("qwen3-omni-30b-a3b", "roles.reward.host=own", "roles.reward.replicas=2")
    assert Counter(i.role for i in plan.instances) == {"rollout": 8, "actor": 8, "reward": 2, "advantage": 1}
    reward, advantage = plan.instances_of("reward")[0], plan.instances_of("advantage")[0]
    assert (reward.pool, reward.bundles) == (advantage.pool, advantage.bundles) == ("scoring", [0])
    assert plan.pool("rollout").roles == ["rollout"]


def test_a_judge_gets_gpus_of_its_own_with_its_weights_estimated() -> None:
    judge = "rewards=[{name: genrm, options: {model: Qwen/Qwen3-4B, dtype: bfloat16}}]"
    spec, plan = plan_of("tiny-cpu", "cluster.gpus_per_node=4", "roles.reward.host=own", "roles.reward.replicas=2",
                         "roles.reward.gpus_per_replica=1", judge)
    rewards = plan.instances_of("reward")
    assert [r.gpus for r in rewards] == [[0], [1]] and plan.gpus_used == 2 == gpus_requested(spec)
    on_gpu0 = next(d for d in plan.memory if d.gpu == 0)
    weights = next(i for i in on_gpu0.items if i.what == "weights (genrm)")
    qwen3_4b_params = 4_022_458_880
    assert weights.gib == pytest.approx(qwen3_4b_params * 2 / GIB, abs=1e-3)  # GiB to 3 decimals
    assert any("KV cache" in note for note in plan.notes)


def test_reward_gpus_need_reward_workers_of_their_own() -> None:
    with pytest.raises(SpecError) as exc:
        plan_of("tiny-cpu", "cluster.gpus_per_node=4", "roles.reward.gpus_per_replica=1")
    assert "roles.reward.gpus_per_replica" in issue_paths(exc)


def test_an_elastic_rollout_is_shown_with_its_limit() -> None:
    _, plan = plan_of("qwen3-4b-grpo-async", "roles.rollout.max_replicas=6")
    assert plan.rollout_max_replicas == 6
    assert len(plan.instances_of("rollout")) == 4  # the planned replicas; scaling adds bundles later
    table = render(plan, "table")
    assert "rollout: elastic up to 6 replicas (4 planned;" in table
    assert table.index("rollout: elastic") < table.index("Placement and memory")
    assert json.loads(render(plan, "json"))["rollout_max_replicas"] == 6


@pytest.mark.parametrize("overrides", [(), ("roles.rollout.max_replicas=4",)])
def test_a_fixed_rollout_is_not_shown_as_elastic(overrides: tuple[str, ...]) -> None:
    _, plan = plan_of("qwen3-4b-grpo-async", *overrides)  # 4 replicas; max_replicas 4 is not elastic
    assert plan.rollout_max_replicas is None
    assert "elastic" not in render(plan, "table")


def test_plan_schema_is_current() -> None:
    from relax.plan.model import Plan

    checked_in = Path(__file__).parents[2] / "schemas" / "plan.schema.json"
    assert json.loads(checked_in.read_text()) == Plan.model_json_schema()


def test_the_weight_sync_edge_follows_roles_rollout_weight_sync() -> None:
    _, tiny = plan_of("tiny-cpu", "roles.rollout.weight_sync=collective")
    assert [(e.source, e.target, e.mechanism) for e in tiny.weight_sync] == [("actor", "rollout", "gloo-broadcast")]
    _, hybrid = plan_of("qwen3-4b-grpo-hybrid", "roles.rollout.weight_sync=object_store")
    assert hybrid.weight_sync[0].mechanism == "object-store"


def _loops(plan) -> dict[str, object]:
    return {loop.task: loop for worker in plan.workers for loop in worker.roles}


def test_colocate_hands_a_steps_rows_to_the_actor_in_memory() -> None:
    _, plan = plan_of("tiny-cpu", "placement.mode=colocate", "async_policy.max_staleness=0")
    loops = _loops(plan)
    assert loops["advantage"].hands_to == "actor"
    assert loops["actor"].takes_from == "advantage" and loops["actor"].waits_for == []
    assert "to actor in memory" in render(plan, "table")


@pytest.mark.parametrize("overrides", [
    ("placement.mode=separate",),  # the actor is in another process
    ("placement.mode=colocate", "async_policy.max_staleness=0", "roles.reference.backend=torch",
     "algorithm.kl_coef=0.01"),  # the reference reads the rows from the bus
])
def test_rows_go_through_the_bus_when_another_process_or_role_reads_them(overrides: tuple[str, ...]) -> None:
    _, plan = plan_of("tiny-cpu", *overrides)
    loops = _loops(plan)
    assert loops["advantage"].hands_to is None
    assert loops["actor"].takes_from is None and "advantages" in loops["actor"].waits_for


def test_the_table_shows_what_each_role_keeps_on_each_device() -> None:
    """docs/plan.md promises per-role memory contents: the table lists them under each device."""
    raw, base = load_spec_dict("qwen3-4b-grpo-async", [])
    plan = make_plan(validate_spec(raw, base_dir=base), base_dir=base)
    lines = render(plan, "table").splitlines()
    actor_gpu = next(d for d in plan.memory if d.roles == ["actor"])
    row = next(i for i, line in enumerate(lines) if line.split()[:2] == [str(actor_gpu.node), f"gpu{actor_gpu.gpu}"])
    held = {i.what: i.gib for i in actor_gpu.items if not i.transient}
    freed = {i.what: i.gib for i in actor_gpu.items if i.transient}
    assert set(held) == {"weights", "optimizer"} and "activations" in freed
    assert lines[row + 1].strip() == ("actor: " + ", ".join(f"{k} {v:.2f}" for k, v in held.items())
                                      + "; transient: " + ", ".join(f"{k} {v:.2f}" for k, v in freed.items()))


def test_torch_threads_share_the_cores_but_stop_at_what_the_model_width_uses() -> None:
    from relax.plan.wiring import HIDDEN_PER_THREAD, torch_threads
    from relax.spec.architecture import ModelArchitecture

    def arch(hidden: int) -> ModelArchitecture:
        return ModelArchitecture(name="m", num_layers=2, hidden_size=hidden, num_attention_heads=2, num_kv_heads=1,
                                 head_dim=32, intermediate_size=4 * hidden, vocab_size=99)

    tiny, wide = arch(64), arch(4096)
    assert torch_threads(16, 1, tiny) == 2 and torch_threads(16, 2, tiny) == 2  # not 16 spinning threads
    assert torch_threads(2, 2, tiny) == 1  # two model processes on two cores: one each
    assert torch_threads(16, 2, wide) == 8 and torch_threads(64, 1, wide) == 64  # a wide model gets the share
    assert torch_threads(64, 1, arch(16 * HIDDEN_PER_THREAD)) == 16
    assert torch_threads(16, 2, None) == 8  # unknown width: the whole share
    assert torch_threads(3, 5, tiny) == 1


def test_the_tiny_preset_s_workers_get_the_threads_its_width_uses(tmp_path: Path) -> None:
    from relax.plan.wiring import plan_workers
    from relax.registry import get_registry
    from relax.spec.validate import resolve_architecture

    for mode, staleness in (("colocate", 0), ("separate", 1)):
        raw, base = load_spec_dict("tiny-cpu", [f"placement.mode={mode}", f"async_policy.max_staleness={staleness}"])
        spec = validate_spec(raw, base_dir=base)
        arch, _ = resolve_architecture(spec.model.path, base, get_registry(), spec.model.options)
        _, instances = plan_placement(spec)
        many = plan_workers(spec, instances, tmp_path, cores=16, arch=arch)
        assert {w.threads for w in many} == {2}, (mode, [w.threads for w in many])
        assert {w.threads for w in plan_workers(spec, instances, tmp_path, cores=16)} == {16 // len(many)}


def test_a_cpu_run_whose_cores_give_each_model_process_one_thread_is_pointed_to_colocate(monkeypatch) -> None:
    from relax.plan import wiring

    monkeypatch.setattr(wiring, "available_cores", lambda: 2)
    crowded = [n for n in plan_of("tiny-cpu")[1].notes if "placement.mode=colocate" in n]
    assert len(crowded) == 1 and "2 model processes share this machine's 2 cores" in crowded[0]
    assert not any("placement.mode=colocate" in n for n in plan_of("tiny-cpu", "placement.mode=colocate", "async_policy.max_staleness=0")[1].notes)
    monkeypatch.setattr(wiring, "available_cores", lambda: 4)  # two threads a model process
    assert not any("placement.mode=colocate" in n for n in plan_of("tiny-cpu")[1].notes)
