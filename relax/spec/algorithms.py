"""Named algorithms: which advantage estimator and which policy loss an ``algorithm.name`` means.

An algorithm is a preset of plugins, so a user switches algorithm with one word and can still
override either half (``algorithm.advantage``, ``algorithm.loss``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmRecipe:
    """The parts an algorithm name stands for and what it needs from the rest of the spec."""

    advantage: str
    loss: str
    needs_critic: bool = False


ALGORITHMS: dict[str, AlgorithmRecipe] = {
    "grpo": AlgorithmRecipe("grpo", "ppo_clip"),
    "dr_grpo": AlgorithmRecipe("dr_grpo", "ppo_clip"),
    "rloo": AlgorithmRecipe("rloo", "ppo_clip"),
    "dapo": AlgorithmRecipe("grpo", "ppo_clip"),
    "gspo": AlgorithmRecipe("grpo", "gspo"),
    "cispo": AlgorithmRecipe("grpo", "cispo"),
    "sapo": AlgorithmRecipe("grpo", "sapo"),
    "reinforce_pp": AlgorithmRecipe("reinforce_pp", "ppo_clip"),
    "reinforce_pp_baseline": AlgorithmRecipe("reinforce_pp_baseline", "ppo_clip"),
    "ppo": AlgorithmRecipe("gae", "ppo_clip", needs_critic=True),
}
