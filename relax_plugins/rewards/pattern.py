"""``regex`` and ``format``: rewards for what a response looks like, by regular expression.

``regex`` searches the response for a pattern, and can compare the text its first group captured
with the label (extract an answer in a required format, then check it). ``format`` checks that the
whole response has a required structure, e.g. reasoning in ``<think>`` tags followed by an answer
in ``<answer>`` tags (DeepSeek-R1's format reward).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax.contracts import RewardSample

MatchMode = Literal["search", "match", "fullmatch"]
RegexFlag = Literal["IGNORECASE", "MULTILINE", "DOTALL"]


def _compiles(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"is not a valid regular expression ({exc}); check its escapes (in YAML, prefer "
                         "single quotes)") from None
    return pattern


class RegexReward:
    """Scores whether the response matches ``pattern``; with ``compare_label``, whether the text
    captured by its first group (or a group named ``answer``) equals the label."""

    class Config(BaseModel):
        """Options of the regex reward."""

        model_config = ConfigDict(extra="forbid")

        pattern: str = r"(?i)answer\s*[:=]\s*(\S+)"
        """The regular expression (Python syntax)."""
        mode: MatchMode = "search"
        """search: anywhere in the response; match: at its start; fullmatch: the whole response."""
        flags: list[RegexFlag] = Field(default_factory=list)
        """Regular-expression flags: IGNORECASE, MULTILINE, DOTALL."""
        strip: bool = True
        """Strip leading and trailing whitespace from the response first."""
        compare_label: bool = False
        """Compare the captured answer (group ``answer``, else group 1) with the label."""
        last_match: bool = True
        """With ``compare_label`` and ``mode: search``, use the last match in the response (a final
        answer), not the first."""
        case_sensitive: bool = False
        """With ``compare_label``: compare letters with their case."""
        match_score: float = 1.0
        """Score when the pattern matches (and, with ``compare_label``, the answer equals the label)."""
        wrong_score: float = 0.0
        """With ``compare_label``: score when the pattern matches but the answer differs."""
        miss_score: float = 0.0
        """Score when the pattern does not match."""

        @field_validator("pattern")
        @classmethod
        def _valid_pattern(cls, value: str) -> str:
            return _compiles(value)

    def __init__(self, config: Any) -> None:
        self.config = config
        flags = 0
        for name in config.flags:
            flags |= getattr(re, name)
        self.regex = re.compile(config.pattern, flags)
        if config.compare_label and self.regex.groups == 0:
            raise ValueError(f"{type(self).__name__}: compare_label needs a capturing group in pattern "
                             f"{config.pattern!r}; wrap the answer part in (...) or (?P<answer>...)")

    def _find(self, text: str) -> re.Match[str] | None:
        mode = self.config.mode
        if mode == "search" and self.config.compare_label and self.config.last_match:
            found = None
            for found in self.regex.finditer(text):  # noqa: B007 - the last match is the one kept
                pass
            return found
        return getattr(self.regex, mode)(text)

    def _answer(self, found: re.Match[str]) -> str:
        group = "answer" if "answer" in self.regex.groupindex else 1
        return (found.group(group) or "").strip()

    def _fold(self, text: str) -> str:
        return text if self.config.case_sensitive else text.casefold()

    def score(self, samples: list[RewardSample]) -> list[float]:
        cfg = self.config
        scores = []
        for i, sample in enumerate(samples):
            text = sample.response.strip() if cfg.strip else sample.response
            found = self._find(text)
            if found is None:
                scores.append(cfg.miss_score)
                continue
            if not cfg.compare_label:
                scores.append(cfg.match_score)
                continue
            if sample.label is None:
                raise ValueError(f"{type(self).__name__}: sample {i} has no label to compare with; check "
                                 "data.label_key, or set compare_label: false")
            labels = sample.label if isinstance(sample.label, list | tuple) else [sample.label]
            accepted = {self._fold(str(label).strip()) for label in labels}
            scores.append(cfg.match_score if self._fold(self._answer(found)) in accepted else cfg.wrong_score)
        return scores


class FormatReward(RegexReward):
    """Scores whether the whole response has the required structure (``pattern``, matched in full,
    with ``.`` matching newlines)."""

    class Config(BaseModel):
        """Options of the format reward."""

        model_config = ConfigDict(extra="forbid")

        pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>"
        """The structure the whole response must have (Python regular expression; ``.`` matches
        newlines)."""
        strip: bool = True
        """Strip leading and trailing whitespace from the response first."""
        match_score: float = 1.0
        """Score of a response with the required structure."""
        miss_score: float = 0.0
        """Score of any other response."""

        @field_validator("pattern")
        @classmethod
        def _valid_pattern(cls, value: str) -> str:
            return _compiles(value)

    def __init__(self, config: Any) -> None:
        base = RegexReward.Config(pattern=config.pattern, mode="fullmatch", flags=["DOTALL"], strip=config.strip,
                                  match_score=config.match_score, miss_score=config.miss_score)
        super().__init__(base)
        self.format_config = config
