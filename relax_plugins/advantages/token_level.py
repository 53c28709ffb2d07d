"""Token-level advantage estimators (``reinforce_pp``, ``reinforce_pp_baseline``, ``gae``).

Thin plugins over ``relax.algo.advantages``: they implement ``compute_tokens(inputs)`` on a
``TokenAdvantageInputs`` and return ``TokenAdvantages`` (``[B, T]``). ``needs`` names the token
tensors of other roles each may read: ``ref_logprobs`` for a KL penalty in the reward
(``algorithm.kl_in: reward`` with ``kl_coef > 0``), ``values`` for GAE's critic. The KL settings
come from the ``AlgorithmContext``; discounting and whitening from the plugin's own options. torch is
imported when computing, so this module stays importable by ``relax validate``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import AlgorithmContext


class _TokenAdvantage:
    """Shared by the token-level estimators: the KL penalty in the reward, and the outcome hook."""

    token_level: ClassVar[bool] = True
    group_based: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"ref_logprobs"})

    def __init__(self, config: Any, context: AlgorithmContext) -> None:
        self.config = config
        self.context = context
        self.kl_coef = float(context.kl_coef) if context.kl_in == "reward" else 0.0
        """Weight of the per-token KL penalty in the reward (0 when the KL goes in the loss)."""
        self.kl_estimator = context.kl_estimator or "k1"

    def compute(self, rewards: Any, group_ids: Any) -> Any:
        """Not available: a token-level estimator needs the token tensors of ``compute_tokens``."""
        raise TypeError(f"{type(self).__name__} is a token-level advantage estimator (token_level = "
                        "True): call compute_tokens(TokenAdvantageInputs) with the response mask and "
                        "log-probs, not compute(rewards, group_ids)")

    def _inputs(self, inputs: Any) -> tuple[Any, Any, Any, Any]:
        """``(rewards, group_ids, response_mask, token_kl or None)`` as float/long tensors."""
        import torch

        from relax.algo.kl import kl_divergence

        mask = torch.as_tensor(inputs.response_mask).float()
        rewards = torch.as_tensor(inputs.rewards).float().reshape(-1)
        group_ids = torch.as_tensor(inputs.group_ids).long().reshape(-1)
        token_kl = None
        if self.kl_coef > 0:
            if inputs.ref_logprobs is None:
                raise ValueError(f"{type(self).__name__}: algorithm.kl_in is reward with kl_coef "
                                 f"{self.kl_coef}, but no ref_logprobs were given; run roles.reference "
                                 "and pass its log-probs in TokenAdvantageInputs.ref_logprobs")
            token_kl = kl_divergence(torch.as_tensor(inputs.logprobs).float(),
                                     torch.as_tensor(inputs.ref_logprobs).float(), self.kl_estimator, mask)
        return rewards, group_ids, mask, token_kl


class _ReturnsConfig(BaseModel):
    """Options of the REINFORCE++ estimators."""

    model_config = ConfigDict(extra="forbid")

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount per response token of the returns (1: the undiscounted reward to go)."""
    eps: float = Field(1e-6, gt=0.0)
    """Added to the batch std when whitening."""


class ReinforcePPAdvantage(_TokenAdvantage):
    """REINFORCE++: discounted token returns with the KL penalty to go, whitened over the batch."""

    Config = _ReturnsConfig

    def compute_tokens(self, inputs: Any) -> Any:
        from relax.algo.advantages import TokenAdvantages, reinforce_pp_advantages

        rewards, _, mask, token_kl = self._inputs(inputs)
        return TokenAdvantages(reinforce_pp_advantages(rewards, mask, token_kl, self.kl_coef,
                                                       self.config.gamma, self.config.eps))


class ReinforcePPBaselineAdvantage(_TokenAdvantage):
    """REINFORCE++-baseline: group-mean baseline on the reward, then REINFORCE++ whitening."""

    group_based: ClassVar[bool] = True
    Config = _ReturnsConfig

    def compute_tokens(self, inputs: Any) -> Any:
        from relax.algo.advantages import TokenAdvantages, reinforce_pp_baseline_advantages

        rewards, group_ids, mask, token_kl = self._inputs(inputs)
        return TokenAdvantages(reinforce_pp_baseline_advantages(
            rewards, group_ids, mask, token_kl, self.kl_coef, self.config.gamma, self.config.eps))


class GAEAdvantage(_TokenAdvantage):
    """GAE over the critic's values; returns ``advantages + values`` for the critic."""

    needs: ClassVar[frozenset[str]] = frozenset({"values", "ref_logprobs"})

    class Config(BaseModel):
        """Options of generalised advantage estimation."""

        model_config = ConfigDict(extra="forbid")

        gamma: float = Field(1.0, ge=0.0, le=1.0)
        """Discount per response token."""
        lam: float = Field(0.95, ge=0.0, le=1.0)
        """GAE's lambda: 0 is the one-step TD error, 1 the Monte-Carlo return minus the value."""
        whiten: bool = True
        """Whiten the advantages over the batch's response tokens (the returns are left as they are)."""
        eps: float = Field(1e-6, gt=0.0)
        """Added to the batch std when whitening."""

    def compute_tokens(self, inputs: Any) -> Any:
        import torch

        from relax.algo.advantages import TokenAdvantages, gae_advantages

        if inputs.values is None:
            raise ValueError("gae needs the critic's values (TokenAdvantageInputs.values); run "
                             "roles.critic and pass its values")
        rewards, _, mask, token_kl = self._inputs(inputs)
        c = self.config
        advantages, returns = gae_advantages(rewards, torch.as_tensor(inputs.values).float(), mask, token_kl,
                                             self.kl_coef, c.gamma, c.lam, c.whiten, c.eps)
        return TokenAdvantages(advantages, returns)
