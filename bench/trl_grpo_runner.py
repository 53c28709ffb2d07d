"""TRL's side of ``bench/vs_trl.py``: one GRPOTrainer run on the bench's model folder and data file.

    <trl-venv>/bin/python bench/trl_grpo_runner.py --model DIR --data FILE --out RESULT.json ...

Runs only in the bench's own TRL virtualenv (``vs_trl.py`` makes it and starts this script there);
the project never imports TRL. It is what a user would write: ``GRPOTrainer`` on a model path, a
string-prompt data set, a reward function, a ``GRPOConfig`` holding the bench's work (16 prompts x
8 samples in one optimizer update a step, 8 new tokens, temperature 1.0, lr 1e-4, beta 0) and TRL's
defaults for the rest, on CPU, without vLLM, evaluation, saving or reporting. ``--matched`` turns
off the three defaults that make the run differ from Relax's: bf16 autocast and gradient
checkpointing (Relax's torch trainer computes in float32 and does not recompute activations) and the
linearly decaying learning rate (Relax's is constant).

The reward is Relax's own ``exact_match`` plugin, so both sides score alike. It writes
``{"step_end_s": [...], "first_step_end_wall": t, "step_reward": [...]}`` to ``--out``: the
``time.perf_counter()`` of every optimizer step's end (a ``TrainerCallback.on_step_end``), the wall
clock (``time.time()``) of the first one, and the mean reward of each step's batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the HF model folder")
    parser.add_argument("--data", required=True, help="JSON lines with 'prompt' and 'answer'")
    parser.add_argument("--out", required=True, type=Path, help="where the step clock and rewards go (JSON)")
    parser.add_argument("--output-dir", required=True, help="the trainer's output_dir (nothing is saved there)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matched", action="store_true",
                        help="bf16=False, gradient_checkpointing=False (TRL defaults both to True) and a "
                             "constant learning rate (TRL's default decays linearly), as Relax trains")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relax.contracts import RewardSample
    from relax_plugins.rewards.exact_match import ExactMatch

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    scorer = ExactMatch(ExactMatch.Config())
    step_reward: list[float] = []
    step_end_s: list[float] = []
    first_step_end_wall: list[float] = []

    def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        """Relax's exact_match on TRL's completions; called once per generation batch (one step)."""
        scores = scorer.score([RewardSample(prompt=p, response=c, label=a)
                               for p, c, a in zip(prompts, completions, answer)])
        step_reward.append(sum(scores) / len(scores))
        return scores

    class StepClock(TrainerCallback):
        """The wall clock at the end of every optimizer step."""

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_end_s.append(time.perf_counter())
            if not first_step_end_wall:
                first_step_end_wall.append(time.time())

    batch = args.prompts_per_step * args.samples_per_prompt
    matched = {"bf16": False, "gradient_checkpointing": False, "lr_scheduler_type": "constant"} if args.matched else {}
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=batch,  # one generation batch of all prompts x samples ...
        gradient_accumulation_steps=1,  # ... and one optimizer update on it per step
        num_generations=args.samples_per_prompt,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        beta=0.0,
        use_vllm=False,
        use_cpu=True,
        seed=args.seed,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        **matched,
    )
    trainer = GRPOTrainer(model=args.model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                          callbacks=[StepClock()])
    trainer.train()
    args.out.write_text(json.dumps({"step_end_s": step_end_s, "first_step_end_wall": first_step_end_wall[0],
                                    "step_reward": step_reward}) + "\n")


if __name__ == "__main__":
    main()
