"""FSDP2 in the torch trainer (relax_plugins.trainer.fsdp), on real processes: 2 ranks on CPU over gloo.

Each case trains the same batch for 3 steps twice: once in one unsharded process on the whole
batch, once sharded over 2 ranks, each rank on its strided half (as ``relax.runtime.worker.ranks``
deals rows). Loss, grad norm and the updated weights must agree within 1e-5. A sharded checkpoint
taken after step 2 resumes to the same step-3 loss as the run that went on, and its Hugging Face
folder loads with ``transformers`` and gives the trainer's log-probs.

All cases of a test run in one spawn of 2 processes (the imports dominate). The default suite runs
tiny-lm with a checkpoint; the ``fsdp`` lane (``nox -s fsdp``) adds the tiny MoE, tiny-omni (image +
audio), activation checkpointing, CPU offload, one unit for the whole model, uneven shards (ranks with
different micro-batch counts run in lockstep), the critic, and a forward-only reference (log-probs,
and again after it follows a trained replica's weights).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from relax.spec import validate_spec  # before relax.registry (import order of the package)
from relax.algo.batch import TrainBatch, collate
from relax.contracts import PluginKind
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry

STEPS = 3
TOLERANCE = 1e-5
PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]


def _raw(model_path: str, media: dict | None = None, lr: float = 3e-4, ppo: bool = False) -> dict:
    raw = {
        "name": "fsdp-test",
        "model": {"path": model_path},
        "roles": {"rollout": {"backend": "hf", "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6}},
                  "actor": {"backend": "torch", "micro_batch_size": 2,
                            "optimizer": {"lr": lr, "grad_clip": 1.0}}},
        "tracing": {"exporter": "none"},
    }
    if ppo:  # a critic and a reference too
        raw["algorithm"] = {"name": "ppo", "kl_coef": 0.01}
        raw["roles"]["critic"] = {"backend": "torch", "micro_batch_size": 2, "optimizer": {"lr": lr}}
        raw["roles"]["reference"] = {"backend": "torch", "micro_batch_size": 2}
    if media is not None:
        raw["model"]["modalities"] = ["text", *media]
        raw["data"] = {"train": {"source": "synthetic:omni"}, "media_keys": media, "max_prompt_tokens": 128}
    return raw


def _trainer(raw: dict, options: dict, role: str = "actor") -> object:
    spec = validate_spec(raw)
    registry = get_registry()
    loss = None
    if role == "actor":
        loss_cls = registry.load("losses", "ppo_clip")
        loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", options),
                                             trainer_context(spec, role, raw["model"]["path"], loss=loss))


def _steps(trainer, batch: TrainBatch) -> list[dict[str, float]]:
    return [trainer.train_step(batch) for _ in range(STEPS)]


def _run_case(case: dict, rank: int, world: int, out: Path) -> None:
    """One case on this rank: 3 sharded steps on this rank's rows, then (``checkpoint``) a resume.
    A forward-only role (``reference``) computes log-probs instead, then again after following the
    weights of a trained replica (``load_weights``)."""
    batch = _case_batch(case)
    shard = batch.select(list(range(rank, batch.batch_size, world)))
    options = {"fsdp": {"enabled": True, **case.get("fsdp", {})}}
    role = case.get("role", "actor")
    trainer = _trainer(case["raw"], options, role)
    if role == "reference":
        before = trainer.compute_logprobs(shard)
        trainer.load_weights(torch.load(case["follow"], weights_only=False), 1)
        after = trainer.compute_logprobs(shard)
        if rank == 0:
            torch.save({"logprobs": [before, after]}, out / f"{case['name']}.pt")
        return
    results = [trainer.train_step(shard) for _ in range(STEPS - 1)]
    if case.get("checkpoint"):
        trainer.save(str(out / f"{case['name']}-ckpt"))
    results.append(trainer.train_step(shard))
    weights = trainer.weights()  # every rank gathers (a collective)
    if case.get("export"):  # a LoRA adapter's merged model, gathered by every rank
        trainer.save_merged_model(str(out / f"{case['name']}-merged"))
    resumed = None
    if case.get("checkpoint"):
        fresh = _trainer(case["raw"], options)
        fresh.load(str(out / f"{case['name']}-ckpt"))
        resumed = fresh.train_step(shard)
    if rank == 0:
        torch.save({"results": results, "weights": weights, "resumed": resumed}, out / f"{case['name']}.pt")


def _case_batch(case: dict) -> TrainBatch:
    """The case's batch, cut to its first ``rows`` rows when it says (uneven shards)."""
    batch = torch.load(case["batch"], weights_only=False)
    return batch.select(list(range(case["rows"]))) if "rows" in case else batch


