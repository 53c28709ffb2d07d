"""Group-relative advantage estimators (``grpo``, ``dr_grpo``, ``rloo``).

Thin plugins over the pure functions of ``relax.algo.advantages`` (imported when computing, so this
module stays importable without torch). ``rewards`` and ``group_ids`` are ``[B]`` tensors (or
sequences); samples of one prompt share a group id. Each returns a ``[B]`` float tensor.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import AlgorithmContext


def _tensors(rewards: Any, group_ids: Any) -> tuple[Any, Any]:
    import torch

    return (torch.as_tensor(rewards, dtype=torch.float32),
            torch.as_tensor(group_ids, dtype=torch.long))


class GRPOAdvantage:
    """GRPO: ``(r_i - mean_g) / (std_g + eps)``, std the unbiased (n-1) estimator of the group.

    A group of one sample, or whose rewards are all equal, gets 0 (see ``grpo_advantages``).
    """

    group_based: ClassVar[bool] = True
    token_level: ClassVar[bool] = False

    class Config(BaseModel):
        """Options of the GRPO advantage."""

        model_config = ConfigDict(extra="forbid")

        eps: float = Field(1e-6, gt=0.0)
        """Added to the group std before dividing."""
        normalize_std: bool = True
        """Divide by the group std; false gives Dr. GRPO's unscaled advantage."""

    def __init__(self, config: GRPOAdvantage.Config, context: AlgorithmContext) -> None:
        self.config = config
        self.context = context

    def compute(self, rewards: Any, group_ids: Any) -> Any:
        from relax.algo.advantages import grpo_advantages

        rewards, group_ids = _tensors(rewards, group_ids)
        return grpo_advantages(rewards, group_ids, normalize_std=self.config.normalize_std,
                               eps=self.config.eps)


class _UnscaledGroupAdvantage:
    """Shared shape of the option-free group estimators: one pure function over rewards and groups."""

    group_based: ClassVar[bool] = True
    token_level: ClassVar[bool] = False
    estimator: ClassVar[str]
    """Name of the function in ``relax.algo.advantages``."""

    class Config(BaseModel):
        """This estimator has no options."""

        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: BaseModel, context: AlgorithmContext) -> None:
        self.config = config
        self.context = context

    def compute(self, rewards: Any, group_ids: Any) -> Any:
        from relax.algo import advantages

        return getattr(advantages, self.estimator)(*_tensors(rewards, group_ids))


class DrGRPOAdvantage(_UnscaledGroupAdvantage):
    """Dr. GRPO: ``r_i - mean_g`` (no std division)."""

    estimator = "dr_grpo_advantages"


class RLOOAdvantage(_UnscaledGroupAdvantage):
    """RLOO: ``r_i`` minus the mean reward of the other samples of its group."""

    estimator = "rloo_advantages"
