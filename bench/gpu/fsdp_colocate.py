"""A ~1.2B Qwen3-shaped model trained colocated on one GPU: FSDP2 torch trainer and hf rollout in one
process, tokens/s and peak memory per phase against ``relax plan``'s estimate.

Run on a machine with an NVIDIA GPU (the device tool's; nothing is downloaded)::

    python bench/gpu/fsdp_colocate.py            # figures go to $OUT (or --out)
    python bench/gpu/fsdp_colocate.py --tiny     # on CPU, a 2-layer model: checks the script works

What it does:

1. Builds a Qwen3 model from a config (``--layers`` decoder layers of width 2048, 16 query and 8
   key/value heads of 128, MLP 6144: 24 layers are 1.2B parameters) with random weights, in
   bfloat16, with the built-in ``tiny-lm``'s tokenizer (trained locally), into a local folder.
2. Plans the run (``relax.plan.make_plan``): the colocated GPU's memory in the generate and train
   phases, from the model's ``config.json``, the actor's ``fsdp`` options (FSDP2, bf16 mixed
   precision), gradient checkpointing and ``max_tokens_per_micro_batch``.
3. Runs ``--steps`` GRPO-shaped steps in this process, as a colocated worker does: the ``hf``
   rollout generates (random weights ramble to ``max_new_tokens``), the rollout's weights go to the
   host (its sleep) while the ``torch`` trainer (FSDP2) takes a step on the batch (rewards drawn at
   random, normalized per prompt, so the loss has a gradient), then the rollout wakes and takes the
   new weights from the trainer's extractor.
4. Records generated tokens/s, train-step tokens/s (real tokens of the batch over the step time),
   ``train/pad_frac``, and the peak of ``torch.cuda.max_memory_allocated`` in each phase (steps
   after the first, once the optimizer state exists), against the plan's figure for that phase:
   ``estimate / measured`` should lie within 0.75-1.25 (docs/backends.md keeps the figures). The
   plan counts the FSDP2 shards, gradients and Adam state in the model's dtype, as the trainer
   holds them (``relax.plan.memory.fsdp_state_bytes``).

Writes ``fsdp_colocate.json`` (every figure) under the output folder and prints a summary. With
``--tiny`` it runs on CPU (float32, no mixed precision) and checks the steps run; memory is not
measured there (no CUDA allocator).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GIB = 1024**3


def build_model(folder: Path, layers: int, tiny: bool) -> tuple[str, int]:
    """A random-weight Qwen3 folder with the tiny-lm tokenizer; (path, parameter count)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from relax.contracts import PluginKind
    from relax.registry import get_registry
    from relax.runtime.model_files import cache_dir

    registry = get_registry()
    tiny_lm = registry.load(PluginKind.models, "tiny-lm")
    source = Path(tiny_lm(tiny_lm.Config()).materialize(cache_dir()))
    tokenizer = AutoTokenizer.from_pretrained(source)
    width = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16) if tiny else \
        dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    config = Qwen3Config(vocab_size=len(tokenizer), num_hidden_layers=layers, max_position_embeddings=4096,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **width)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copy(source / name, folder / name)
    count = sum(p.numel() for p in model.parameters())
    del model
    return str(folder), count


def run_spec(path: str, args: argparse.Namespace, gpu_gib: float, lora: dict[str, Any] | None = None) -> Any:
    """The bench's run spec; ``lora``: the actor's ``lora`` block (bench/gpu/lora_arms.py's LoRA arm)."""
    from relax.spec import validate_spec

    gpu = 0 if args.tiny else 1
    raw = {
        "name": "fsdp-colocate-bench",
        "model": {"path": path, "modalities": ["text"], "dtype": "float32" if args.tiny else "bfloat16"},
        "data": {"train": {"source": "synthetic:arithmetic", "options": {"size": 4096}}, "max_prompt_tokens": 16},
        "algorithm": {"name": "grpo", "samples_per_prompt": args.samples, "prompts_per_step": args.prompts},
        "rewards": [{"name": "exact_match"}],
        "roles": {
            "rollout": {"backend": "hf", "replicas": 1, "gpus_per_replica": gpu,
                        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens}},
            "actor": {"backend": "torch", "gpus": gpu, "gradient_checkpointing": True,
                      "max_tokens_per_micro_batch": args.budget,
                      "optimizer": {"name": "adamw", "lr": 1e-6},
                      "options": {"fsdp": {"enabled": True, "mixed_precision": "off" if args.tiny else "bf16"},
                                  "packed_attention": args.packed_attention}},
        },
        "cluster": {"nodes": 1, "gpus_per_node": gpu, "cpus_per_node": 16, "gpu_memory_gb": gpu_gib},
        "placement": {"mode": "colocate"},
        "async_policy": {"max_staleness": 0, "correction": "none"},
        "trainer": {"steps": args.steps, "checkpoint_every": 0},
        "tracing": {"exporter": "none"},
    }
    if lora is not None:
        raw["roles"]["actor"]["lora"] = lora
    return validate_spec(raw, base_dir=Path.cwd())


