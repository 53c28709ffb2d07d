"""``math_verify``: 1.0 when the response's final answer is mathematically equal to the label.

Both sides go through Hugging Face's ``math-verify`` package: it extracts the answer from the
response (a ``\\boxed{...}``, a "final answer is" phrase, the last LaTeX or plain expression) and
compares it with the label symbolically (``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal; so are
``{1,2}`` and ``{2,1}``), so a correct answer written differently still earns the reward.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import RewardSample


class MathVerify:
    """Scores a response by symbolic equivalence of its extracted answer with the label.

    A label may be a list or tuple of accepted answers. Labels are read as LaTeX or plain
    expressions (``$...$`` is optional). A label that cannot be parsed is an error naming the
    sample: the data set's answers are probably in the wrong column.

    ``math-verify`` bounds its own work with ``signal.alarm``, which works only in a process's main
    thread; elsewhere (the run's scorer calls plugins from a thread pool) ``timeout_s`` is not
    applied per answer and the reward's ``rewards[].timeout_s`` bounds the whole batch instead.
    """

    class Config(BaseModel):
        """Options of the math-verify reward."""

        model_config = ConfigDict(extra="forbid")

        require_boxed: bool = False
        """Only an answer inside ``\\boxed{...}`` counts; a response without one gets
        ``unparsed_score``."""
        correct_score: float = 1.0
        """Score of an answer equal to the label."""
        wrong_score: float = 0.0
        """Score of an answer that differs from the label."""
        unparsed_score: float = 0.0
        """Score of a response in which no answer can be found."""
        float_rounding: int = Field(6, ge=0, le=15)
        """Decimal places numbers are rounded to before comparing."""
        strict: bool = True
        """Strict comparison: variables must match and ``x=1`` is not equal to ``1``."""
        timeout_s: int = Field(5, ge=1)
        """Longest time to parse or compare one answer (applied in the main thread only)."""

    def __init__(self, config: MathVerify.Config) -> None:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig

        self.config = config
        boxed_first = LatexExtractionConfig(boxed_match_priority=0)
        self._response_targets = [boxed_first, ExprExtractionConfig()]
        self._boxed_targets = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
        self._label_targets = [LatexExtractionConfig(), ExprExtractionConfig()]
        self._label_cache: dict[str, list[Any]] = {}

    def _timeout(self) -> int | None:
        return self.config.timeout_s if threading.current_thread() is threading.main_thread() else None

    def _parse(self, text: str, targets: list[Any], fallback: str = "first_match") -> list[Any]:
        import logging

        from math_verify import parse

        # math-verify warns once when its timeout is off; the docstring above says why it is.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        return parse(text, extraction_config=targets, fallback_mode=fallback, parsing_timeout=self._timeout())

    def _gold(self, label: str) -> list[Any]:
        if label not in self._label_cache:
            # No string fallback: a label must parse as math, or it is not one.
            gold = self._parse(label, self._label_targets, "no_fallback")
            if not gold and "$" not in label:
                gold = self._parse(f"${label}$", self._label_targets, "no_fallback")
            self._label_cache[label] = gold
        return self._label_cache[label]

    def score(self, samples: list[RewardSample]) -> list[float]:
        from math_verify import verify

        cfg = self.config
        scores = []
        for i, sample in enumerate(samples):
            if sample.label is None:
                raise ValueError(f"math_verify: sample {i} has no label; check data.label_key names the column "
                                 "holding the answers")
            labels = sample.label if isinstance(sample.label, list | tuple) else [sample.label]
            golds = []
            for label in labels:
                gold = self._gold(str(label))
                if not gold:
                    raise ValueError(f"math_verify: the label {label!r} of sample {i} is not a math answer "
                                     "(LaTeX or a plain expression); check data.label_key")
                golds.append(gold)
            if cfg.require_boxed and "\\boxed" not in sample.response and "\\fbox" not in sample.response:
                scores.append(cfg.unparsed_score)
                continue
            answer = self._parse(sample.response, self._boxed_targets if cfg.require_boxed else self._response_targets)
            if not answer:
                scores.append(cfg.unparsed_score)
                continue
            equal = any(verify(gold, answer, float_rounding=cfg.float_rounding, strict=cfg.strict,
                               timeout_seconds=self._timeout()) for gold in golds)
            scores.append(cfg.correct_score if equal else cfg.wrong_score)
        return scores
