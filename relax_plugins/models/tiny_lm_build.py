"""Building ``builtin:tiny-lm``: tokenizer, random initialisation and the supervised warm-up.

Imported by ``TinyLM.materialize`` only (it needs torch, transformers and tokenizers).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from relax.algo.batch import collate, token_logprobs
from relax.algo.losses import masked_mean
from relax.contracts import Generation
from relax_plugins.datasets.arithmetic import ArithmeticDataset, arithmetic_problem
from relax_plugins.models.tiny_lm import CHARSET, JUDGE_TEMPLATE, SPECIAL_TOKENS, VOCAB_SIZE, TinyLM

PAD, EOS, UNK = SPECIAL_TOKENS
#: Characters of the rambling continuation some warm-up targets have after the answer.
RAMBLE = "0123456789+"


def train_tokenizer() -> Any:
    """A character-level tokenizer trained with ``tokenizers``, wrapped for transformers.

    Every character of ``CHARSET`` is one token; anything else is ``<unk>``. Left padding is passed
    to the constructor so that it is saved with the tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB_SIZE, min_frequency=1,
                                        special_tokens=list(SPECIAL_TOKENS))
    core.train_from_iterator(["".join(CHARSET)], trainer=trainer)
    if core.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tiny-lm tokenizer has {core.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        padding_side="left",
        truncation_side="left",
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=4096,
    )


def build_model(config: TinyLM.Config, tokenizer: Any) -> Any:
    """The randomly initialised model (seeded by ``config.seed``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    arch = LlamaConfig if config.architecture == "llama" else Qwen2Config
    hf_config = arch(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(config.seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def task_examples(tokenizer: Any, rng: random.Random, count: int,
                  stop_probability: float = 1.0) -> list[tuple[list[int], list[int], str]]:
    """``count`` problems of the task as (prompt ids, target ids ending in eos, answer text).

    With probability ``1 - stop_probability`` the target rambles on after the answer (a space and
    one to three random digits or ``+``) before its eos: a response exact match scores as wrong.
    """
    options = ArithmeticDataset.Config()
    out = []
    for _ in range(count):
        item = arithmetic_problem(rng, options.max_operand, list(options.operations))
        target = item["answer"]
        if rng.random() >= stop_probability:
            target += " " + "".join(rng.choice(RAMBLE) for _ in range(rng.randint(1, 3)))
        prompt = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt, ids, item["answer"]))
    return out


def judge_examples(tokenizer: Any, rng: random.Random, count: int,
                   stop_probability: float = 1.0) -> list[tuple[list[int], list[int], str]]:
    """The judge task's warm-up: half judgements, half plain arithmetic problems with their answers
    (knowing the answer at the candidate's position is what lets the judge compare).
    ``stop_probability`` is not used (the signature matches ``task_examples``)."""
    out = task_examples(tokenizer, rng, count // 2)
    return out + judgements(tokenizer, rng, count - len(out))


def judgements(tokenizer: Any, rng: random.Random, count: int) -> list[tuple[list[int], list[int], str]]:
    """``count`` judgements as (prompt ids, verdict ids ending in eos, verdict).

    The candidates look like a tiny-lm policy's responses: the answer (``yes``, 40%), the answer
    with a rambling tail (15%), a wrong number (30%) or a wrong number with a tail (15%); all but
    the first are ``no``, as exact match would say.
    """
    options = ArithmeticDataset.Config()
    out = []
    for _ in range(count):
        item = arithmetic_problem(rng, options.max_operand, list(options.operations))
        draw = rng.random()
        candidate = item["answer"] if draw < 0.55 else str(_wrong(rng, int(item["answer"])))
        if 0.4 <= draw < 0.55 or draw >= 0.85:
            candidate += " " + "".join(rng.choice(RAMBLE) for _ in range(rng.randint(1, 3)))
        verdict = "yes" if candidate == item["answer"] else "no"
        text = JUDGE_TEMPLATE.format(prompt=item["prompt"], response=candidate)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = tokenizer(verdict, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt, ids, verdict))
    return out


def _wrong(rng: random.Random, answer: int) -> int:
    """A wrong answer: usually close to the right one (the mistakes a weak policy makes)."""
    while True:
        guess = answer + rng.choice((-2, -1, 1, 2)) if rng.random() < 0.6 else rng.randint(0, 18)
        if guess != answer and guess >= 0:
            return guess


def warm_up(model: Any, tokenizer: Any, config: TinyLM.Config) -> dict[str, float]:
    """Supervised steps on the task (loss: mean negative log-likelihood of the target tokens).

    AdamW with a linear ramp over the first 10% of the steps to ``warmup_lr`` and a cosine decay to
    a tenth of it, so that the warm-up ends at a settled point whatever the seed.
    """
    rng = random.Random(f"tiny-lm-warmup:{config.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.warmup_lr, weight_decay=0.0)
    steps = config.warmup_steps
    ramp = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < ramp:
            return (step + 1) / ramp
        progress = (step - ramp) / max(1, steps - ramp)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        examples = examples_of(config)(tokenizer, rng, config.warmup_batch_size, config.warmup_stop_probability)
        generations = [Generation(0, p, r, [0.0] * len(r), "") for p, r, _ in examples]
        batch = collate(generations, [0.0] * len(generations), tokenizer.pad_token_id)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
        loss = -masked_mean(token_logprobs(logits, batch.input_ids), batch.response_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = float(loss.item())
    model.eval()
    return {"warmup_final_loss": loss_value}


def examples_of(config: TinyLM.Config) -> Any:
    """The example maker of the config's warm-up task."""
    return judge_examples if config.task == "judge" else task_examples


def expected_accuracy(model: Any, tokenizer: Any, examples: list[tuple[list[int], list[int], str]]) -> float:
    """The exact-match accuracy of sampling at temperature 1, in expectation: the mean over the
    examples of ``p(answer + eos | prompt)`` (the character-level tokenization is unique, so this is
    the probability that a sampled response equals the answer)."""
    generations = [Generation(0, p, r, [0.0] * len(r), "") for p, r, _ in examples]
    batch = collate(generations, [0.0] * len(generations), tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
        per_token = token_logprobs(logits, batch.input_ids) * batch.response_mask
        return float(per_token.sum(dim=1).exp().mean())


def build_tiny_lm(config: TinyLM.Config, folder: Path) -> dict[str, Any]:
    """Write the tokenizer and the warmed-up model into ``folder``; return a small build report."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fastest for a model this small, and steady on a busy machine
    try:
        tokenizer = train_tokenizer()
        model = build_model(config, tokenizer)
        report = warm_up(model, tokenizer, config)
        # The judge is measured on judgements only: the probability of the right verdict.
        evaluate = judgements if config.task == "judge" else task_examples
        evaluation = evaluate(tokenizer, random.Random(f"tiny-lm-eval:{config.seed}"), 512)
        report["expected_accuracy"] = expected_accuracy(model, tokenizer, evaluation)
        report["expected_answer_accuracy"] = expected_accuracy(
            model, tokenizer, [(p, r[:-1], a) for p, r, a in evaluation])
    finally:
        torch.set_num_threads(threads)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    report["build_seconds"] = round(time.perf_counter() - start, 3)
    report["parameters"] = sum(p.numel() for p in model.parameters())
    return report
