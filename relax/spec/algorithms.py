"""Named algorithms: which advantage estimator and which policy loss an ``algorithm.name`` means,
and the defaults it gives the algorithm section's other fields.

An algorithm is a preset of plugins and settings, so a user switches algorithm with one word and
can still override any part (``algorithm.advantage``, ``algorithm.loss``, ``algorithm.clip``,
``algorithm.loss_aggregation``, ...): a field set in the spec always wins over the name's default.
``docs/algorithms.md`` gives each objective's formula. Light by contract (imported by validate).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmRecipe:
    """The parts an algorithm name stands for and what it needs from the rest of the spec."""

    advantage: str
    """The ``relax.advantages`` plugin."""
    loss: str
    """The ``relax.losses`` plugin."""
    needs_critic: bool = False
    """The estimator reads critic values (``roles.critic`` must run)."""
    loss_aggregation: str = "token-mean"
    """Default of ``algorithm.loss_aggregation``."""
    kl_in: str = "loss"
    """Default of ``algorithm.kl_in``: where a KL penalty (``kl_coef > 0``) goes."""
    clip: tuple[float, float] | None = None
    """Default ``(low, high)`` of ``algorithm.clip`` when not PPO's (0.2, 0.28)."""
    dynamic_sampling: bool = False
    """Default of ``algorithm.dynamic_sampling.enabled`` (DAPO's group filter)."""


ALGORITHMS: dict[str, AlgorithmRecipe] = {
    # Shao et al. 2024; token-mean as in DAPO and most GRPO implementations today.
    "grpo": AlgorithmRecipe("grpo", "ppo_clip"),
    # Liu et al. 2025: no std division and no length normalisation (a constant budget instead).
    "dr_grpo": AlgorithmRecipe("dr_grpo", "ppo_clip", loss_aggregation="seq-mean-token-sum-norm"),
    "ppo": AlgorithmRecipe("gae", "ppo_clip", needs_critic=True, kl_in="reward"),
    "rloo": AlgorithmRecipe("rloo", "ppo_clip"),
    # Hu 2025: the KL penalty is part of the token reward and the returns are whitened per batch.
    "reinforce_pp": AlgorithmRecipe("reinforce_pp", "ppo_clip", kl_in="reward"),
    "reinforce_pp_baseline": AlgorithmRecipe("reinforce_pp_baseline", "ppo_clip", kl_in="reward"),
    # Zheng et al. 2025: sequence-level ratio, a ~1e-3 wide clip range, one weight per sequence.
    "gspo": AlgorithmRecipe("grpo", "gspo", loss_aggregation="seq-mean-token-mean", clip=(3e-4, 4e-4)),
    "cispo": AlgorithmRecipe("grpo", "cispo"),
    "sapo": AlgorithmRecipe("grpo", "sapo"),
    # Yu et al. 2025: clip-higher, token-mean and dynamic sampling (the overlong penalty is a reward).
    "dapo": AlgorithmRecipe("grpo", "ppo_clip", dynamic_sampling=True),
}
