"""``synthetic:arithmetic``: small arithmetic problems such as ``3+5=`` -> ``8``, built from a seed.

The built-in ``tiny-lm`` model is warmed up on exactly this task (with this dataset's default
options), so a run with both starts from a weak policy that reinforcement learning can improve.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax_plugins.datasets.seeded import item_rng

Operation = Literal["+", "-", "*"]


def arithmetic_problem(rng: random.Random, max_operand: int, operations: list[str]) -> dict[str, str]:
    """One problem ``{"prompt": "a<op>b=", "answer": str(result)}`` with operands in [0, max_operand]."""
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    op = rng.choice(operations)
    result = a + b if op == "+" else a - b if op == "-" else a * b
    return {"prompt": f"{a}{op}{b}=", "answer": str(result)}


class ArithmeticDataset:
    """A map-style data set of ``size`` arithmetic problems; item ``i`` depends only on the seed and ``i``."""

    #: The columns of every row (``relax validate`` checks the spec's data keys against them).
    columns: ClassVar[tuple[str, ...]] = ("prompt", "answer")

    class Config(BaseModel):
        """Options of the synthetic arithmetic data set."""

        model_config = ConfigDict(extra="forbid")

        size: int = Field(4096, ge=1)
        """Number of problems."""
        seed: int = Field(0, ge=0)
        """Seed of the problems (item i is the same for the same seed, in every process)."""
        max_operand: int = Field(9, ge=1, le=10_000)
        """Operands are drawn uniformly from 0..max_operand (tiny-lm is warmed up with the default)."""
        operations: list[Operation] = Field(default_factory=lambda: ["+"], min_length=1)
        """Operators drawn uniformly: any of +, - and * (tiny-lm is warmed up with the default)."""

    @classmethod
    def length(cls, config: ArithmeticDataset.Config) -> int:
        """The size of the set ``config`` builds, known without building it (``trainer.epochs``)."""
        return config.size

    def __init__(self, config: ArithmeticDataset.Config) -> None:
        self.config = config

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        index, rng = item_rng("arithmetic", self.config.seed, self.config.size, index)
        return arithmetic_problem(rng, self.config.max_operand, list(self.config.operations))