def planned_phases(spec: Any) -> dict[str, float]:
    """The plan's GiB per phase on the colocated GPU (the host's figure on CPU)."""
    from relax.plan import make_plan

    plan = make_plan(spec, base_dir=Path.cwd(), check_memory=False, remedies=False)
    device = next(d for d in plan.memory if "actor" in d.roles)
    return dict(device.phases)


def size_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's and the batch's sizes, shared by the GPU scripts that build this model."""
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU: check the script runs")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: 1.2B parameters)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--budget", type=int, default=16384, help="max_tokens_per_micro_batch")
    parser.add_argument("--packed-attention", default="auto", choices=["auto", "dense", "flex"],
                        help="the torch trainer's packed_attention (auto: flex on CUDA)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-out", help="folder for the figures")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(parser)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.steps, args.prompts, args.samples = 2, 2, 4, 2
        args.max_new_tokens, args.budget = 8, 64
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench/gpu/fsdp_colocate.py: no NVIDIA GPU here; run it with --tiny on CPU")
        return 2
    device = "cuda" if cuda else "cpu"
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 80.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from relax.algo.batch import collate
    from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
    from relax.registry import get_registry
    from relax_plugins.datasets.arithmetic import ArithmeticDataset

    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path, params = build_model(Path(tmp) / "model", args.layers, args.tiny)
        figures["params"] = params
        figures["build_s"] = round(time.perf_counter() - started, 1)
        spec = run_spec(path, args, round(gpu_gib, 1))
        figures["plan_gib"] = planned_phases(spec)
        registry = get_registry()
        rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                                 rollout_context(spec, path, device=device))
        loss_cls = registry.load("losses", "ppo_clip")
        loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
        trainer = registry.load("trainer", "torch")(
            registry.build_config("trainer", "torch", spec.roles.actor.options),
            trainer_context(spec, "actor", path, device=device, loss=loss))
        data = ArithmeticDataset(ArithmeticDataset.Config(size=4096))
        steps = []
        for step in range(args.steps):
            prompts = [data[step * args.prompts + i]["prompt"] for i in range(args.prompts)]
            record: dict[str, Any] = {"step": step}
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            gens = rollout.generate(prompts, args.samples, spec.roles.rollout.sampling, seed=step)
            if cuda:
                torch.cuda.synchronize()
                record["generate_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            record["generate_s"] = time.perf_counter() - t0
            record["generated_tokens"] = sum(len(g.response_ids) for g in gens)
            rewards = torch.rand(len(gens), generator=torch.Generator().manual_seed(step)).view(args.prompts, -1)
            advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
            batch = collate(gens, advantages, rollout.pad_token_id, rewards=rewards.view(-1).tolist())
            rollout.model.to("cpu")  # the rollout sleeps while the trainer steps
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            metrics = trainer.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
                record["train_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            record["train_s"] = time.perf_counter() - t0
            record["train_tokens"] = int(batch.attention_mask.sum())
            record.update({k: metrics[k] for k in ("loss", "grad_norm", "pad_frac")})
            t0 = time.perf_counter()
            rollout.model.to(device)  # wakes and takes the new weights
            rollout.load_weights(trainer.weights(), version=trainer.version)
            record["sync_s"] = time.perf_counter() - t0
            steps.append(record)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), flush=True)
    figures["steps"] = steps
    steady = steps[1:] or steps
    figures["generate_tokens_per_s"] = sum(s["generated_tokens"] for s in steady) / sum(s["generate_s"] for s in steady)
    figures["train_tokens_per_s"] = sum(s["train_tokens"] for s in steady) / sum(s["train_s"] for s in steady)
    figures["pad_frac"] = sum(s["pad_frac"] for s in steady) / len(steady)
    summary = (f"{figures['device']}: {params / 1e9:.2f}B params, generate {figures['generate_tokens_per_s']:.0f} "
               f"tokens/s, train {figures['train_tokens_per_s']:.0f} tokens/s, pad_frac {figures['pad_frac']:.3f}")
    within = True
    if cuda:
        for phase in ("generate", "train"):
            measured = max(s[f"{phase}_peak_gib"] for s in steady)
            planned = figures["plan_gib"][phase]
            ratio = planned / measured
            figures[f"{phase}_peak_gib"], figures[f"{phase}_plan_over_measured"] = measured, ratio
            within &= 0.75 <= ratio <= 1.25
            summary += f"; {phase} peak {measured:.2f} GiB, plan {planned:.2f} GiB (x{ratio:.2f})"
        figures["plan_within_25pct"] = within
    else:
        summary += f"; plan {figures['plan_gib']} (memory not measured on CPU)"
    (out / "fsdp_colocate.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(summary)
    print(f"figures: {out / 'fsdp_colocate.json'}")
    return 0 if within else 1


if __name__ == "__main__":
    raise SystemExit(main())
