"""Packed rows and token-budget micro-batches against padded rows, on the long tail, side by side.

The ``tiny-longtail-cpu`` preset's responses are mostly 3-5 tokens with a tenth rambling on for
24-48, so a padded batch (``relax.algo.batch``: every row as wide as the longest prompt plus the
longest response) is mostly padding. The torch trainer's packed rows (``relax.algo.packing``: no
padding, each prompt once for its samples) and token-budget micro-batches
(``roles.actor.max_tokens_per_micro_batch``, ``relax.algo.micro_batches``) compute only real
tokens. This bench generates real long-tail batches with the preset's model and ``hf`` rollout,
then times the actor's ``train_step`` on the same batches in three arms, alternating the arms'
order batch by batch so a slow moment of the machine falls on all of them:

- ``padded``: ``pack_sequences: false``, the preset's ``micro_batch_size`` rows;
- ``packed``: packed rows, the preset's ``micro_batch_size`` rows;
- ``packed+budget``: packed rows in micro-batches of at most ``--budget`` tokens.

Printed per arm: train-step tokens/s (real tokens, prompt and response, over the summed step
time), the mean ``train/pad_frac`` (share of the forward's token slots that held padding), and the
ratio of each arm's tokens/s over the padded arm's.

    python bench/packing.py                      # 6 batches per arm after one warm-up step each
    python bench/packing.py --batches 10 --budget 1024 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESET = "tiny-longtail-cpu"


def build(args: argparse.Namespace):
    """The preset's spec, its built model, and ``args.batches + 1`` collated long-tail batches."""
    import torch

    from relax.algo.batch import collate
    from relax.config import load_spec_dict
    from relax.plan.contexts import rollout_context
    from relax.registry import get_registry
    from relax.runtime.model_files import materialize_path
    from relax.spec import validate_spec
    from relax_plugins.datasets.arithmetic import ArithmeticDataset

    raw, base = load_spec_dict(PRESET, ["tracing.exporter=none"])
    spec = validate_spec(raw, base_dir=base)
    path = materialize_path(spec.model.path, spec.model.options, base)
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, path))
    algo = spec.algorithm
    data = ArithmeticDataset(ArithmeticDataset.Config(size=4096))
    batches = []
    for b in range(args.batches + 1):
        prompts = [data[b * algo.prompts_per_step + i]["prompt"] for i in range(algo.prompts_per_step)]
        gens = rollout.generate(prompts, algo.samples_per_prompt, spec.roles.rollout.sampling, seed=b)
        advantages = torch.randn(len(gens), generator=torch.Generator().manual_seed(b))
        batches.append(collate(gens, advantages, rollout.pad_token_id, rewards=[0.0] * len(gens)))
    return spec, path, batches


def trainer(spec, path: str, overrides: dict, options: dict):
    from relax.plan.contexts import algorithm_context, trainer_context
    from relax.registry import get_registry

    actor = spec.roles.actor.model_copy(update=overrides)
    spec = spec.model_copy(update={"roles": spec.roles.model_copy(update={"actor": actor})})
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", options),
                                             trainer_context(spec, "actor", path, loss=loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=6, help="timed batches per arm (after one warm-up)")
    parser.add_argument("--budget", type=int, default=1024, help="max_tokens_per_micro_batch of the budget arm")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    spec, path, batches = build(args)
    rows = spec.roles.actor.micro_batch_size
    arms = {
        "padded": trainer(spec, path, {}, {"pack_sequences": False}),
        "packed": trainer(spec, path, {}, {}),
        "packed+budget": trainer(spec, path, {"max_tokens_per_micro_batch": args.budget}, {}),
    }
    seconds = {name: 0.0 for name in arms}
    pad = {name: [] for name in arms}
    tokens = 0
    for i, batch in enumerate(batches):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for name in order:
            started = time.perf_counter()
            metrics = arms[name].train_step(batch)
            elapsed = time.perf_counter() - started
            if i > 0:  # the first batch warms up (and checks packing once)
                seconds[name] += elapsed
                pad[name].append(metrics["pad_frac"])
        if i > 0:
            tokens += int(batch.attention_mask.sum())
    lengths = [int(n) for b in batches[1:] for n in b.attention_mask.sum(dim=1)]
    print(f"{PRESET}: {len(batches) - 1} batches of {batches[0].batch_size} samples, {tokens} real tokens; "
          f"row lengths median {statistics.median(lengths)}, max {max(lengths)}; micro_batch_size {rows}, "
          f"budget {args.budget} tokens; {args.threads} thread(s)")
    base = tokens / seconds["padded"]
    for name in arms:
        rate = tokens / seconds[name]
        print(f"  {name:14s} {rate:9.0f} tokens/s   train/pad_frac {statistics.mean(pad[name]):.3f}   "
              f"x{rate / base:.2f} of padded")


if __name__ == "__main__":
    main()
