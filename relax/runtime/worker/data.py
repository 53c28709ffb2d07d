"""Which prompts each step trains on: a pure function of the seed and the step.

Because the order depends on nothing else, a resumed run (or a run in another placement mode)
sees exactly the same prompts at the same step, and the "data position" saved in a checkpoint is
simply the step.
"""

from __future__ import annotations

import random
from typing import Any

#: Seed strides of the data order and of the sampling seeds: a run's seed times RUN_SEED_STRIDE,
#: plus the epoch (data order) or the step times STEP_SEED_STRIDE (sampling). Both are primes (the
#: first above a million, and the 1,000th), so two (run seed, step) pairs share a sampling seed
#: (before the modulus) only when their steps differ by a multiple of 1,000,003, which no run's step
#: count reaches; the same holds for epochs. The strides of a step's rounds and units are in
#: ``relax.runtime.worker.sampling``.
RUN_SEED_STRIDE = 1_000_003
STEP_SEED_STRIDE = 7_919
#: The stride of a step's draw of extra prompts (dynamic sampling's rounds): rounds 0..130 of one
#: step never share a generator seed with another step's; 131 is prime, like the strides above.
EXTRA_ROUND_STRIDE = 131


class PromptSchedule:
    """Epoch-wise shuffled prompt indices, ``prompts_per_step`` per step."""

    def __init__(self, size: int, prompts_per_step: int, seed: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError("the training data set is empty; give it at least one prompt")
        self.size = size
        self.per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * RUN_SEED_STRIDE + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: steps only move forward
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        """Data-set indices of the prompts of ``step`` (crossing epoch boundaries as needed)."""
        start = step * self.per_step
        return [self._order(pos // self.size)[pos % self.size] for pos in range(start, start + self.per_step)]

    def extra(self, step: int, round_: int) -> list[int]:
        """More prompts for ``step`` (dynamic sampling's round ``round_`` >= 1): a seeded draw, so a
        resumed run over-samples exactly the same prompts, without shifting later steps' prompts."""
        rng = random.Random((self.seed * RUN_SEED_STRIDE + step) * EXTRA_ROUND_STRIDE + round_)
        if self.size >= self.per_step:
            return rng.sample(range(self.size), self.per_step)
        return [rng.randrange(self.size) for _ in range(self.per_step)]


def sampling_seed(run_seed: int, step: int) -> int:
    """The generation seed of a step: the same in every placement mode and after a resume."""
    return (run_seed * RUN_SEED_STRIDE + step * STEP_SEED_STRIDE) % (2**31 - 1)


def prompt_rows(dataset: Any, indices: list[int], prompt_key: str, label_key: str,
                reward_key: str | None = None, media: Any = None, split: str = "training data") -> list[dict[str, Any]]:
    """The data set rows of a step, checked for the prompt column; ``route`` holds the row's
    ``reward_key`` value (which rewards score it) when the row has one.

    With ``media`` (a ``relax.media.MediaSet``, multimodal runs) each row also gets ``media``: its
    context (prompt and media references) as the JSON the bus carries. A row whose media are bad
    raises ``relax.media.BadSample`` naming it under ``data.on_bad_sample: error``; under ``skip``
    it is replaced by the next usable row of the data set (so the step keeps its size) and counted
    in ``media.skipped``. ``split`` names the data set in errors."""
    return [_prompt_row(dataset, index, prompt_key, label_key, reward_key, media, split) for index in indices]


def _prompt_row(dataset: Any, index: int, prompt_key: str, label_key: str, reward_key: str | None,
                media: Any, split: str) -> dict[str, Any]:
    from relax.media import BadSample, dumps_context

    size = len(dataset)
    for attempt in range(size):
        current = (index + attempt) % size
        row = dataset[current]
        if prompt_key not in row:
            raise KeyError(f"row {current} of the {split} has no '{prompt_key}' column (data.prompt_key); "
                           f"it has: {', '.join(sorted(row))}")
        entry = {"index": current, "prompt": str(row[prompt_key]), "label": row.get(label_key)}
        if reward_key is not None and row.get(reward_key) is not None:
            entry["route"] = row[reward_key]
        if media is None:
            return entry
        try:
            entry["media"] = dumps_context(entry["prompt"], media.refs(row, current))
        except BadSample as exc:
            if media.on_bad_sample != "skip":
                raise BadSample(exc.index, exc.key, exc.cause + " (data.on_bad_sample: skip replaces such "
                                "samples by the next usable one)") from None
            media.skipped += 1
            continue
        return entry
    raise ValueError(f"every one of the {size} training samples has bad media (data.on_bad_sample: skip found "
                     "no usable sample); check the media columns and data.media_options")
