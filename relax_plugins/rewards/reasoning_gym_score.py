"""``reasoning_gym``: a response scored by the ``reasoning-gym`` library's own ``score_answer(answer,
entry)`` for the generator that made the item (``pip install 'relax[reasoning_gym]'``).

The label is the row's ``entry`` column of the ``reasoning_gym`` data set (``data.label_key: entry``):
the item as JSON. The generator is rebuilt with the same name and options as the data set's, so a
generator whose scoring reads its configuration scores as the library would. ``extract`` picks the
answer out of the response: ``answer_tag`` takes the last ``<answer>...</answer>`` (the library's
``extract_answer``; none found scores 0), ``none`` scores the whole response, stripped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import RewardSample


class ReasoningGymScore:
    """The library's score of each response, on its item."""

    class Config(BaseModel):
        """Options of the reasoning-gym reward."""

        model_config = ConfigDict(extra="forbid")

        name: str = Field(min_length=1)
        """The generator (as the data set's ``name``)."""
        options: dict[str, Any] = Field(default_factory=dict)
        """The generator's configuration (as the data set's ``options``)."""
        extract: Literal["answer_tag", "none"] = "none"
        """How the answer is taken from the response (see the module's docstring)."""
        stop: list[str] = Field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>", "</s>"])
        """The response is cut at the first of these strings before the answer is taken."""

    def __init__(self, config: ReasoningGymScore.Config) -> None:
        from relax_plugins.datasets.reasoning_gym_tasks import make_dataset

        self.config = config
        self.dataset = make_dataset(config.name, 0, 1, config.options)

    def answer(self, response: str) -> str | None:
        """The answer the response gives (None: it gives none)."""
        for stop in self.config.stop:
            if stop and stop in response:
                response = response[:response.find(stop)]
        if self.config.extract == "answer_tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(response)
        return response.strip()

    def score(self, samples: list[RewardSample]) -> list[float]:
        scores = []
        for i, sample in enumerate(samples):
            entry = sample.label
            if isinstance(entry, str):
                try:
                    entry = json.loads(entry)
                except json.JSONDecodeError:
                    raise ValueError(f"sample {i}: the label is not a reasoning-gym entry (JSON of question, answer "
                                     "and metadata); set data.label_key: entry with the reasoning_gym data "
                                     "set") from None
            if not isinstance(entry, dict) or "answer" not in entry:
                raise ValueError(f"sample {i}: the label is not a reasoning-gym entry (got {type(entry).__name__}); "
                                 "set data.label_key: entry with the reasoning_gym data set")
            scores.append(float(self.dataset.score_answer(self.answer(sample.response), entry)))
        return scores
