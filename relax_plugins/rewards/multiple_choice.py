"""``multiple_choice``: 1.0 when the letter a response chooses is the label's.

Models state their choice in many ways: ``B``, ``(B)``, ``**B**``, ``B) Paris``, ``The answer is
B.``, ``Answer: (b)``, ``\\boxed{B}``. The extraction looks, in order, for an explicit statement
(the last "answer is X" / "answer: X" / "option X" / ``\\boxed{X}``), then a response that is
just a letter or starts with one followed by ``)``, ``.`` or ``:``, then (optionally) the last
stand-alone capital letter among the choices. A response naming no choice gets ``unparsed_score``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax.contracts import RewardSample


class MultipleChoice:
    """Scores the chosen letter against the label (a letter, or a 0-based option index)."""

    class Config(BaseModel):
        """Options of the multiple-choice reward."""

        model_config = ConfigDict(extra="forbid")

        choices: str = Field("ABCD", min_length=2)
        """The option letters, in order (an integer label i means the i-th of them)."""
        last_letter_fallback: bool = True
        """When no explicit choice is found, take the last stand-alone capital letter among the
        choices (``I think it's C``); lowercase letters are never taken this way (``a`` is a word)."""
        correct_score: float = 1.0
        """Score of the right choice."""
        wrong_score: float = 0.0
        """Score of a wrong choice."""
        unparsed_score: float = 0.0
        """Score of a response that names no choice."""

        @field_validator("choices")
        @classmethod
        def _letters(cls, value: str) -> str:
            value = value.upper()
            if not value.isalpha() or not value.isascii() or len(set(value)) != len(value):
                raise ValueError("must be distinct ASCII letters, e.g. ABCD")
            return value

    def __init__(self, config: Any) -> None:
        self.config = config
        letters = config.choices
        letter = rf"[{letters}{letters.lower()}]"
        wrapped = rf"[\(\[\{{\*_\"'`]*({letter})[\)\]\}}\*_\"'`]*"
        self._explicit = [
            re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?\s*({letter})\s*\}}"),
            re.compile(rf"(?i:answer|choice|option)\s*(?i:is|:|=|-)?\s*(?i:option|choice)?\s*(?::\s*)?"
                       rf"{wrapped}(?![A-Za-z])"),
        ]
        self._alone = re.compile(rf"^\s*{wrapped}\s*[\.\)\:]?\s*$")
        self._leading = re.compile(rf"^\s*{wrapped}\s*[\)\.\:]\s")
        self._last = re.compile(rf"(?<![A-Za-z])([{letters}])(?![A-Za-z])")

    def chosen(self, response: str) -> str | None:
        """The letter a response chooses (upper case), or None."""
        for pattern in self._explicit:
            found = [m for m in pattern.finditer(response) if not self._article(m, response)]
            if found:
                return found[-1].group(1).upper()
        for pattern in (self._alone, self._leading):
            found = pattern.search(response)
            if found:
                return found.group(1).upper()
        if self.config.last_letter_fallback:
            found = list(self._last.finditer(response))
            if found:
                return found[-1].group(1)
        return None

    @staticmethod
    def _article(found: re.Match[str], text: str) -> bool:
        """A lowercase ``a`` followed by a word is the article ("the answer is a bit ..."), not a choice."""
        start, end = found.span(1)
        bare = start == 0 or text[start - 1].isspace()
        return found.group(1) == "a" and bare and re.match(r"\s+[A-Za-z]", text[end:]) is not None

    def _label_letter(self, label: Any, i: int) -> str:
        choices = self.config.choices
        if isinstance(label, bool):
            label = None
        if isinstance(label, int):
            if 0 <= label < len(choices):
                return choices[label]
        elif isinstance(label, str) and len(label.strip()) == 1 and label.strip().upper() in choices:
            return label.strip().upper()
        raise ValueError(f"multiple_choice: the label {label!r} of sample {i} is neither one of the letters "
                         f"{choices} nor an option index 0..{len(choices) - 1}; check data.label_key and "
                         "options.choices")

    def score(self, samples: list[RewardSample]) -> list[float]:
        cfg = self.config
        scores = []
        for i, sample in enumerate(samples):
            expected = self._label_letter(sample.label, i)
            letter = self.chosen(sample.response)
            if letter is None:
                scores.append(cfg.unparsed_score)
            else:
                scores.append(cfg.correct_score if letter == expected else cfg.wrong_score)
        return scores