def _ranks_main(rank: int, world: int, port: int, jobs: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for case in json.loads(Path(jobs).read_text()):
            _run_case(case, rank, world, Path(out))
    finally:
        dist.destroy_process_group()


def _spawn(cases: list[dict], folder: Path) -> dict[str, dict]:
    import torch.multiprocessing as mp

    jobs = folder / "jobs.json"
    jobs.write_text(json.dumps(cases))
    with socket.socket() as probe:  # a free loopback port for the group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_ranks_main, args=(2, port, str(jobs), str(folder)), nprocs=2, join=True)
    return {case["name"]: torch.load(folder / f"{case['name']}.pt", weights_only=False) for case in cases}


def _reference(case: dict) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """The same steps in this process, unsharded, on the whole batch."""
    batch = _case_batch(case)
    trainer = _trainer(case["raw"], {}, case.get("role", "actor"))
    results = _steps(trainer, batch)
    return results, trainer.weights()


def _differences(case: dict, sharded: dict) -> dict[str, float]:
    results, weights = _reference(case)
    diffs = {"loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(results, sharded["results"])),
             "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(results, sharded["results"])),
             "weights": max((weights[k] - sharded["weights"][k]).abs().max().item() for k in weights)}
    assert set(weights) == set(sharded["weights"])
    return diffs


def _lm_batch(model_path: str, folder: Path, name: str) -> str:
    """Generated rows with advantages, and (for a critic) values and returns on their responses."""
    spec = validate_spec(_raw(model_path))
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, model_path))
    gens = rollout.generate(PROMPTS, 3, spec.roles.rollout.sampling, seed=0)
    batch = collate(gens, torch.linspace(-1.0, 1.0, len(gens)), rollout.pad_token_id, rewards=[0.0] * len(gens),
                    values=[[0.1 * (i % 3)] * len(g.response_ids) for i, g in enumerate(gens)],
                    returns=[[0.5 - 0.1 * (i % 4)] * len(g.response_ids) for i, g in enumerate(gens)])
    path = folder / f"{name}-batch.pt"
    torch.save(batch, path)
    return str(path)


def _omni_batch(model_path: str, folder: Path) -> tuple[str, dict]:
    """A batch of image and audio rows generated by the hf rollout on tiny-omni (media as files)."""
    import random

    from relax.media import MediaSet, dumps_context
    from relax.runtime.worker.rows import rollout_columns
    from relax_plugins.datasets.omni import encode_media, omni_problem

    keys = {"image": "image", "audio": "audio"}
    raw = _raw(model_path, media=keys)
    spec = validate_spec(raw)
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, model_path))
    media = MediaSet.from_spec(spec, spill_dir=folder)
    prompts, refs = [], []
    for i, kind in enumerate(("image", "audio", "image", "audio")):
        problem = omni_problem(random.Random(f"fsdp:{kind}:{i}"), kind)
        data, suffix = encode_media(kind, problem["media"])
        file = folder / f"{kind}-{i}{suffix}"
        file.write_bytes(data)
        prompts.append(problem["prompt"])
        refs.append(media.refs({kind: str(file)}, i))
    gens = rollout.generate(prompts, 2, spec.roles.rollout.sampling, seed=5, media=refs)
    columns = rollout_columns(gens, prompts, ["x"] * len(prompts), rollout.pad_token_id,
                              [dumps_context(p, r) for p, r in zip(prompts, refs)])
    batch = TrainBatch.from_columns(columns, [0] * len(gens))
    batch = batch.with_fields(advantages=torch.linspace(-1.0, 1.0, len(gens)))
    path = folder / "omni-batch.pt"
    torch.save(batch, path)
    return str(path), raw


def _model(name: str, cache: Path, **options) -> str:
    cls = get_registry().load(PluginKind.models, name)
    return cls(cls.Config(**options)).materialize(str(cache))


