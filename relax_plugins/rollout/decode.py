"""A lean sampling loop for Hugging Face causal LMs: the ``hf`` rollout's text path.

Why not ``model.generate``: for RL rollouts most of its per-token work is bookkeeping that a
rollout does not need (logits processors built per call, stopping criteria, score tuples kept for
every step), and it samples with ``torch.multinomial``, which on CPU costs about 0.35 ms per step
for 128 rows of a 99-token vocabulary. On the tiny CPU preset this loop generates a step's 128
responses in about two thirds of ``generate``'s time (``bench/learn_tiny.py``). What it does
instead:

* **Shared prompts are prefilled once.** GRPO asks for ``n`` samples of each prompt; identical
  token rows are run through the prefill once and the KV cache is then copied per sample.
* **Each row stops on its own budget** (``budgets``), so agentic turns with different budgets need
  no cutting afterwards.
* **Sampling is one inverse-CDF draw per row** (``torch.searchsorted`` on the cumulative
  probabilities), exact for the distribution whose log-probs are reported.
* **Stop strings** (``stop_strings``, ``relax.algo.stop_strings``) end a row at the token
  that completes one, found by decoding the tail of each live row after every token.

The distribution sampled from is the one the rollout documents: ``log_softmax`` of the logits
with suppressed tokens removed, the repetition penalty applied (CTRL's, as ``transformers``'
``RepetitionPenaltyLogitsProcessor``: on every token of the row's prompt and response so far, a
positive logit divided by the penalty, a negative one multiplied), divided by the temperature,
then top-k and top-p truncated (with
``transformers``' rules: top-p keeps the smallest set of most likely tokens whose mass reaches
``top_p``, and always the most likely one). Temperature 0 is greedy and reports the log-probs of
the unscaled model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sampled:
    """What ``sample`` returns, per row: the new tokens (a stop token included when the row
    ended on one), their log-probs, and whether the row ended on a stop token."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


def supports(model: Any) -> bool:
    """Whether ``sample`` can drive ``model``: a causal LM that keeps a standard key/value cache
    (not a recurrent state, as Mamba-style models do) and takes position ids."""
    cache_ok = getattr(model, "_supports_default_dynamic_cache", None)
    if cache_ok is None or not cache_ok():
        return False
    params = inspect.signature(model.forward).parameters
    return all(name in params for name in ("past_key_values", "position_ids", "attention_mask"))


