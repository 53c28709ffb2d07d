"""``exact_match``: 1.0 when the response equals the label, else 0.0."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import RewardSample


class ExactMatch:
    """Scores 1.0 when the response, cut at the first stop string, equals ``str(label)``.

    A label that is a list or tuple holds several accepted answers; the response matches if it
    equals any of them. A sample without a label (None) is an error: the data set's ``label_key``
    is probably wrong.
    """

    class Config(BaseModel):
        """Options of the exact-match reward."""

        model_config = ConfigDict(extra="forbid")

        strip: bool = True
        """Strip leading and trailing whitespace from the response and the label before comparing."""
        case_sensitive: bool = False
        """Compare letters with their case; when false, both sides are case-folded."""
        stop: list[str] = Field(
            default_factory=lambda: ["\n", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>"]
        )
        """The response is cut at the first of these strings (a newline, common end-of-sequence
        markers a backend may leave in the text)."""

    def __init__(self, config: ExactMatch.Config) -> None:
        self.config = config

    def _normalize(self, text: str) -> str:
        if self.config.strip:
            text = text.strip()
        if not self.config.case_sensitive:
            text = text.casefold()
        return text

    def _cut(self, response: str) -> str:
        end = len(response)
        for stop in self.config.stop:
            if stop:
                found = response.find(stop)
                if found != -1:
                    end = min(end, found)
        return response[:end]

    def _accepted(self, label: Any) -> list[str]:
        labels = label if isinstance(label, list | tuple) else [label]
        return [self._normalize(str(item)) for item in labels]

    def score(self, samples: list[RewardSample]) -> list[float]:
        scores = []
        for i, sample in enumerate(samples):
            if sample.label is None:
                raise ValueError(f"exact_match: sample {i} has no label; check data.label_key names "
                                 "the column holding the answers")
            response = self._normalize(self._cut(sample.response))
            scores.append(1.0 if response in self._accepted(sample.label) else 0.0)
        return scores
