"""Does the tiny model learn? A plain synchronous GRPO loop over the built-in plugins (no Ray).

    python bench/learn_tiny.py [--steps 60] [--cache-dir ~/.cache/relax] [--threads 1] [key=value ...]

Every component is loaded by name through the plugin registry, exactly as the runtime does:
``builtin:tiny-lm`` is materialized, prompts come from ``synthetic:arithmetic``, the ``hf`` rollout
samples ``prompts_per_step x samples_per_prompt`` responses, ``exact_match`` scores them, ``grpo``
turns rewards into advantages and the ``torch`` trainer takes a ``ppo_clip`` step, whose weights
are then pushed into the rollout. Each step prints the mean reward and the time spent generating,
scoring, training and syncing weights.

The per-step pieces (``sample_prompts``, ``generate``, ``score``, ``compute_advantages``,
``make_batch``, ``train``, ``sync_weights``) are plain functions over plugin objects, so a
distributed runtime can call the same pieces from its role workers. ``key=value`` arguments
override the run spec by dotted path (``roles.actor.optimizer.lr=0.002``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.contracts import Generation, RewardSample
from relax.runtime.model_files import CACHE_ENV, materialize_model
from relax.runtime.worker.components import (
    build_advantage,
    build_dataset,
    build_rewards,
    build_rollout,
    build_trainer,
)
from relax.runtime.worker.data import PromptSchedule
from relax.runtime.worker.scoring import RewardScorer
from relax.spec import validate_spec
from relax.spec.models import RunSpec

#: The bench's run spec: the tiny CPU default (presets/tiny-cpu.yaml) run synchronously, with a
#: learning rate of 5e-4 (1e-3 learns too, but less steadily: the reward can dip for tens of steps).
BENCH_SPEC: dict[str, Any] = {
    "name": "learn-tiny",
    "seed": 0,
    "model": {"path": "builtin:tiny-lm", "dtype": "float32"},
    "data": {"train": {"source": "synthetic:arithmetic", "options": {"size": 4096}}},
    "algorithm": {"name": "grpo", "samples_per_prompt": 8, "prompts_per_step": 16,
                  "clip": {"low": 0.2, "high": 0.28}},
    "rewards": [{"name": "exact_match", "weight": 1.0}],
    "roles": {
        "rollout": {"backend": "hf", "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}},
        "actor": {"backend": "torch", "micro_batch_size": 128,
                  "optimizer": {"name": "adamw", "lr": 5.0e-4}},
    },
    "placement": {"mode": "colocate"},
    "async_policy": {"max_staleness": 0, "correction": "tis"},
    "trainer": {"steps": 60},
    "tracing": {"exporter": "none"},
}


# -- building the pieces ---------------------------------------------------------------------------


@dataclass
class Components:
    """Everything one synchronous loop needs, built from a run spec through the registry."""

    spec: RunSpec
    model_path: str
    dataset: Any
    rollout: Any
    trainer: Any
    rewards: RewardScorer
    advantage: Any
    pad_token_id: int


def build_components(spec: RunSpec, cache_dir: str) -> Components:
    """Materialize the model and build every plugin of the loop from the spec, as the runtime does."""
    os.environ[CACHE_ENV] = cache_dir
    here = Path.cwd()
    model_path = materialize_model(spec, here)
    rollout = build_rollout(spec, model_path, threads=None)
    return Components(spec=spec, model_path=model_path, dataset=build_dataset(spec, here), rollout=rollout,
                      trainer=build_trainer(spec, model_path, threads=None), rewards=build_rewards(spec),
                      advantage=build_advantage(spec), pad_token_id=int(rollout.pad_token_id))


# -- the per-step pieces ---------------------------------------------------------------------------


def sample_prompts(dataset: Any, spec: RunSpec, step: int) -> list[dict[str, Any]]:
    """The rows of training step ``step``, in the runtime's order (a pure function of seed and step)."""
    schedule = PromptSchedule(len(dataset), spec.algorithm.prompts_per_step, spec.seed, spec.data.shuffle)
    return [dataset[i] for i in schedule.indices(step)]


def generate(rollout: Any, rows: list[dict[str, Any]], spec: RunSpec, seed: int) -> list[Generation]:
    """``samples_per_prompt`` responses to each row's prompt."""
    prompts = [str(row[spec.data.prompt_key]) for row in rows]
    return rollout.generate(prompts, spec.algorithm.samples_per_prompt, spec.roles.rollout.sampling, seed)


def score(rewards: RewardScorer, rows: list[dict[str, Any]], generations: list[Generation],
          spec: RunSpec) -> list[float]:
    """The weighted sum of every reward plugin's score, per generation (the runtime's scorer)."""
    samples = [
        RewardSample(prompt=str(rows[g.prompt_index][spec.data.prompt_key]), response=g.text,
                     label=rows[g.prompt_index].get(spec.data.label_key))
        for g in generations
    ]
    return rewards.score(samples).totals