def sample(model: Any, rows: list[list[int]], budgets: list[int], *, temperature: float, top_p: float,
           top_k: int, stop_ids: list[int], pad_id: int, suppressed: list[int] | None = None,
           share_prompts: bool = True, pause: Callable[[list[bool]], bool] | None = None,
           generator: torch.Generator | None = None, repetition_penalty: float = 1.0,
           stop_strings: Any = None, grammars: Any = None) -> Sampled:
    """Sample a response to every row of prompt tokens, row ``i`` up to ``budgets[i]`` tokens,
    drawing from ``generator`` (default: the global torch RNG; seed either for repeatable samples).

    ``repetition_penalty`` (1: none) penalizes the tokens already in a row. ``stop_strings`` (a
    ``relax.algo.stop_strings.StopStrings``, or None) ends a row, ``finished``, at the
    token that completes one of its strings. ``grammars`` (a ``relax_plugins.rollout.grammars.
    RowGrammars``, or None) masks each constrained row's logits to what its grammar allows next,
    before the temperature and truncation: the row is drawn from, and reports the log-probs of,
    that masked distribution.

    ``share_prompts`` prefills identical rows once (turn it off when something counts the rows of
    every forward call, e.g. a routing recorder). ``pause`` (partial rollouts) is asked after every
    token with each row's state (True once it ended or used its budget); when it answers True every
    row stops where it is and comes back unfinished."""
    from transformers import DynamicCache

    if any(not ids for ids in rows):
        raise ValueError("a prompt has no tokens; every prompt must encode to at least one token")
    device = next(model.parameters()).device
    count = len(rows)
    width = max(len(ids) for ids in rows)
    if share_prompts:
        index: dict[tuple[int, ...], int] = {}
        inverse = [index.setdefault(tuple(ids), len(index)) for ids in rows]
        unique = [list(ids) for ids in index]
    else:
        inverse, unique = list(range(count)), rows
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in unique], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in unique], device=device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, **keep).logits[:, -1].float()
    if len(unique) < count:
        expand = torch.tensor(inverse, device=device)
        logits, mask, positions = logits[expand], mask[expand], positions[expand]
        cache.batch_select_indices(expand)
    position = positions[:, -1:]

    most = max(budgets)
    budget = torch.tensor(budgets, device=device)
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    drop = torch.tensor(sorted(set(suppressed or [])), dtype=torch.long, device=device)
    seen = None
    if repetition_penalty != 1.0:  # which tokens each row holds so far, prompt included
        vocab = logits.shape[-1]
        seen = torch.zeros((count, vocab), dtype=torch.bool, device=device)
        for i, ids in enumerate(rows):
            seen[i, torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long, device=device)] = True
    tokens = torch.full((count, most), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((count, most), dtype=torch.float32, device=device)
    lengths = torch.zeros(count, dtype=torch.long, device=device)
    ended = torch.zeros(count, dtype=torch.bool, device=device)  # stopped on a stop token
    live = budget > 0
    made = 0
    for step in range(most):
        if drop.numel():
            logits.index_fill_(-1, drop, float("-inf"))
        if seen is not None:
            logits = penalize_repetition(logits, seen, repetition_penalty)
        if grammars:
            flags = live.tolist()
            logits = grammars.restrict(logits, flags)
        chosen, logp = _draw(logits, temperature, top_p, top_k, generator)
        chosen = torch.where(live, chosen, pad_id)
        if grammars:
            grammars.advance(chosen.tolist(), flags)
        tokens[:, step] = chosen
        logprobs[:, step] = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        lengths += live
        made = step + 1
        stopped = live & torch.isin(chosen, stops)
        if seen is not None:
            seen[live.nonzero().squeeze(-1), chosen[live]] = True
        if stop_strings:
            stopped |= _stop_string_rows(stop_strings, tokens, live & ~stopped, made)
        ended |= stopped
        live &= ~stopped & (budget > made)
        if pause is not None and pause((~live).tolist()):
            break
        if not bool(live.any()):
            break
        mask = torch.cat([mask, mask.new_ones((count, 1))], dim=-1)
        position = position + 1
        logits = model(input_ids=chosen.unsqueeze(-1), attention_mask=mask, position_ids=position,
                       past_key_values=cache, use_cache=True).logits[:, -1].float()

    kept, kept_lp = tokens[:, :made].tolist(), logprobs[:, :made].tolist()
    return Sampled(tokens=[row[:n] for row, n in zip(kept, lengths.tolist())],
                   logprobs=[row[:n] for row, n in zip(kept_lp, lengths.tolist())], finished=ended.tolist())


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019; ``transformers``' ``RepetitionPenaltyLogitsProcessor``):
    where ``seen`` (``[rows, vocab]``: the token is in the row already), a logit ``x`` becomes
    ``x / penalty`` if ``x > 0`` else ``x * penalty``; elsewhere it is unchanged."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def _stop_string_rows(stop_strings: Any, tokens: torch.Tensor, candidates: torch.Tensor, made: int) -> torch.Tensor:
    """Which of the ``candidates`` rows (live, not ended on a stop token) now end with a stop string
    in the decoded tail of their ``made`` tokens."""
    hits = torch.zeros_like(candidates)
    rows = candidates.nonzero().squeeze(-1).tolist()
    if rows:
        tails = tokens[rows, max(0, made - stop_strings.window):made].tolist()
        for row, ended in zip(rows, stop_strings.ended(tails)):
            hits[row] = ended
    return hits


def _draw(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and the log-probs ``[rows, vocab]`` of the distribution it was drawn from."""
    if temperature <= 0:
        return logits.argmax(-1), torch.log_softmax(logits, dim=-1)
    scores = logits / temperature if temperature != 1.0 else logits
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1)
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = mass <= 1 - top_p
        cut[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(cut.scatter(-1, order, cut), float("-inf"))
    logp = torch.log_softmax(scores, dim=-1)
    cdf = logp.double().exp().cumsum(dim=-1)
    draw = torch.rand((scores.shape[0], 1), dtype=torch.float64, device=scores.device,
                      generator=generator) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, draw, right=True).squeeze(-1)
    # A draw that rounds up to the total mass would pick past the end: take the last possible token.
    possible = vocab - 1 - (logp.flip(-1) > float("-inf")).int().argmax(-1)
    return torch.minimum(chosen, possible), logp
