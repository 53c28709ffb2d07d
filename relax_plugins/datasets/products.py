"""``synthetic:products``: products of a 3-digit and a 2-digit number, such as ``347*58=`` -> ``20126``.

The task of the built-in calculator agent (``presets/tiny-agent-cpu.yaml``): the tiny model cannot
multiply numbers this size itself, but it can call the ``calculator`` environment's tool and copy
the result, so its exact-match reward measures how well it learned to use the tool. ``tiny-lm``
with ``task: calculator`` is warmed up on this data set's default options.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax_plugins.datasets.seeded import item_rng


def product_problem(rng: random.Random, left_digits: list[int], right_digits: list[int]) -> dict[str, str]:
    """One problem ``{"prompt": "a*b=", "answer": str(a * b)}``; the digit count of each operand is
    drawn from its list, the operand uniformly among the numbers with that many digits."""
    a = _number(rng, rng.choice(left_digits))
    b = _number(rng, rng.choice(right_digits))
    return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


class ProductsDataset:
    """A map-style data set of ``size`` products; item ``i`` depends only on the seed and ``i``."""

    #: The columns of every row (``relax validate`` checks the spec's data keys against them).
    columns: ClassVar[tuple[str, ...]] = ("prompt", "answer")

    class Config(BaseModel):
        """Options of the synthetic products data set."""

        model_config = ConfigDict(extra="forbid")

        size: int = Field(4096, ge=1)
        """Number of problems."""
        seed: int = Field(0, ge=0)
        """Seed of the problems (item i is the same for the same seed, in every process)."""
        left_digits: list[int] = Field(default_factory=lambda: [3], min_length=1)
        """Digit counts of the left operand, drawn uniformly (tiny-lm's calculator task is warmed
        up with the default)."""
        right_digits: list[int] = Field(default_factory=lambda: [2], min_length=1)
        """Digit counts of the right operand, drawn uniformly."""

        @field_validator("left_digits", "right_digits")
        @classmethod
        def _digits_in_range(cls, value: list[int]) -> list[int]:
            bad = [d for d in value if not 1 <= d <= 9]
            if bad:
                raise ValueError(f"digit counts must be between 1 and 9, got {bad}")
            return value

    @classmethod
    def length(cls, config: ProductsDataset.Config) -> int:
        """The size of the set ``config`` builds, known without building it (``trainer.epochs``)."""
        return config.size

    def __init__(self, config: ProductsDataset.Config) -> None:
        self.config = config

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        index, rng = item_rng("products", self.config.seed, self.config.size, index)
        return product_problem(rng, list(self.config.left_digits), list(self.config.right_digits))
