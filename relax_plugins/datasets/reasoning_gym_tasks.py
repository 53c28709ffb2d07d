"""``reasoning_gym``: a procedural data set of the ``reasoning-gym`` library (``pip install
'relax[reasoning_gym]'``) as a Relax data set: ``create_dataset(name, seed=, size=, **options)``, item
``i`` the library's item ``i``.

Each row holds ``prompt`` (the library's question, through ``prompt_template``), ``answer`` (its
reference answer) and ``entry`` (the whole item as JSON: question, answer and metadata). The
``reasoning_gym`` reward plugin scores a response with the library's own ``score_answer(answer,
entry)`` on that entry, so give ``data.label_key: entry``. Single-turn.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field


def entry_json(entry: dict[str, Any]) -> str:
    """An item as the JSON the ``entry`` column holds (tuples become lists, other values their text)."""
    return json.dumps(entry, ensure_ascii=False, default=str)


class ReasoningGymDataset:
    """Items of one reasoning-gym generator, made on demand from the seed (the library's items are
    themselves seeded by index)."""

    columns: ClassVar[tuple[str, ...]] = ("prompt", "answer", "entry")

    class Config(BaseModel):
        """Options of the reasoning-gym data set."""

        model_config = ConfigDict(extra="forbid")

        name: str = Field(min_length=1)
        """The generator, as reasoning-gym registers it (``basic_arithmetic``, ``leg_counting``, ...)."""
        size: int = Field(1024, ge=1)
        """Number of items."""
        seed: int = Field(0, ge=0)
        """The generator's seed."""
        options: dict[str, Any] = Field(default_factory=dict)
        """The generator's own configuration fields (its config dataclass), e.g. ``{min_terms: 2}``."""
        prompt_template: str = "{question}"
        """The prompt, with ``{question}`` replaced by the item's question (e.g. to ask for
        ``<answer>...</answer>`` tags, which the reward's ``extract: answer_tag`` reads)."""

    @classmethod
    def length(cls, config: ReasoningGymDataset.Config) -> int:
        return config.size

    def __init__(self, config: ReasoningGymDataset.Config) -> None:
        self.config = config
        self.dataset = make_dataset(config.name, config.seed, config.size, config.options)

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        entry = self.dataset[int(index)]
        return {"prompt": self.config.prompt_template.replace("{question}", entry["question"]),
                "answer": str(entry["answer"]), "entry": entry_json(entry)}


def make_dataset(name: str, seed: int, size: int, options: dict[str, Any]) -> Any:
    """``reasoning_gym.create_dataset``, with a missing generator named with the ones that exist."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = sorted(n for n in DATASETS if name.split("_")[0] in n)[:8]
        raise ValueError(f"reasoning-gym has no generator {name!r}"
                         + (f"; similar: {', '.join(close)}" if close else f"; it has {len(DATASETS)}, e.g. "
                            f"{', '.join(sorted(DATASETS)[:8])}"))
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **options)
