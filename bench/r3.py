"""Rollout routing replay (R3) on the tiny Qwen3-MoE: the rollout-trainer mismatch with and without
it, and what it costs per step.

Two arms train side by side in one process from the same built model, data and seeds, a step of
each in turn (which arm goes first alternates, so a slow moment of the machine falls on both):
``off`` lets the trainer's router choose, ``r3`` records the hf rollout's routing and replays it in
the torch trainer. The rollout's weights lag the trainer's by ``--lag`` versions, as in an
asynchronous run (the tiny preset's ``async_policy.max_staleness: 1``; ``--lag 0`` is on-policy).
Each step, before the update, the trainer's log-probs of the step's samples (the ones the first
update's forward computes: same weights, same routing) are compared with the rollout's: what the
loss's importance ratio sees, the engines' numeric mismatch plus, with a lag, the policy's drift,
part of which is routing that changed between versions:

- ``mismatch/kl``: ``mean(r - 1 - log r)`` over response tokens, ``r = p_trainer / p_rollout``
  (the k3 estimate of KL(rollout || trainer));
- ``mismatch/abs``: ``mean |log p_trainer - log p_rollout|``;
- ``routing changed`` (r3 arm only, where the rollout records): share of (token, layer) routings
  the trainer's router would pick differently from the rollout's: what the off arm suffers and
  R3 removes (with R3 the update uses the rollout's);

and each arm's step time (generate + update + weight push; the measurement itself is left out)
gives R3's overhead as a ratio. Step time is this process's CPU time, not wall time: on a shared
machine wall time swings by several times from step to step with the neighbours' load. The arms start equal and drift apart as they train, so the
mismatch columns compare like with like only in distribution, not sample by sample.

    python bench/r3.py                       # float32, lag 1, 12 steps of 16 prompts x 8 samples
    python bench/r3.py --lag 0 --dtype bfloat16

On CPU the hf rollout and the torch trainer compute a token's forward pass almost identically
(the KV-cached decode and the full forward differ at round-off), so with ``--lag 0`` the router
flips almost never and both arms' mismatch is round-off; the lag is where routing changes here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from relax.algo.batch import TrainBatch  # noqa: E402
from relax.config import load_spec_dict  # noqa: E402
from relax.contracts import RewardSample  # noqa: E402
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context  # noqa: E402
from relax.registry import get_registry  # noqa: E402
from relax.roles import Column  # noqa: E402
from relax.runtime.model_files import materialize_model  # noqa: E402
from relax.runtime.worker.rows import rollout_columns  # noqa: E402
from relax.spec import validate_spec  # noqa: E402
from relax.spec.rules import advantage_and_loss  # noqa: E402


def build_arm(mode: str, args: argparse.Namespace, path: str | None) -> dict:
    raw, base = load_spec_dict("tiny-cpu", [
        "model.options.architecture=qwen3_moe", f"model.dtype={args.dtype}", f"algorithm.router_replay={mode}",
        f"algorithm.prompts_per_step={args.prompts}", f"algorithm.samples_per_prompt={args.samples}",
        f"roles.actor.micro_batch_size={args.prompts * args.samples}", f"roles.actor.optimizer.lr={args.lr}",
        "tracing.exporter=none"])
    spec = validate_spec(raw, base_dir=base)
    path = path or materialize_model(spec, base)
    registry = get_registry()
    advantage, loss = advantage_and_loss(spec)
    algo = algorithm_context(spec)
    loss_plugin = registry.load("losses", loss)(registry.build_config("losses", loss, spec.algorithm.loss_options), algo)
    return {
        "mode": mode, "spec": spec, "path": path,
        "rollout": registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                                  rollout_context(spec, path)),
        "trainer": registry.load("trainer", "torch")(registry.build_config("trainer", "torch", {}),
                                                     trainer_context(spec, "actor", path, loss=loss_plugin)),
        "advantage": registry.load("advantages", advantage)(
            registry.build_config("advantages", advantage, spec.algorithm.advantage_options), algo),
        "reward": registry.load("rewards", "exact_match")(registry.build_config("rewards", "exact_match", {})),
        "rows": [],
    }


def own_changed(trainer, batch: TrainBatch) -> float:
    """Share of the rollout's (token, layer) expert sets the trainer's router picks differently."""
    own = trainer.own_routing(batch).long().sort(dim=-1).values
    recorded = batch.routed_experts.long().sort(dim=-1).values
    mask = batch.response_mask.bool()
    return float((own[mask] != recorded[mask]).any(dim=-1).float().mean())


def step(arm: dict, items: list[dict], seed: int, lag: int) -> None:
    rollout, trainer, spec = arm["rollout"], arm["trainer"], arm["spec"]
    prompts = [item["prompt"] for item in items]
    labels = [item["answer"] for item in items]
    t0 = time.process_time()
    gens = rollout.generate(prompts, spec.algorithm.samples_per_prompt, spec.roles.rollout.sampling, seed)
    t1 = time.process_time()
    rewards = arm["reward"].score([RewardSample(prompts[g.prompt_index], g.text, labels[g.prompt_index]) for g in gens])
    groups = torch.tensor([g.prompt_index for g in gens])
    columns = rollout_columns(gens, prompts, labels, rollout.pad_token_id)
    columns[Column.advantages] = torch.as_tensor(arm["advantage"].compute(torch.as_tensor(rewards, dtype=torch.float32),
                                                                          groups), dtype=torch.float32)
    batch = TrainBatch.from_columns(columns, [trainer.version] * len(gens))
    t2 = time.process_time()
    # The measurement (not timed): the first update's log-probs, before it changes the weights.
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    delta = (logprobs - batch.rollout_logprobs)[mask].double()
    changed = own_changed(trainer, batch) if batch.routed_experts is not None else float("nan")
    t3 = time.process_time()
    metrics = trainer.train_step(batch)
    history = arm.setdefault("history", [])  # the weights of the last lag + 1 versions
    history.append((trainer.version, trainer.weights()))
    del history[:-(lag + 1)]
    version, weights = history[0]
    if version == trainer.version - lag:  # else the rollout keeps the initial weights a while longer
        rollout.load_weights(weights, version)
    t4 = time.process_time()
    arm["rows"].append({
        "kl": float((delta.exp() - 1 - delta).mean()), "abs": float(delta.abs().mean()),
        "max_abs": float(delta.abs().max()), "changed": changed,
        "replay_changed": metrics.get("router_replay/changed", float("nan")),
        "reward": float(torch.as_tensor(rewards).float().mean()),
        "step_s": (t1 - t0) + (t2 - t1) + (t4 - t3)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lag", type=int, default=1, help="versions the rollout's weights lag the trainer's")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    off = build_arm("off", args, None)
    r3 = build_arm("r3", args, off["path"])
    dataset = get_registry().load("datasets", "synthetic:arithmetic")
    data = dataset(dataset.Config(**off["spec"].data.train.options))
    for s in range(args.steps):
        items = [data[(s * args.prompts + i) % len(data)] for i in range(args.prompts)]
        for arm in ((off, r3) if s % 2 == 0 else (r3, off)):
            step(arm, items, seed=1000 + s, lag=args.lag)
        a, b = off["rows"][-1], r3["rows"][-1]
        print(f"step {s + 1}: kl off {a['kl']:.3e} r3 {b['kl']:.3e} | abs off {a['abs']:.3e} r3 {b['abs']:.3e} | "
              f"routing changed off {a['changed']:.3f} r3 {b['changed']:.3f} | step_s off {a['step_s']:.2f} "
              f"r3 {b['step_s']:.2f}", flush=True)
    print(f"\n{args.dtype}, lag {args.lag}, lr {args.lr}, {args.steps} steps of {args.prompts} prompts x "
          f"{args.samples} samples, tiny Qwen3-MoE (4 experts, top-2, 2 layers)")
    print(f"{'':22}{'off':>12}{'r3':>12}")
    for key, label in (("kl", "mismatch/kl (k3)"), ("abs", "mismatch/abs"), ("max_abs", "mismatch/max_abs"),
                       ("changed", "routing changed"), ("reward", "reward/mean")):
        print(f"{label:22}{statistics.mean(r[key] for r in off['rows']):>12.3e}"
              f"{statistics.mean(r[key] for r in r3['rows']):>12.3e}")
    # Step time: the median per arm (the first step of each warms caches up and is left out).
    times = {arm["mode"]: statistics.median(r["step_s"] for r in arm["rows"][1:] or arm["rows"]) for arm in (off, r3)}
    print(f"{'step CPU s (median)':22}{times['off']:>12.3f}{times['r3']:>12.3f}")
    print(f"R3 step-time overhead: x{times['r3'] / times['off']:.3f} (recording in generate, the routed-experts "
          "column, replay in the update)")


if __name__ == "__main__":
    main()
