"""A length-penalty reward for Relax, published as a third-party plugin."""

from relax_reward_length.reward import LengthPenalty

__all__ = ["LengthPenalty"]