def test_fsdp_matches_one_process_and_resumes_from_a_sharded_checkpoint(tiny_model_path, tmp_path):
    case = {"name": "lm", "raw": _raw(tiny_model_path), "batch": _lm_batch(tiny_model_path, tmp_path, "lm"),
            "checkpoint": True}
    sharded = _spawn([case], tmp_path)["lm"]
    diffs = _differences(case, sharded)
    print("fsdp lm max abs differences:", diffs)
    assert max(diffs.values()) < TOLERANCE, diffs
    # The resumed run's step 3 is the uninterrupted run's step 3.
    assert abs(sharded["resumed"]["loss"] - sharded["results"][-1]["loss"]) < TOLERANCE
    assert abs(sharded["resumed"]["grad_norm"] - sharded["results"][-1]["grad_norm"]) < TOLERANCE
    # The checkpoint's Hugging Face folder loads with transformers and gives the trainer's log-probs
    # (the weights after step 2: a replica trainer loaded from the same folder computes them).
    from transformers import AutoModelForCausalLM

    from relax.algo.batch import token_logprobs

    folder = tmp_path / "lm-ckpt"
    assert (folder / "sharded").is_dir() and (folder / "model.safetensors.index.json").is_file()
    batch = torch.load(case["batch"], weights_only=False)
    replica = _trainer(case["raw"], {})
    replica.load(str(folder))
    expected = replica.compute_logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
    got = token_logprobs(logits, batch.input_ids)
    mask = batch.response_mask.bool()
    assert (got[mask] - expected[mask]).abs().max().item() < 1e-5
    # And it is the sharded run's step-2 weights, not the initial ones.
    initial = _trainer(case["raw"], {}).compute_logprobs(batch)
    assert (initial[mask] - expected[mask]).abs().max().item() > 1e-4


@pytest.mark.fsdp
def test_fsdp_matrix_moe_omni_checkpointing_offload(tiny_model_path, tmp_path):
    moe = _model("tiny-lm", tmp_path / "cache", architecture="qwen3_moe", warmup_steps=0)
    omni = _model("tiny-omni", tmp_path / "cache", warmup_steps=0, warmup_pool=3)
    omni_batch, omni_raw = _omni_batch(omni, tmp_path)
    lm_batch = _lm_batch(tiny_model_path, tmp_path, "lm")
    cases = [
        {"name": "moe", "raw": _raw(moe), "batch": _lm_batch(moe, tmp_path, "moe")},
        {"name": "omni", "raw": omni_raw, "batch": omni_batch},
        {"name": "checkpointing", "raw": _raw(tiny_model_path), "batch": lm_batch,
         "fsdp": {"activation_checkpointing": True}},
        {"name": "offload", "raw": _raw(tiny_model_path), "batch": lm_batch, "fsdp": {"cpu_offload": True}},
        {"name": "whole-model-unit", "raw": _raw(tiny_model_path), "batch": lm_batch, "fsdp": {"shard_unit": "model"}},
        # 9 rows: 5 and 4 per rank, so 3 micro-batches of 2 rows against 2 (the lockstep's repeat)
        {"name": "uneven", "raw": _raw(tiny_model_path), "batch": lm_batch, "rows": 9},
        {"name": "critic", "raw": _raw(tiny_model_path, ppo=True), "batch": lm_batch, "role": "critic"},
    ]
    # A forward-only role: log-probs as an unsharded one computes them, before and after following
    # the weights of a trained replica.
    replica = _trainer(_raw(tiny_model_path), {})
    replica.train_step(torch.load(lm_batch, weights_only=False))
    torch.save(replica.weights(), tmp_path / "follow.pt")
    forward = {"name": "reference", "raw": _raw(tiny_model_path, ppo=True), "batch": lm_batch, "role": "reference",
               "follow": str(tmp_path / "follow.pt")}
    sharded = _spawn([*cases, forward], tmp_path)
    figures = {case["name"]: _differences(case, sharded[case["name"]]) for case in cases}
    reference = _trainer(forward["raw"], {}, "reference")
    batch = torch.load(lm_batch, weights_only=False)
    mask = batch.response_mask.bool()
    before, after = (torch.zeros_like(batch.rollout_logprobs) for _ in range(2))
    for part, got in zip((before, after), sharded["reference"]["logprobs"]):
        part[0::2] = got  # rank 0's rows (rank 0 writes its shard's log-probs)
    expected_before = reference.compute_logprobs(batch)
    reference.load_weights(torch.load(forward["follow"], weights_only=False), 1)
    expected_after = reference.compute_logprobs(batch)
    rows = mask[0::2]
    figures["reference"] = {
        "logprobs": (before[0::2][rows] - expected_before[0::2][rows]).abs().max().item(),
        "logprobs_after_follow": (after[0::2][rows] - expected_after[0::2][rows]).abs().max().item()}
    assert (expected_after[mask] - expected_before[mask]).abs().max().item() > 1e-4  # following moved them
    print("fsdp max abs differences:", json.dumps(figures, indent=1))
    for name, diffs in figures.items():
        assert max(diffs.values()) < TOLERANCE, (name, diffs)