def compute_advantages(advantage: Any, rewards: list[float], generations: list[Generation]) -> Any:
    """One advantage per generation; the samples of one prompt form a group."""
    return advantage.compute(rewards, [g.prompt_index for g in generations])


def make_batch(generations: list[Generation], advantages: Any, rewards: list[float], pad_token_id: int,
               version: int) -> Any:
    """The padded training batch."""
    from relax.algo.batch import collate

    return collate(generations, advantages, pad_token_id, policy_version=version, rewards=rewards)


def train(trainer: Any, batch: Any) -> dict[str, float]:
    """One training step of the trainer backend."""
    return trainer.train_step(batch)


def sync_weights(trainer: Any, rollout: Any, version: int) -> None:
    """Push the trainer's full state dict into the rollout backend as policy ``version``."""
    rollout.load_weights(trainer.weights(), version)


# -- the loop --------------------------------------------------------------------------------------


def run(spec: RunSpec, cache_dir: str, steps: int, log: Any = print) -> list[dict[str, float]]:
    """The synchronous loop; returns one record per step (``elapsed_s`` counts from the start,
    including the model build; ``score_s`` covers rewards, advantages and collating the batch)."""
    start = time.perf_counter()
    parts = build_components(spec, cache_dir)
    build_s = time.perf_counter() - start
    log(f"model {parts.model_path} ready and plugins built in {build_s:.1f}s")
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        rows = sample_prompts(parts.dataset, spec, step)
        generations = generate(parts.rollout, rows, spec, seed=spec.seed * 1_000_003 + step)
        t1 = time.perf_counter()
        rewards = score(parts.rewards, rows, generations, spec)
        advantages = compute_advantages(parts.advantage, rewards, generations)
        batch = make_batch(generations, advantages, rewards, parts.pad_token_id, parts.rollout.version)
        t2 = time.perf_counter()
        metrics = train(parts.trainer, batch)
        t3 = time.perf_counter()
        sync_weights(parts.trainer, parts.rollout, parts.trainer.version)
        t4 = time.perf_counter()
        record = {
            "step": step,
            "reward": sum(rewards) / len(rewards),
            "response_tokens": batch.num_response_tokens / batch.batch_size,
            "generate_s": t1 - t0,
            "score_s": t2 - t1,
            "train_s": t3 - t2,
            "sync_s": t4 - t3,
            "elapsed_s": t4 - start,
            "build_s": build_s,
            **{k: metrics[k] for k in ("loss", "grad_norm", "clip_fraction", "approx_kl") if k in metrics},
        }
        history.append(record)
        log(f"step {step:3d}  reward {record['reward']:.3f}  gen {record['generate_s']:.3f}s  "
            f"score {record['score_s']:.3f}s  train {record['train_s']:.3f}s  sync {record['sync_s']:.4f}s  "
            f"kl {record.get('approx_kl', 0.0):.4f}  clip {record.get('clip_fraction', 0.0):.3f}  "
            f"len {record['response_tokens']:.2f}")
    return history


def _override(spec: dict[str, Any], dotted: str) -> None:
    key, _, raw = dotted.partition("=")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    node = spec
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: trainer.steps)")
    parser.add_argument("--cache-dir", default=os.environ.get("RELAX_CACHE", "~/.cache/relax"),
                        help="where built-in models are built and cached")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 is fastest for the tiny model, and steady on a busy machine)")
    parser.add_argument("--target", type=float, default=0.8, help="reward to report reaching")
    parser.add_argument("--json", type=Path, default=None, help="write the per-step records here")
    parser.add_argument("overrides", nargs="*", help="dotted.path=value overrides of the bench spec")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    raw = json.loads(json.dumps(BENCH_SPEC))
    for item in args.overrides:
        _override(raw, item)
    spec = validate_spec(raw)
    steps = args.steps or spec.trainer.steps
    history = run(spec, str(Path(args.cache_dir).expanduser()), steps)

    window = 5
    smooth = [sum(r["reward"] for r in history[max(0, i - window + 1):i + 1]) / min(window, i + 1)
              for i in range(len(history))]
    reached = next((i for i, value in enumerate(smooth) if value >= args.target), None)
    split = {k: sum(r[k] for r in history) / len(history) for k in ("generate_s", "score_s", "train_s", "sync_s")}
    build_s = history[0]["build_s"]
    print(f"initial reward {history[0]['reward']:.3f}; final reward {history[-1]['reward']:.3f} "
          f"(mean of last {window}: {smooth[-1]:.3f}) after {len(history)} steps, "
          f"{history[-1]['elapsed_s']:.1f}s in all ({build_s:.1f}s of it building the model and plugins)")
    if reached is not None:
        print(f"mean reward over {window} steps reached {args.target} at step {reached} "
              f"({history[reached]['elapsed_s']:.1f}s)")
    else:
        print(f"mean reward over {window} steps never reached {args.target}")
    print("mean seconds per step: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in split.items()))
    if args.json:
        args.json.write_text(json.dumps(history, indent=1))
    return 0 if reached is not None else 1


if __name__ == "__main__":
    sys.exit(main())
