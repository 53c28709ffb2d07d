"""LoRA against full weights on one GPU: the same locally built model trained on the same batch by
the torch trainer, once on all its weights and once with ``roles.actor.lora``; the peak memory and
the step time of each arm, side by side (issue 41's GPU arm).

Run on a machine with an NVIDIA GPU (the device tool's; nothing is downloaded)::

    python bench/gpu/lora_arms.py            # figures go to $OUT (or --out)
    python bench/gpu/lora_arms.py --tiny     # on CPU, a 2-layer model: checks the script, prints both arms

What it does:

1. Builds the Qwen3-shaped model of ``bench/gpu/fsdp_colocate.py`` (``--layers`` layers of width
   2048: 24 layers are 1.2B parameters; random weights, bf16, the tiny-lm tokenizer) into a local
   folder, and has the ``hf`` rollout generate one GRPO-shaped batch with it (``--prompts`` x
   ``--samples``, ``--max-new-tokens``; rewards drawn at random, normalized per prompt), saved.
2. Runs each arm in a fresh process (``full``, then ``lora``), so one arm's allocations cannot
   raise the other's peak: the same spec as fsdp_colocate (FSDP2 with bf16 mixed precision,
   gradient checkpointing, ``max_tokens_per_micro_batch``), the ``lora`` arm adding
   ``roles.actor.lora`` (``--rank``, alpha twice the rank, ``all-linear``). It takes ``--steps``
   train steps on the saved batch, then extracts the weights a sync moves (``trainer.weights()``:
   the whole model, or the adapter).
3. Records per arm, over the steps after the first (the optimizer state exists from then on): the
   peak of ``torch.cuda.max_memory_allocated`` in a step, the median step time, tokens/s, the
   trainable parameters, the bytes and seconds of one weight extraction, and the plan's training
   memory for the arm (``relax.plan``, its ``train`` phase on the colocated GPU) beside the
   measured peak. Then the ratios ``lora / full`` of peak memory, step time and sync bytes.

Writes ``lora_arms.json`` (every figure) under the output folder and prints one line per arm and
the ratios. With ``--tiny`` it runs on CPU (float32, no mixed precision): the memory figure is then
the arm process's peak resident set (``ru_maxrss``), which includes the interpreter and libraries,
not a GPU allocator's peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.fsdp_colocate import GIB, build_model, planned_phases, run_spec, size_arguments  # noqa: E402

ARMS = ("full", "lora")


def lora_block(args: argparse.Namespace) -> dict[str, Any]:
    return {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": "all-linear"}


def make_batch(path: str, args: argparse.Namespace, device: str, file: Path) -> dict[str, Any]:
    """Generate the batch both arms train on with the hf rollout; save it to ``file``."""
    import torch

    from relax.algo.batch import collate
    from relax.plan.contexts import rollout_context
    from relax.registry import get_registry
    from relax_plugins.datasets.arithmetic import ArithmeticDataset

    spec = run_spec(path, args, 80.0)
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, path, device=device))
    data = ArithmeticDataset(ArithmeticDataset.Config(size=4096))
    prompts = [data[i]["prompt"] for i in range(args.prompts)]
    t0 = time.perf_counter()
    gens = rollout.generate(prompts, args.samples, spec.roles.rollout.sampling, seed=0)
    generate_s = time.perf_counter() - t0
    rewards = torch.rand(len(gens), generator=torch.Generator().manual_seed(0)).view(args.prompts, -1)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    batch = collate(gens, advantages, rollout.pad_token_id, rewards=rewards.view(-1).tolist())
    torch.save(batch, file)
    return {"rows": batch.batch_size, "tokens": int(batch.attention_mask.sum()),
            "generated_tokens": sum(len(g.response_ids) for g in gens), "generate_s": round(generate_s, 2)}


def run_arm(arm: str, path: str, batch_file: str, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """One arm in this process: its steps on the saved batch, then one weight extraction."""
    import resource

    import torch

    from relax.plan.contexts import algorithm_context, trainer_context
    from relax.registry import get_registry

    device = "cuda" if cuda else "cpu"
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 80.0
    spec = run_spec(path, args, round(gpu_gib, 1), lora=lora_block(args) if arm == "lora" else None)
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    trainer = registry.load("trainer", "torch")(
        registry.build_config("trainer", "torch", spec.roles.actor.options),
        trainer_context(spec, "actor", path, device=device, loss=loss))
    batch = torch.load(batch_file, weights_only=False)
    tokens = int(batch.attention_mask.sum())
    steps = []
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        record = {"step": step, "train_s": time.perf_counter() - t0, "loss": metrics["loss"],
                  "grad_norm": metrics["grad_norm"]}
        if cuda:
            record["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        steps.append(record)
        print(json.dumps({"arm": arm, **{k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}}),
              flush=True)
    t0 = time.perf_counter()
    weights = trainer.weights()
    sync_s = time.perf_counter() - t0
    steady = steps[1:] or steps
    step_s = statistics.median(s["train_s"] for s in steady)
    figures: dict[str, Any] = {
        "arm": arm, "steps": steps, "step_s": step_s, "train_tokens_per_s": tokens / step_s,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "sync_bytes": sum(t.numel() * t.element_size() for t in weights.values()), "sync_s": sync_s,
        "plan_train_gib": planned_phases(spec)["train"],
    }
    if cuda:
        figures["peak_gib"] = max(s["peak_gib"] for s in steady)
        figures["plan_over_measured"] = figures["plan_train_gib"] / figures["peak_gib"]
    else:  # no CUDA allocator: the arm process's peak resident set (Linux reports KiB)
        figures["host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    return figures


def arm_command(arm: str, path: str, batch_file: Path, result: Path) -> list[str]:
    """This script again, as one arm in a fresh process (``sys.argv`` carries the sizes)."""
    return [sys.executable, __file__, *sys.argv[1:], "--arm", arm, "--model", path, "--batch", str(batch_file),
            "--result", str(result)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(parser)
    parser.add_argument("--rank", type=int, default=64, help="the LoRA arm's rank (alpha is twice it)")
    # One arm (the parent runs each in a process of its own):
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.steps, args.prompts, args.samples = 2, 3, 4, 2
        args.max_new_tokens, args.budget, args.rank = 8, 64, 4
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench/gpu/lora_arms.py: no NVIDIA GPU here; run it with --tiny on CPU")
        return 2
    if args.arm is not None:
        figures = run_arm(args.arm, args.model, args.batch, args, cuda)
        Path(args.result).write_text(json.dumps(figures))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        path, params = build_model(Path(tmp) / "model", args.layers, args.tiny)
        figures["params"] = params
        figures["batch"] = make_batch(path, args, "cuda" if cuda else "cpu", Path(tmp) / "batch.pt")
        if cuda:
            torch.cuda.empty_cache()
        for arm in ARMS:
            result = Path(tmp) / f"{arm}.json"
            done = subprocess.run(arm_command(arm, path, Path(tmp) / "batch.pt", result), check=False)
            if done.returncode != 0:
                print(f"bench/gpu/lora_arms.py: the {arm} arm failed (status {done.returncode})")
                return 1
            figures[arm] = json.loads(result.read_text())
    full, lora = figures["full"], figures["lora"]
    memory = "peak_gib" if cuda else "host_peak_rss_gib"
    figures["lora_over_full"] = {"memory": lora[memory] / full[memory], "step_s": lora["step_s"] / full["step_s"],
                                 "sync_bytes": lora["sync_bytes"] / full["sync_bytes"],
                                 "trainable_params": lora["trainable_params"] / full["trainable_params"]}
    (out / "lora_arms.json").write_text(json.dumps(figures, indent=2) + "\n")
    what = "GPU peak" if cuda else "host peak RSS"
    print(f"{figures['device']}: {params:,} parameters, batch {figures['batch']['rows']} rows "
          f"{figures['batch']['tokens']} tokens, LoRA rank {args.rank}")
    for arm in ARMS:
        f = figures[arm]
        plan = f" (plan {f['plan_train_gib']:.2f} GiB, x{f['plan_over_measured']:.2f})" if cuda else ""
        print(f"  {arm:4s}: {what} {f[memory]:.2f} GiB{plan}, step {f['step_s']:.3f} s "
              f"({f['train_tokens_per_s']:.0f} tokens/s), trainable {f['trainable_params']:,}, "
              f"sync {f['sync_bytes']:,} bytes in {f['sync_s']:.3f} s")
    ratio = figures["lora_over_full"]
    print(f"  lora / full: memory x{ratio['memory']:.3f}, step time x{ratio['step_s']:.3f}, "
          f"sync bytes x{ratio['sync_bytes']:.4f}")
    print(f"figures: {out / 'lora_arms.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
