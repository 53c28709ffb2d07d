"""Building ``builtin:tiny-lm``: tokenizer, random initialisation and the supervised warm-up.

Imported by ``TinyLM.materialize`` only (it needs torch, transformers and tokenizers).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax.algo.batch import collate, token_logprobs
from relax.algo.losses import masked_mean
from relax.contracts import Generation, ToolCall, Turn
from relax_plugins.datasets.arithmetic import ArithmeticDataset, arithmetic_problem
from relax_plugins.datasets.products import ProductsDataset, product_problem
from relax_plugins.models.tiny_lm import (
    CHARSET,
    CHAT_TEMPLATE,
    JUDGE_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_CALL,
    TOOL_TOKENS,
    VOCAB_SIZE,
    TinyLM,
    vocab_size,
)

PAD, EOS, UNK = SPECIAL_TOKENS
#: Characters of the rambling continuation some warm-up targets have after the answer.
RAMBLE = "0123456789+"
#: Share of the calculator warm-up's trajectories that use the tool (see ``calculator_examples``).
TOOL_SHARE = 0.75
#: Rows per forward pass of the warm-up (rows are grouped by length, so little padding is computed).
LENGTH_GROUP = 16


def train_tokenizer(extra_tokens: tuple[str, ...] = ()) -> Any:
    """A character-level tokenizer trained with ``tokenizers``, wrapped for transformers.

    Every character of ``CHARSET`` is one token; anything else is ``<unk>``; each of
    ``extra_tokens`` is one more (ordinary) token, after those. Left padding is passed to the
    constructor so that it is saved with the tokenizer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB_SIZE, min_frequency=1,
                                        special_tokens=list(SPECIAL_TOKENS))
    core.train_from_iterator(["".join(CHARSET)], trainer=trainer)
    if core.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tiny-lm tokenizer has {core.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    core.add_tokens([AddedToken(token, normalized=False, special=False) for token in extra_tokens])
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
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
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
    if config.architecture == "qwen3_moe":
        # Every layer sparse (decoder_sparse_step 1, no dense layers), top-k renormalised as in
        # the Qwen3 MoE releases.
        hf_config = Qwen3MoeConfig(**common, num_experts=config.num_experts,
                                   num_experts_per_tok=config.experts_per_token,
                                   moe_intermediate_size=config.moe_intermediate_size, decoder_sparse_step=1,
                                   mlp_only_layers=[], norm_topk_prob=True,
                                   router_aux_loss_coef=config.router_aux_loss_coef)
    else:
        hf_config = (LlamaConfig if config.architecture == "llama" else Qwen2Config)(**common)
    torch.manual_seed(config.seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def task_examples(tokenizer: Any, rng: random.Random, count: int, stop_probability: float = 1.0,
                  long_tail: tuple[float, int] | None = None) -> list[tuple[list[int], list[int], str]]:
    """``count`` problems of the task as (prompt ids, target ids ending in eos, answer text).

    With probability ``1 - stop_probability`` the target rambles on after the answer (a space and
    one to three random digits or ``+``) before its eos: a response exact match scores as wrong.
    ``long_tail`` (probability, tokens): that share of the targets rambles on for between half the
    tokens and all of them instead (``task: long_tail``).
    """
    options = ArithmeticDataset.Config()
    out = []
    for _ in range(count):
        item = arithmetic_problem(rng, options.max_operand, list(options.operations))
        target = item["answer"]
        if long_tail is not None and rng.random() < long_tail[0]:
            target += " " + "".join(rng.choice(RAMBLE) for _ in range(rng.randint(long_tail[1] // 2, long_tail[1]) - 1))
        elif rng.random() >= stop_probability:
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


class CalculatorLayout:
    """The tokens of calculator trajectories as the agent runtime lays them out, learned once from
    the chat template: the prompt is the user message rendered with the calculator's tools and the
    assistant header; after a model turn come the rest of the assistant message's closing text
    (less the eos the model wrote), the tool message and the next assistant header (the runtime's
    ``relax.agents.chat.ChatTokens``; a test checks the two agree token for token). The template's
    tokens around the prompt's text and the observation's text are fixed, so a trajectory is
    assembled from them without rendering the template per example."""

    _PROBE, _USER, _ANSWER = "@probe@", "1*1=", "1"

    def __init__(self, tokenizer: Any) -> None:
        from relax_plugins.environments.calculator import CalculatorEnvironment

        self.tokenizer = tokenizer
        self.environment = CalculatorEnvironment(CalculatorEnvironment.Config())
        self.tool = self.environment.tools()[0].name
        tools = [t.to_openai() for t in self.environment.tools()]

        def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=generation_prompt)

        self.prompt_around = self._around(render([{"role": "user", "content": self._PROBE}], True))
        turn = [{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ANSWER}]
        closed = render(turn, False)
        whole = render([*turn, {"role": "tool", "name": self.tool, "content": self._PROBE}], True)
        if not whole.startswith(closed):
            raise RuntimeError("the calculator chat template rewrites earlier messages when a tool message follows")
        closing = closed[closed.rfind(self._ANSWER) + len(self._ANSWER):].removeprefix(tokenizer.eos_token)
        self.observation_around = self._around(closing + whole[len(closed):])

    def _around(self, text: str) -> tuple[list[int], list[int]]:
        before, after = text.split(self._PROBE)
        return self.encode(before), self.encode(after)

    def _turn(self, expr: str) -> Turn:
        return Turn(0, TOOL_CALL.format(expr=expr), [ToolCall(name=self.tool, arguments={"expr": expr})], True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, text: str) -> list[int]:
        """The first prompt's tokens for a problem (what ``ChatTokens.prompt`` gives)."""
        before, after = self.prompt_around
        return before + self.encode(text) + after

    def trajectory(self, item: dict[str, str]) -> dict[str, list[int]]:
        """The token pieces of a trajectory that calls the tool on ``item``: the prompt, the
        tool-call turn (ending in eos), the observation's tokens (the calculator's own result,
        rendered by the template) and the answer copied from it (ending in eos)."""
        turn = self._turn(item["prompt"].rstrip("="))
        result = str(self.environment.step({}, turn).content)
        before, after = self.observation_around
        eos = self.tokenizer.eos_token_id
        return {
            "prompt": self.prompt(item["prompt"]),
            "call": self.encode(turn.text) + [eos],
            "observation": before + self.encode(result) + after,
            "answer": self.encode(result) + [eos],
        }


def calculator_examples(tokenizer: Any, rng: random.Random, count: int, tool_probability: float = 0.25,
                        layout: CalculatorLayout | None = None) -> list[tuple[list[int], list[int], str, list[int]]]:
    """``count`` products as (prompt ids, trajectory ids, answer, loss mask over the trajectory).

    A trajectory either calls the tool, reads the result and answers with it, or answers directly
    with the product of the left operand and another number of the right operand's size
    (plausible, and right only by chance). The loss mask is 1 on the assistant's tokens (its turns
    with their eos), 0 on the observation's.

    Copying is what the model must learn and only the tool-using trajectories teach it, so they
    are most of the examples (``TOOL_SHARE``) whatever ``tool_probability`` is; the first token's
    loss is kept in just enough of them that the model starts a call with ``tool_probability``.
    """
    options = ProductsDataset.Config()
    layout = layout or CalculatorLayout(tokenizer)
    share = max(tool_probability, TOOL_SHARE)
    keep_first = 1.0 if share >= 1.0 else tool_probability * (1 - share) / (share * (1 - tool_probability))
    out = []
    for _ in range(count):
        item = product_problem(rng, list(options.left_digits), list(options.right_digits))
        if rng.random() < share:
            parts = layout.trajectory(item)
            ids = parts["call"] + parts["observation"] + parts["answer"]
            mask = [1] * len(parts["call"]) + [0] * len(parts["observation"]) + [1] * len(parts["answer"])
            mask[0] = int(rng.random() < keep_first)
            prompt = parts["prompt"]
        else:
            left, right = item["prompt"].rstrip("=").split("*")
            other = int(left) * _same_size(rng, int(right))
            ids = tokenizer(str(other), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            mask = [1] * len(ids)
            prompt = layout.prompt(item["prompt"])
        out.append((prompt, ids, item["answer"], mask))
    return out


def _same_size(rng: random.Random, number: int) -> int:
    """Another number with as many digits as ``number``."""
    digits = len(str(number))
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


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
    make_examples = example_maker(config, tokenizer)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        examples = make_examples(rng, config.warmup_batch_size)
        # Rows of similar length together: a calculator batch mixes long tool-using trajectories
        # with short direct answers, and padding every row to the longest would double the work.
        # (The other tasks' rows are all short: one forward pass.)
        group = LENGTH_GROUP if config.task == "calculator" else len(examples)
        if group < len(examples):
            examples.sort(key=lambda e: len(e[0]) + len(e[1]))
        groups = [training_batch(tokenizer, examples[i:i + group]) for i in range(0, len(examples), group)]
        total = sum(float(mask.sum()) for _, mask in groups)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for batch, loss_mask in groups:  # the mean over every target token of the step
            moe = {"output_router_logits": True} if config.architecture == "qwen3_moe" else {}
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, use_cache=False, **moe)
            share = float(loss_mask.sum()) / total
            part = -masked_mean(token_logprobs(out.logits, batch.input_ids), loss_mask) * share
            if moe:  # keep every expert in use (the load-balancing loss, weighted like the group)
                part = part + config.router_aux_loss_coef * out.aux_loss * (len(batch.input_ids) / len(examples))
            part.backward()
            loss = loss + part.detach()
        optimizer.step()
        schedule.step()
        loss_value = float(loss.item())
    model.eval()
    return {"warmup_final_loss": loss_value}


def example_maker(config: TinyLM.Config, tokenizer: Any) -> Callable[[random.Random, int], list[tuple]]:
    """The maker of the config's warm-up examples: ``(rng, count)`` -> (prompt ids, target ids,
    answer), plus the target's loss mask for the calculator task (its observation tokens are not
    the model's)."""
    if config.task == "calculator":
        layout = CalculatorLayout(tokenizer)
        return lambda rng, count: calculator_examples(tokenizer, rng, count, config.warmup_tool_probability, layout)
    if config.task == "long_tail":
        tail = (config.long_tail_probability, config.long_tail_tokens)
        return lambda rng, count: task_examples(tokenizer, rng, count, config.warmup_stop_probability, tail)
    maker = judge_examples if config.task == "judge" else task_examples
    return lambda rng, count: maker(tokenizer, rng, count, config.warmup_stop_probability)


def training_batch(tokenizer: Any, examples: list[tuple]) -> tuple[Any, torch.Tensor]:
    """The collated examples and their loss mask: every target token, or the example's own mask
    (its fourth field) where it has one."""
    generations = [Generation(0, e[0], e[1], [0.0] * len(e[1]), "") for e in examples]
    batch = collate(generations, [0.0] * len(generations), tokenizer.pad_token_id)
    loss_mask = batch.response_mask.clone()
    start = max(len(e[0]) for e in examples)  # collate's response column
    for i, example in enumerate(examples):
        if len(example) > 3:
            loss_mask[i, start:start + len(example[1])] = torch.tensor(example[3], dtype=loss_mask.dtype)
    return batch, loss_mask


def sequence_probabilities(model: Any, tokenizer: Any, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """``p(target | prefix)`` for each (prefix ids, target ids): what sampling at temperature 1
    writes exactly ``target`` after ``prefix`` with (the tokenization is unique, character level)."""
    generations = [Generation(0, p, t, [0.0] * len(t), "") for p, t in pairs]
    batch = collate(generations, [0.0] * len(generations), tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
        return (token_logprobs(logits, batch.input_ids) * batch.response_mask).sum(dim=1).exp()


def calculator_report(model: Any, tokenizer: Any, rng: random.Random, count: int) -> dict[str, float]:
    """How the warmed-up calculator agent behaves, in expectation over ``count`` held-out products:

    - ``tool_call_probability``: it writes the right tool call (the problem's expression) as its
      first turn;
    - ``copy_probability``: after the tool's result it answers exactly that result;
    - ``direct_accuracy``: its first turn is the right answer without the tool;
    - ``expected_accuracy``: its expected exact-match reward (call then copy, or right directly).
    """
    options = ProductsDataset.Config()
    layout = CalculatorLayout(tokenizer)
    items = [product_problem(rng, list(options.left_digits), list(options.right_digits)) for _ in range(count)]
    pieces = [layout.trajectory(item) for item in items]
    call = sequence_probabilities(model, tokenizer, [(p["prompt"], p["call"]) for p in pieces])
    copy = sequence_probabilities(model, tokenizer, [(p["prompt"] + p["call"] + p["observation"], p["answer"])
                                                     for p in pieces])
    direct = sequence_probabilities(model, tokenizer, [(p["prompt"], p["answer"]) for p in pieces])
    return {
        "tool_call_probability": float(call.mean()),
        "copy_probability": float(copy.mean()),
        "direct_accuracy": float(direct.mean()),
        "expected_accuracy": float((call * copy + direct).mean()),
    }


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
        tokenizer = train_tokenizer(TOOL_TOKENS if config.task == "calculator" else ())
        if len(tokenizer) != vocab_size(config.task):
            raise RuntimeError(f"tiny-lm tokenizer has {len(tokenizer)} tokens, expected {vocab_size(config.task)}")
        model = build_model(config, tokenizer)
        if config.task == "calculator":
            tokenizer.chat_template = CHAT_TEMPLATE
        report = warm_up(model, tokenizer, config)
        held_out = random.Random(f"tiny-lm-eval:{config.seed}")
        if config.task == "calculator":
            report.update(calculator_report(model, tokenizer, held_out, 256))
        else:
            # The judge is measured on judgements only: the probability of the right verdict.
            evaluate = judgements if config.task == "judge" else task_examples
            evaluation = evaluate(tokenizer, held_out, 512)
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
